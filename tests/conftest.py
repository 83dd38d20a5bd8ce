"""Shared fixtures: a fresh ``$FACTORY_HOME`` per test, a throwaway PostgreSQL cluster for the
shared-state tests, and base models built once per session.

Models are cached in ``$FACTORY_TEST_MODELS`` (default ``.cache/test-models`` in the checkout,
ignored by git) so repeated runs skip the ~20 s GGUF dequantization.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings

import torch

# Triton runs on CPU only in its interpreter, and only when this is set before triton is first
# imported (importing a transformers model class can import it): set it before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Import hypothesis (a pytest plugin, so pytest rewrites its modules on import) now rather than
# lazily in its end-of-session hook: on Python 3.11.7 that late ast.parse has failed with
# "SystemError: AST constructor recursion depth mismatch" after sessions that ran Spark.
import hypothesis  # noqa: F401
import pytest

from tests.postgres import Cluster, server_bin

ROOT = Path(__file__).resolve().parent.parent

# Plans in tests use the reference time constants: the same plan on every machine, and no
# calibration run inside a test (tests of the host's time model set FACTORY_TIME_MODEL=host).
os.environ["FACTORY_TIME_MODEL"] = "reference"


def _models_cache() -> Path:
    path = Path(os.environ.get("FACTORY_TEST_MODELS") or ROOT / ".cache" / "test-models")
    path.mkdir(parents=True, exist_ok=True)
    return path


FILE_SECONDS = ROOT / "tests" / "file_seconds.json"
"""Seconds each slow test file took in the last full run (the durations ``make test`` prints,
summed per file); a file not named is taken as fast."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first, each file's tests in their own order. Under ``--dist loadfile
    --no-loadscope-reorder`` the workers take files in this order, longest first, so the short
    files fill the end of the run on both workers instead of one worker ending alone on a long
    file (xdist's own order is by number of tests, which puts the long one-test files last)."""
    seconds = json.loads(FILE_SECONDS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))


SUITE_BUDGET_S = 25 * 60
"""pytest's wall time in ``make test`` on 2 idle cores at most (issue 47); printed at the end."""
_session_start: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _session_start.append(time.monotonic())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The run's wall time against ``SUITE_BUDGET_S`` (in the controller of a two-worker run
    too; a worker prints nothing)."""
    if _session_start and not hasattr(terminalreporter.config, "workerinput"):
        took = time.monotonic() - _session_start[0]
        verdict = "within" if took <= SUITE_BUDGET_S else "OVER"
        terminalreporter.write_line(
            f"pytest wall time: {took:,.0f} s, {verdict} the {SUITE_BUDGET_S // 60}-minute budget "
            f"of make test on 2 idle cores ({os.cpu_count()} cores here, load "
            f"{os.getloadavg()[0]:.1f} at the end)")


_previous_test: list[str] = []


@pytest.fixture(autouse=True)
def default_signals(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts with SIGTERM unblocked and not ignored, and SIGINT not ignored.

    A process launched by a test (a stand-in trainer, a shell script, a server) inherits an
    ignored or blocked SIGTERM across exec and then cannot be stopped gracefully. A pytest run
    started in the background (``nohup``, ``&`` in a script: CI) ignores SIGINT from its start,
    and Dagster, leaving any in-process execution's interrupt capture, sets SIGTERM to SIGINT's
    handler (``dagster._utils.interrupts``): ignored from then on (two-worker runs: stand-in
    trainers that survived their SIGTERM until the SIGKILL and held the local provider's only
    slot). What a test finds so is named in the warnings summary, and reset here."""
    found = []
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if signal.SIGTERM in mask:
        found.append("SIGTERM blocked")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        found.append("SIGTERM ignored")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        found.append("SIGINT ignored")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if found:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # reported in the summary, not failing this test
            warnings.warn(f"{', '.join(found)} at the start of {request.node.nodeid}; the test "
                          f"before it in this process: "
                          f"{_previous_test[-1] if _previous_test else '(none)'}", stacklevel=1)
    _previous_test[:] = [request.node.nodeid]
    yield


