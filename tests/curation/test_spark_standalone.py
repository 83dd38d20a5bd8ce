"""The Spark engine past local mode: the master from settings, and a standalone cluster (one
master, one worker, started here with pyspark's ``bin/spark-class``) giving the embedded
engine's datasets."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from factory.errors import SettingsError
from factory.settings import check_spark_master, get_settings
from tests.curation.conftest import CONFIG
from tests.waiting import wait_until


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[2,3]",
                                    "spark://10.0.0.5:7077", "k8s://https://10.0.0.1:6443",
                                    "sc://spark-connect:15002"])
def test_spark_master_accepts_local_standalone_kubernetes_and_connect(master: str) -> None:
    assert check_spark_master(master) == master


@pytest.mark.parametrize("master", ["yarn", "local[0]", "local[two]", "spark://", "mesos://h:5050",
                                    "http://master:7077", ""])
def test_spark_master_refuses_what_spark_cannot_run_on(
        master: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="FACTORY_SPARK_MASTER"):
        check_spark_master(master)
    if master:
        monkeypatch.setenv("FACTORY_SPARK_MASTER", master)
        with pytest.raises(SettingsError, match="FACTORY_SPARK_MASTER"):
            get_settings()


def test_spark_master_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FACTORY_SPARK_MASTER", raising=False)
    assert get_settings().spark_master is None
    monkeypatch.setenv("FACTORY_SPARK_MASTER", "spark://127.0.0.1:7077")
    assert get_settings().spark_master == "spark://127.0.0.1:7077"


def test_spark_connect_names_the_missing_client_packages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node without the ``spark`` extra's gRPC client gets one error naming the packages,
    not pyspark's import failure (the packages are hidden from the import system here)."""
    pytest.importorskip("pyspark")
    from factory.curation.spark import spark_session
    from factory.errors import FactoryError

    for name in ("grpc", "grpc_status"):
        monkeypatch.setitem(sys.modules, name, None)  # `import grpc` now fails
    with pytest.raises(FactoryError, match=r"needs the packages grpcio, grpcio-status in this "
                                           r"environment \(the `spark` extra installs them\)"):
        spark_session("sc://127.0.0.1:15002")


