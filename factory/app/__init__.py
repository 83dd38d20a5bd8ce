"""The application layer: the CLI and its commands, and the clients (``factory run``,
``factory demo``) that submit to the Dagster instance and follow its runs.

It sits above the composition root (``factory.definitions``); nothing in the factory library
imports it (an import-linter contract, indirect imports included).
"""