@pytest.fixture()
def factory_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, empty factory: ``FACTORY_HOME`` and ``DAGSTER_HOME`` under a tmp dir."""
    home = tmp_path / "factory-home"
    home.mkdir()
    monkeypatch.setenv("FACTORY_HOME", str(home))
    # the embedded default, the composition root's default resources and the default gateway
    # with no key for the factory's own clients, unless a test says (a developer's shell may set
    # any of them)
    for name in ("FACTORY_DATABASE_URL", "FACTORY_WAREHOUSE", "FACTORY_SHARED_DIR",
                 "FACTORY_CATALOG", "FACTORY_DEPLOYER", "FACTORY_JUDGE", "FACTORY_PROVIDERS",
                 "FACTORY_SPARK_MASTER", "FACTORY_GATEWAY_URL", "FACTORY_GATEWAY_KEY",
                 "FACTORY_TIME_MODEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FACTORY_TIME_MODEL", "reference")
    monkeypatch.setenv("FACTORY_MODELS_DIR", str(_models_cache()))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    (home / "dagster").mkdir()
    yield home


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """A PostgreSQL cluster for the session (``tests/postgres.py``); skipped only where the
    server binaries are absent (``make sysdeps`` installs them)."""
    if server_bin() is None:
        pytest.skip("no PostgreSQL server binaries (initdb); `make sysdeps` installs them")
    cluster = Cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture()
def database_url(postgres_cluster: Cluster) -> str:
    """The URL of a new, empty database."""
    return postgres_cluster.new_database()


@pytest.fixture()
def shared_factory(factory_home: Path, database_url: str, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Path:
    """``factory_home`` with its shared state in PostgreSQL and a shared warehouse folder
    (returned)."""
    warehouse = tmp_path / "shared-warehouse"
    monkeypatch.setenv("FACTORY_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTORY_WAREHOUSE", str(warehouse))
    return warehouse


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory (built once, cached across runs)."""
    from factory.trainer.base_models import SMOLLM2_NAME, build_smollm2

    return build_smollm2(_models_cache() / SMOLLM2_NAME)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A random-init 2-layer Llama with SmolLM2's tokenizer (3.2M parameters)."""
    from factory.trainer.base_models import TINY_NAME, build_tiny_llama

    return build_tiny_llama(_models_cache() / TINY_NAME)


@pytest.fixture(scope="session", params=["llama", "qwen3", "gemma3", "qwen2_5_vl"])
def tiny_family_dir(request: pytest.FixtureRequest) -> Path:
    """A random-init 2-layer model of each recipe family (llama, qwen3, gemma3, and qwen2_5_vl
    with a one-block vision tower), with a real tokenizer of its chat format (``build_tiny``)."""
    from factory.trainer.base_models import build_tiny

    return build_tiny(request.param, _models_cache() / f"tiny-{request.param}")


@pytest.fixture(scope="session")
def tiny_gemma3_dir() -> Path:
    """The random-init 2-layer Gemma 3 of ``tiny_family_dir`` alone."""
    from factory.trainer.base_models import build_tiny

    return build_tiny("gemma3", _models_cache() / "tiny-gemma3")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M as a plain HF directory (built once, about 95 s; cached across runs)."""
    from factory.trainer.base_models import GEMMA3_NAME, build_gemma3

    return build_gemma3(_models_cache() / GEMMA3_NAME)


@pytest.fixture()
def judge_server() -> Iterator[str]:
    """A judge model on 127.0.0.1 (``tests.evals.conftest.JudgeHandler``): its ``/v1`` URL."""
    from http.server import ThreadingHTTPServer

    from tests.evals.conftest import JudgeHandler

    JudgeHandler.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
