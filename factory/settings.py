"""Where the factory keeps its embedded state, read from the environment once per call.

Everything the factory writes lives under ``$FACTORY_HOME`` (default ``./.factory``), so pointing
it at an empty folder gives a fresh factory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Paths of the embedded factory."""

    home: Path
    """Root of all embedded state (``$FACTORY_HOME``)."""
    experiments_dir: Path
    """Folder of experiment files (``$FACTORY_EXPERIMENTS_DIR``, default ``experiments/``)."""
    models_dir: Path
    """Built base models (``$FACTORY_MODELS_DIR``, default ``$FACTORY_HOME/models``)."""

    @property
    def catalog_db(self) -> Path:
        return self.home / "catalog.db"

    @property
    def warehouse(self) -> Path:
        return self.home / "warehouse"

    @property
    def blobs(self) -> Path:
        return self.home / "blobs"

    @property
    def checkpoints(self) -> Path:
        return self.home / "checkpoints"

    @property
    def spool(self) -> Path:
        return self.home / "spool"

    @property
    def uploads(self) -> Path:
        return self.home / "uploads"

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"

    @property
    def runs(self) -> Path:
        return self.home / "runs"

    def ensure(self) -> Settings:
        for path in (self.home, self.warehouse, self.blobs, self.checkpoints, self.spool,
                     self.uploads, self.dagster_home, self.runs, self.models_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self


def get_settings() -> Settings:
    """Read the settings from the environment (not cached: tests switch ``FACTORY_HOME``)."""
    home = Path(os.environ.get("FACTORY_HOME") or ".factory").absolute()
    experiments = Path(os.environ.get("FACTORY_EXPERIMENTS_DIR") or "experiments").absolute()
    models = Path(os.environ.get("FACTORY_MODELS_DIR") or home / "models").absolute()
    return Settings(home=home, experiments_dir=experiments, models_dir=models)
