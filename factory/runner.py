"""Materializing assets from the CLI through Dagster, in process, on the persistent instance.

The run lands in ``$FACTORY_HOME/dagster`` like a click in the UI would, so ``factory ui`` shows
it with its metadata and lineage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from factory.settings import get_settings


def instance() -> Any:
    """The Dagster instance under ``$FACTORY_HOME/dagster`` (``$DAGSTER_HOME`` wins if set)."""
    import dagster as dg

    settings = get_settings().ensure()
    os.environ.setdefault("DAGSTER_HOME", str(settings.dagster_home))
    config = settings.dagster_home / "dagster.yaml"
    if os.environ["DAGSTER_HOME"] == str(settings.dagster_home) and not config.exists():
        config.touch()  # the defaults (everything under DAGSTER_HOME), without Dagster's notice
    return dg.DagsterInstance.get()


def materialize(selection: Sequence[str], *, partition_key: str | None = None,
                run_config: Mapping[str, Any] | None = None,
                tags: Mapping[str, str] | None = None, raise_on_error: bool = True) -> Any:
    """Materialize the assets named in ``selection`` (Dagster asset selection strings)."""
    import dagster as dg

    from factory.definitions import defs

    specs = list(defs.assets or [])
    config = dict(run_config or {})
    # Step-level DEBUG lines drown the CLI's own output; the UI keeps the full event log.
    config.setdefault("loggers", {"console": {"config": {"log_level": "WARNING"}}})
    resources = dict(defs.resources or {})
    return dg.materialize(
        specs, selection=list(selection), instance=instance(), resources=resources,  # type: ignore[arg-type]
        partition_key=partition_key, run_config=config, tags=dict(tags or {}),
        raise_on_error=raise_on_error,
    )
