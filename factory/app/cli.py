"""The ``factory`` command line. Subcommands live one per module in ``factory/app/commands``.

A user mistake (``FactoryError``, ``ValueError`` from validation) prints one line on stderr and
exits 2; tracebacks are kept for real bugs. A closed stdout (``factory sql ... | head``) ends the
command quietly. SIGTERM (``kill``, ``timeout``, a CI job's cancel) is a Ctrl-C: the command
stops what it started (``factory run`` cancels its chain and stops the daemon it started) and
exits 143, where Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import factory.app.commands as commands
from factory import __version__
from factory.errors import FactoryError
from factory.process import interrupt, interrupt_handled


def build_parser() -> argparse.ArgumentParser:
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
        with _terminate_as_interrupt():
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (FactoryError, ValueError) as exc:
        print(f"factory {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    finally:
        interrupt_handled()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a Ctrl-C's ``KeyboardInterrupt`` would be, so every cleanup that
    handles an interrupt handles it too."""


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` while the block runs, where SIGTERM has its default action
    (an inherited ignore or another handler is left alone), in the main thread only; the
    previous handler is back afterwards (``main`` also runs inside other programs' processes)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        interrupt(Terminated)

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
