"""The ``factory`` command line. Subcommands live one per module in ``factory/app/commands``.

A user mistake (``FactoryError``, ``ValueError`` from validation) prints one line on stderr and
exits 2; tracebacks are kept for real bugs. A closed stdout (``factory sql ... | head``) ends the
command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
from collections.abc import Sequence

from factory import __version__
from factory.errors import FactoryError


def build_parser() -> argparse.ArgumentParser:
    import factory.app.commands as commands

    parser = argparse.ArgumentParser(
        prog="factory", description="The factory: LLM traffic in, fine-tuned models out.")
    parser.add_argument("--version", action="version", version=f"factory {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (FactoryError, ValueError) as exc:
        print(f"factory {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _reader_gone() -> int:
    """Stdout's reader closed the pipe (``factory sql ... | head``): end quietly with the
    status of a process killed by SIGPIPE, as Unix tools do. Stdout is pointed at /dev/null
    so that the interpreter's last flush of the unwritten rest fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