# -- a standalone cluster ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive_workers(ui_port: int) -> int:
    """ALIVE workers in the master's status JSON (0 while the master is not answering)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=2) as r:
            status = json.load(r)
    except (OSError, ValueError):  # not listening yet, or an empty page while it starts
        return 0
    return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon's process group (spark-class execs the JVM; a worker's executors
    are in its group), SIGKILL after 20 s; waits until no process of the group is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 20
    while _group_alive(proc.pid):
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[str]:
    """A standalone master and one worker (1 core, 1 GiB) on free ports of 127.0.0.1; yields
    the master URL once the master reports the worker ALIVE, and stops both by pid after."""
    pyspark = pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java")
    spark_home = Path(pyspark.__file__).parent
    env = {**os.environ, "SPARK_HOME": str(spark_home), "SPARK_DAEMON_MEMORY": "256m",
           "SPARK_LOG_DIR": str(tmp_path / "logs"), "SPARK_CONF_DIR": str(tmp_path / "conf"),
           "SPARK_NO_DAEMONIZE": "1"}
    (tmp_path / "conf").mkdir()
    port, ui = _free_port(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(spark_home / "bin" / "spark-class")
    procs: list[subprocess.Popen[bytes]] = []
    logs = []

    def start(name: str, args: list[str]) -> None:
        log = (tmp_path / f"{name}.log").open("wb")
        logs.append(log)
        procs.append(subprocess.Popen([spark_class, *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                         "--port", str(port), "--webui-port", str(ui)])
        start("worker", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                         "--cores", "1", "--memory", "1g", "--webui-port", str(_free_port()),
                         "--work-dir", str(tmp_path / "work"), url])
        def up() -> bool:
            if any(p.poll() is not None for p in procs):
                raise AssertionError("a daemon exited")
            return _alive_workers(ui) >= 1

        # The event: the master lists the worker as ALIVE. The timeout only bounds a failure.
        try:
            wait_until(up, 90, what="the worker ALIVE in the master's status")
        except AssertionError as exc:
            tails = {n: (tmp_path / f"{n}.log").read_text()[-2000:]
                     for n in ("master", "worker")}
            pytest.fail(f"the standalone cluster did not come up ({exc}): {tails}")
        yield url
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for log in logs:
            log.close()
    assert not any(_group_alive(p.pid) for p in procs)


def _tickets_with_planted_flaws() -> tuple[Any, Any]:
    """(every row, the templated tickets with their expected decontamination drops): the
    planted flaws of every cleaning step beside 150 templated tickets."""
    from factory.tasks.planted import Planted, planted, templated

    mixed, tickets = planted(80, config=CONFIG, seed=5), templated(150, seed=1, config=CONFIG)
    return Planted(rows=mixed.rows + tickets.rows), tickets


def _assert_embedded(result: Any, train: Any, ev: Any, drops: list[dict[str, Any]],
                     embedded: Any) -> None:
    """The Spark result (its datasets and drops read back) is the embedded engine's."""
    for mine, theirs in ((train, embedded.train), (ev, embedded.eval)):
        assert mine.num_rows == theirs.num_rows > 0
        assert mine.select(theirs.column_names).to_pylist() == theirs.to_pylist()
    assert drops == embedded.drops
    assert result.profile == embedded.profile
    assert result.report == embedded.report


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:pyspark.*")
@pytest.mark.filterwarnings("ignore:Delete operation did not match any records")
def test_standalone_cluster_gives_the_embedded_datasets(
        standalone: str, factory_home: Path, counter: Any, smollm2_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq
    from pyspark import cloudpickle

    from factory.curation.pipeline import curate
    from factory.curation.spark import commit, curate_spark, spark_session
    from factory.lake import Lake
    from tests.curation import test_pipeline
    from tests.curation.test_pipeline import LengthJudge

    data, tickets = _tickets_with_planted_flaws()
    # the judge scores in the worker's executor; at 80 it drops 12 samples here, and every
    # other step still drops some (both decontamination views included)
    config = replace(CONFIG, judge_threshold=80.0)
    embedded = curate(data.table(), config, counter, judge=LengthJudge())
    assert set(tickets.expected.items()) <= {(d["sample_id"], d["reason"])
                                             for d in embedded.drops}
    assert embedded.drops_by_reason()["judge_below_threshold"] > 0
    path = factory_home / "in.parquet"
    pq.write_table(data.table(), path)
    monkeypatch.setenv("FACTORY_SPARK_MASTER", standalone)
    # one executor of the worker's one core; 2 shuffle partitions as locally (Spark's 200 cost
    # ~3 minutes of task overhead here)
    spark = spark_session(get_settings().spark_master, conf={
        "spark.executor.memory": "1g", "spark.cores.max": "1",
        "spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"})
    try:
        assert spark.sparkContext.master == standalone
        # the executor cannot import the tests package: ship the judge's class by value (a
        # deployment's judge is in ``factory``, installed on every node)
        cloudpickle.register_pickle_by_value(test_pipeline)
        result = curate_spark(spark, spark.read.parquet(str(path)), config, str(smollm2_dir),
                              judge=LengthJudge())
        train, ev = result.train.toArrow(), result.eval.toArrow()
        drops = result.drops.toArrow().to_pylist()
        # the work ran in the worker's executor, not in a local one
        executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
        lake = Lake()
        staging = lake.settings.warehouse / "spark-staging"
        commit(lake.session(run_id="r1", asset_key="dataset"), "exp", result, str(staging))
    finally:
        cloudpickle.unregister_pickle_by_value(test_pipeline)
        spark.stop()
        gc.collect()
    assert executors == 2  # the driver's block manager and the worker's executor
    _assert_embedded(result, train, ev, drops, embedded)
    back = lake.read("dataset_train").sort_by("sample_id")
    assert back.column("sample_id").to_pylist() == embedded.train.column("sample_id").to_pylist()


# -- a Spark Connect server --------------------------------------------------------------------

@pytest.fixture
def connect_server(tmp_path: Path) -> Iterator[str]:
    """A Spark Connect server (``SparkConnectServer`` through pyspark's ``bin/spark-submit``,
    over a ``local[1]`` master) on a free port of 127.0.0.1; yields its ``sc://`` URL once its
    log says it started, and stops it by process group after."""
    pyspark = pytest.importorskip("pyspark")
    from factory.curation.spark import CONNECT_PACKAGES, _importable

    if not all(_importable(p) for p in CONNECT_PACKAGES):
        pytest.skip("the Spark Connect client's packages are not installed")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java")
    spark_home = Path(pyspark.__file__).parent
    # the server's Python workers run this interpreter (the venv that has ``factory``), as a
    # deployment's Connect server runs the factory image's
    env = {**os.environ, "SPARK_HOME": str(spark_home), "SPARK_CONF_DIR": str(tmp_path / "conf"),
           "PYSPARK_PYTHON": sys.executable}
    (tmp_path / "conf").mkdir()
    port = _free_port()
    log_path = tmp_path / "connect.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(spark_home / "bin" / "spark-submit"), "--class",
             "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", "local[1]",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.driver.memory=1g", "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.shuffle.partitions=2",
             "--conf", "spark.default.parallelism=2", "--name", "factory-test-connect",
             "spark-internal"], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        def started() -> bool:
            if proc.poll() is not None:
                raise AssertionError("the server exited")
            return "Spark Connect server started" in log_path.read_text(errors="replace")

        # The event: the server logs that it listens. The timeout only bounds a failure.
        try:
            wait_until(started, 120, what="the Spark Connect server's start")
        except AssertionError as exc:
            pytest.fail(f"the Spark Connect server did not start ({exc}): "
                        + log_path.read_text(errors="replace")[-3000:])
        yield f"sc://127.0.0.1:{port}"
    finally:
        _stop(proc)
    assert not _group_alive(proc.pid)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.heavy  # ~2 minutes on 2 cores: in make test-heavy, outside make test's budget
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:pyspark.*")
def test_spark_connect_gives_the_embedded_datasets(
        connect_server: str, factory_home: Path, counter: Any, smollm2_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Spark Connect (no RDDs, no SparkContext in the client) the engine's row
    function, split groups and cleaning steps give the embedded engine's datasets, drops,
    profile and report."""
    import pyarrow.parquet as pq

    from factory.curation.pipeline import curate
    from factory.curation.spark import curate_spark, spark_session

    data, tickets = _tickets_with_planted_flaws()
    embedded = curate(data.table(), CONFIG, counter)
    path = factory_home / "in.parquet"
    pq.write_table(data.table(), path)
    monkeypatch.setenv("FACTORY_SPARK_MASTER", connect_server)
    spark = spark_session(get_settings().spark_master)
    try:
        assert spark.client is not None  # a Connect session, not a classic one
        result = curate_spark(spark, spark.read.parquet(str(path)), CONFIG, str(smollm2_dir))
        train, ev = result.train.toArrow(), result.eval.toArrow()
        drops = result.drops.toArrow().to_pylist()
    finally:
        spark.stop()
        gc.collect()
    _assert_embedded(result, train, ev, drops, embedded)
