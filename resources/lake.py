"""``LakeResource`` (key ``lake``): the Iceberg lake, bound to the current run and asset.

Every asset opens the lake first, so this is where a step of a run checks that it runs on the
code its run started with (``factory.codepin``): a step of a run whose code changed on disk
fails here, before it does any work, with the changed files and the fix.
"""


from typing import Any

import dagster as dg

from factory.codepin import CodeChangedError, check_run
from factory.lake import Lake, LakeSession
from factory.settings import get_settings


class LakeResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The lake. ``home`` overrides ``$FACTORY_HOME`` (the embedded SQLite catalog lives there)."""

    home: str | None = None

    def lake(self) -> Lake:
        try:
            check_run()
        except CodeChangedError as exc:
            # A Failure: the step's message is the reason alone, and a retry would meet the
            # same tree.
            raise dg.Failure(str(exc), allow_retries=False) from None
        settings = get_settings()
        if self.home:
            from dataclasses import replace
            from pathlib import Path

            home = Path(self.home).absolute()
            settings = replace(settings, home=home, models_dir=home / "models")
        return Lake(settings)

    def session(self, context: Any) -> LakeSession:
        """A session stamped with the run id and the asset key being materialized."""
        if getattr(context, "has_assets_def", False) and len(context.assets_def.keys) == 1:
            key = context.asset_key.to_user_string()
        elif getattr(context, "has_assets_def", False):
            key = ",".join(sorted(k.to_user_string() for k in context.selected_asset_keys))
        else:
            key = context.op.name
        return self.lake().session(run_id=context.run.run_id, asset_key=key)
