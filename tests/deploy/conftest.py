"""Fixtures for the deploy tests: one factory home with a tiny experiment, an adapter of the
tiny model, and a lake-backed gateway (over a stand-in upstream) shared by the module, because
each deployed server costs ~15 s to start here; and, per test, a factory home whose training
run is still mid-run when a test interrupts or kills ``factory run`` (``home``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.gateway import Gateway, GatewayConfig, ServerThread
from factory.gateway.standin import StandIn
from tests.inference.conftest import make_adapter

ROOT = Path(__file__).resolve().parents[2]


EXPERIMENT = """name: exp
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 2, checkpoint_every_steps: 2}
eval: {judge: embedded, rubric: auto, max_samples: 3}
"""


# Far more steps than a test waits for: the trainer is mid-run when the interrupt comes.
LONG_EXPERIMENT = """name: exp
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 5000, checkpoint_every_steps: 5000}
eval: {judge: embedded, rubric: auto, max_samples: 3}
"""


def _folders(root: Path, tiny_model_dir: Path, experiment: str) -> tuple[Path, Path]:
    """``root/models`` with the tiny model as the recipe's base and ``root/experiments`` with
    ``exp.yaml`` holding ``experiment``: (models, experiments)."""
    models = root / "models"
    models.mkdir()
    (models / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    experiments = root / "experiments"
    experiments.mkdir()
    (experiments / "exp.yaml").write_text(experiment)
    return models, experiments


@pytest.fixture()
def home(factory_home: Path, tiny_model_dir: Path, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh factory for one test's ``factory run exp``: experiment ``exp`` of
    ``LONG_EXPERIMENT`` on 30 demo records, its recipe's base model being the tiny model."""
    from factory.ingest import RawRecord, ingest_records
    from factory.lake import Lake
    from factory.tasks import generate_records

    models, experiments = _folders(tmp_path, tiny_model_dir, LONG_EXPERIMENT)
    monkeypatch.setenv("FACTORY_MODELS_DIR", str(models))
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(experiments))
    ingest_records(Lake(), [RawRecord(payload=r, source="upload", received_at=datetime.now(UTC),
                                      tags={"project": "demo"})
                            for r in generate_records(30, 0)])
    return factory_home


@pytest.fixture(scope="module")
def deploy_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
                ) -> Iterator[Path]:
    """A factory for the whole module (servers and routes outlive single tests): experiment
    ``exp`` on the demo task, its recipe's base model being the tiny model."""
    root = tmp_path_factory.mktemp("deploy")
    home = root / "factory-home"
    (home / "dagster").mkdir(parents=True)
    models, experiments = _folders(root, tiny_model_dir, EXPERIMENT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FACTORY_HOME", str(home))
        mp.setenv("FACTORY_MODELS_DIR", str(models))
        mp.setenv("FACTORY_EXPERIMENTS_DIR", str(experiments))
        mp.setenv("DAGSTER_HOME", str(home / "dagster"))
        # Create the catalog before any thread (the gateway's route poller) races to do it.
        from factory.lake import Lake

        Lake().existing_tables()
        yield home
        _stop_leftovers(home)


def _stop_leftovers(home: Path) -> None:
    """Stop every server a failed test left running (by the pids the lake recorded)."""
    from factory.deploy import Deployer
    from factory.process import stop_group

    try:
        versions = Deployer().versions()
    except Exception:  # the lake was never created: nothing was deployed
        return
    for dep in versions:
        if dep.server_alive:
            stop_group(int(dep.pid or 0), timeout_s=10)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deploy-adapters")
    return {"b": make_adapter(tiny_model_dir, root / "b", seed=2)}


@pytest.fixture(scope="module")
def gateway(deploy_home: Path) -> Iterator[ServerThread]:
    """A gateway that writes captures to the lake and re-reads routes every 0.1 s."""
    with ServerThread(StandIn()) as upstream:
        config = GatewayConfig(port=0, openai_base_url=upstream.url + "/v1",
                               flush_interval_s=0.05, segment_max_age_s=0.05,
                               routes_poll_s=0.1, flush_retry_max_s=0.2)
        with ServerThread(Gateway(config)) as srv:
            yield srv


def factory_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``factory ARGS`` as its own process (the environment carries FACTORY_HOME)."""
    return subprocess.run([str(Path(sys.executable).parent / "factory"), *args],
                          env=dict(os.environ), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)

