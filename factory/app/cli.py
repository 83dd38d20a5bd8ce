"""The ``factory`` command line. Subcommands live one per module in ``factory/app/commands``.

A user mistake (``FactoryError``, ``ValueError`` from validation) prints one line on stderr and
exits 2; tracebacks are kept for real bugs.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
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
        return int(args.func(args) or 0)
    except (FactoryError, ValueError) as exc:
        print(f"factory {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
