"""Materializing assets from the CLI in this process, on the persistent instance.

For the commands that build one thing and print it (``factory base-model``, ``factory
dataset``): the run lands in ``$FACTORY_HOME/dagster`` like a click in the
UI would, so ``factory ui`` shows it with its metadata and lineage. The loop itself
(``factory run``) is not run this way: it is submitted to the instance (``factory.app.client``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from factory.app.instance import instance


def materialize(selection: Sequence[str], *, partition_key: str | None = None,
                run_config: Mapping[str, Any] | None = None,
                tags: Mapping[str, str] | None = None, raise_on_error: bool = True) -> Any:
    """Materialize the assets named in ``selection`` (Dagster asset selection strings)."""
    import dagster as dg

    # the definitions load Dagster, torch and every asset (seconds): the CLI imports this module
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


__all__ = ["instance", "materialize"]
