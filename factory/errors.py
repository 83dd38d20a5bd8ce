"""Named exceptions. A ``FactoryError`` is a user mistake: the CLI prints it as one line."""

from __future__ import annotations


class FactoryError(Exception):
    """An error the user can fix; shown without a traceback."""


class UnknownTableError(FactoryError):
    """A table name that the lake does not declare."""


class QueryError(FactoryError):
    """SQL that DuckDB refused."""


class SnapshotNotFoundError(FactoryError):
    """A snapshot id that the table does not have."""


class SettingsError(FactoryError):
    """Environment settings that contradict each other or cannot be used as given."""


class UnmigratedLakeError(FactoryError):
    """A shared catalog is configured while this home still holds an embedded lake."""
