"""Subcommands of the ``factory`` CLI, one module each, each with ``register(subparsers)``."""
