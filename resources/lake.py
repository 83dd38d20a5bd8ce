"""``LakeResource`` (key ``lake``): the Iceberg lake, bound to the current run and asset."""


from typing import Any

import dagster as dg

from factory.lake import Lake, LakeSession
from factory.settings import get_settings


class LakeResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The lake. ``home`` overrides ``$FACTORY_HOME`` (the embedded SQLite catalog lives there)."""

    home: str | None = None

    def lake(self) -> Lake:
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
