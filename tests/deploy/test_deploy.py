"""The loop on the tiny model: ``run_experiment`` (what ``factory run`` does) takes an
experiment from its samples through Dagster to a live v1 (best checkpoint); the endpoint answers
the official ``openai`` SDK through the gateway (streaming and not) and the calls land in
``samples`` tagged with the version; v1 -> v2 (``factory deploy --checkpoint``, another
process) under continuous requests loses none; rollback and undeploy work from other processes.

The tests share one factory home and run in order, because every server start costs ~15 s on
two cores and the training run a minute.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from factory.deploy import Deployer
from factory.gateway import ServerThread, load_routes
from factory.lake import Lake, Lineage, walk_lineage
from factory.process import is_alive
from tests.deploy.conftest import factory_cli
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # under a second test worker
MODEL = "factory/exp"
MESSAGES = [{"role": "user", "content": "Extract the fields: Hi, I am Ana from Acme."}]


def _client(gateway: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0,
                         timeout=60)


def _route_version(gateway: ServerThread) -> str | None:
    route = gateway.app.routes.get(MODEL)
    return route.version if route else None


def _served(endpoint: str) -> list[str]:
    """The adapters the engine at ``endpoint`` serves."""
    listed = httpx.get(endpoint + "/models", timeout=30).json()["data"]
    return sorted(m["id"] for m in listed if not m["id"].endswith("-base"))


def _captured(lake: Lake, version: str) -> int:
    if not lake.exists("samples"):
        return 0
    # The sample's model is the one that answered (the adapter the route rewrote the name to).
    return int(lake.sql("SELECT count(*) AS n FROM samples WHERE model = ? AND "
                        "tags['route_version'] = ?", [f"exp-{version}", version]
                        ).column("n")[0].as_py())


def test_run_takes_the_experiment_to_a_live_endpoint_the_sdk_reaches(
        deploy_home: Path, gateway: ServerThread) -> None:
    from factory.ingest import RawRecord, ingest_records
    from factory.tasks import generate_records

    lake = Lake()
    # Stamped like the ingest asset's commits: samples record the raw_traces snapshot.
    ingest_records(lake, [RawRecord(payload=r, source="upload", received_at=datetime.now(UTC),
                                    tags={"project": "demo"}) for r in generate_records(30, 0)],
                   lineages={"samples": Lineage(run_id="test-ingest", asset_key="samples")})
    run = factory_cli("run", "exp", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"base_score", "best_score", "best_step", "endpoint", "model",
            "factory_home"} <= set(out)
    assert out["model"] == MODEL and out["best_step"] == 2
    assert out["base_score"] is not None and out["best_score"] is not None
    assert "checkpoint_evals [" in run.stderr and "mean score" in run.stderr
    assert "deployment [exp]: success" in run.stderr
    kinds = {r["kind"] for r in lake.sql("SELECT DISTINCT kind FROM eval_scores").to_pylist()}
    assert kinds == {"base", "checkpoint", "reference"}
    # The training step shows the plan's training seconds beside the measured ones.
    import dagster as dg

    from factory.app.instance import instance

    [trained] = instance().fetch_materializations(dg.AssetKey("training_run"), limit=1).records
    shown_md = trained.asset_materialization.metadata if trained.asset_materialization else {}
    assert shown_md["predicted_train_s"].value > 0 and shown_md["measured_train_s"].value > 0
    v1 = Deployer().live("exp")
    assert v1 is not None and v1.version == "v1" and out["endpoint"] == v1.endpoint
    best = lake.sql("SELECT path FROM best_checkpoints").column("path")[0].as_py()
    assert v1.checkpoint == best and v1.step == 2
    # Lineage, end to end: from the live deployment's snapshot back through the checkpoint
    # choice, its evals, the checkpoint, the run, its plan and dataset, to the raw traces.
    tree = walk_lineage(lake, "deployments")
    assert "best_checkpoints" in {n["table"] for n in tree["upstream"]}
    shown = factory_cli("lineage", "deployments", "--format", "json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    shown_tree = json.loads(shown.stdout)
    assert {"deployments", "best_checkpoints", "eval_scores", "rubrics", "checkpoints",
            "training_events", "training_runs", "training_plans", "dataset_profile",
            "dataset_train", "dataset_eval", "samples", "raw_traces"} <= _tables(shown_tree)
    to_checkpoint = _chain_to(shown_tree, "checkpoints")
    assert [n["table"] for n in to_checkpoint] == [
        "deployments", "best_checkpoints", "eval_scores", "checkpoints"]
    assert [n["asset_key"] for n in to_checkpoint] == [
        "deployment", "best_checkpoint", "checkpoint_evals", "checkpoints"]
    # From the checkpoint: its events, the run's submit commit, the run's data, the traces
    # (walked from the checkpoint itself: in the whole tree a snapshot is expanded once, where
    # the walk first meets it, and the eval scores' read of dataset_eval comes first).
    checkpoint = walk_lineage(lake, "checkpoints", to_checkpoint[-1]["snapshot_id"])
    to_traces = [n["table"] for n in _chain_to(checkpoint, "raw_traces")]
    assert to_traces[:3] == ["checkpoints", "training_events", "training_runs"], to_traces
    assert to_traces[-2:] == ["samples", "raw_traces"], to_traces
    run_node = _chain_to(checkpoint, "training_runs")[-1]
    assert set(run_node["reads"]) == {"training_plans", "dataset_train", "dataset_eval"}
    assert run_node["asset_key"] == "training_run"
    plan = walk_lineage(lake, "training_plans", run_node["reads"]["training_plans"])
    assert {"dataset_profile", "samples", "raw_traces"} <= _tables(plan)  # the plan's data
    wait_until(lambda: _route_version(gateway) == "v1", what="route to v1")

    client = _client(gateway)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                            max_tokens=8)
    assert answer.model == "exp-v1"
    assert answer.choices[0].message.content
    stream: Any = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    # The flusher commits within a second when idle; the deadline only bounds a failure, whose
    # report says what the flusher did. (The SDK hangs up on [DONE], often before the
    # upstream's end of body reaches the gateway: the streamed capture must still be complete,
    # not rejected as cut off.)
    try:
        wait_until(lambda: _captured(lake, "v1") >= 2, timeout_s=120,
                   what="both calls in samples")
    except AssertionError as e:  # say where the captures went
        raise AssertionError(f"{e}; {_flusher_report(gateway)}") from None


def _flusher_report(gateway: ServerThread) -> str:
    """What the gateway's flusher did, and why ingest rejected the proxy captures it did."""
    flusher = gateway.app.flusher
    if flusher is None:
        return "the gateway has no flusher"
    lake = Lake()
    reasons = (lake.sql("SELECT reason FROM rejected_traces WHERE source = ?", ["proxy"])
               .column("reason").to_pylist() if lake.exists("rejected_traces") else [])
    return (f"flusher {'running' if flusher.running else 'stopped'}, committed "
            f"{flusher.num_committed} (rejected {flusher.num_rejected}: {reasons[:3]}), "
            f"failures {flusher.num_failures}, last error {flusher.last_error!r}")


def _tables(node: dict[str, Any]) -> set[str]:
    return {node["table"]}.union(*(_tables(up) for up in node["upstream"]))


def _chain_to(node: dict[str, Any], table: str) -> list[dict[str, Any]]:
    """The first path (depth first, reads in name order) from ``node`` down to ``table``."""
    if node["table"] == table:
        return [node]
    for up in node["upstream"]:
        below = _chain_to(up, table)
        if below:
            return [node, *below]
    return []


def _hammer(gateway: ServerThread, stop: threading.Event, results: list[tuple[str, str]],
            stream: bool) -> None:
    client = _client(gateway)
    while not stop.is_set():
        try:
            if stream:
                chunks: list[Any] = list(client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))  # type: ignore[arg-type]
                model = next(c.model for c in chunks)
            else:
                model = client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4).model  # type: ignore[arg-type]
            results.append(("stream" if stream else "plain", model))
        except Exception as exc:  # every failure is a finding: collected, asserted below
            results.append(("error", repr(exc)))


def test_switch_to_v2_under_continuous_requests_loses_none(
        deploy_home: Path, adapters: dict[str, Path], gateway: ServerThread) -> None:
    v1 = Deployer().live("exp")
    assert v1 is not None and v1.version == "v1"
    stop = threading.Event()
    results: list[tuple[str, str]] = []
    workers = [threading.Thread(target=_hammer, args=(gateway, stop, results, s), daemon=True)
               for s in (False, True)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: len(results) >= 4, what="traffic on v1")
        # Another process deploys v2; it returns once v2 serves and v1 has drained and stopped.
        out = factory_cli("deploy", "exp", "--checkpoint", str(adapters["b"]), "--threads", "1",
                          "--drain-s", "1", "--format", "json")
        assert out.returncode == 0, out.stderr[-3000:]
        seen_after = len(results)
        wait_until(lambda: len(results) >= seen_after + 4, what="traffic after the switch")
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)

    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[:3]
    kinds = [k for k, _ in results]
    models = [m for _, m in results]
    assert "exp-v1" in models and models[-1] == "exp-v2"
    # Per client, once v2 answered, v1 never did again: the switch is one-way. (Across the two
    # clients a slow v1 answer may complete after the other's first v2 answers.)
    for worker in ("plain", "stream"):
        seen = [m for w, m in zip(kinds, models, strict=True) if w == worker]
        assert seen and "exp-v1" not in seen[seen.index("exp-v2"):], (worker, seen)
    v2 = json.loads(out.stdout.strip().splitlines()[-1])
    assert v2["version"] == "v2" and is_alive(v2["pid"])  # outlives the CLI process
    # v2 is an adapter loaded into v1's engine (one server for the base model), and v1's
    # adapter is unloaded from it once drained.
    assert v2["engine"] == v1.engine and v2["pid"] == v1.pid and v1.engine
    assert _served(v1.endpoint) == ["exp-v2"]
    versions = {d.version: d for d in Deployer().versions("exp")}
    assert versions["v1"].status == "stopped" and versions["v2"].status == "live"
    lake = Lake()
    wait_until(lambda: _captured(lake, "v2") >= 1, what="v2 calls in samples")


def test_rollback_then_undeploy_from_other_processes(
        deploy_home: Path, gateway: ServerThread) -> None:
    v2 = Deployer().live("exp")
    assert v2 is not None and v2.version == "v2"
    out = factory_cli("rollback", "exp", "--threads", "1", "--drain-s", "0.5", "--format",
                      "json")
    assert out.returncode == 0, out.stderr[-3000:]
    back = json.loads(out.stdout.strip().splitlines()[-1])
    assert back["version"] == "v1" and back["status"] == "live"
    # The rollback is v1's adapter loaded into the same engine again and v2's unloaded.
    assert back["pid"] == v2.pid and _served(v2.endpoint) == ["exp-v1"]
    wait_until(lambda: _route_version(gateway) == "v1", what="route back to v1")
    answer = _client(gateway).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert answer.model == "exp-v1"

    listed = factory_cli("deployments", "exp", "--all", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    rows: dict[str, Any] = {r["version"]: r for r in json.loads(listed.stdout)}
    assert rows["v1"]["status"] == "live" and rows["v1"]["alive"] is True
    assert rows["v2"]["status"] == "stopped" and rows["v2"]["alive"] is False

    out = factory_cli("undeploy", "exp", "--drain-s", "0.2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not is_alive(back["pid"])
    assert MODEL not in load_routes(Lake())
    wait_until(lambda: _route_version(gateway) is None, what="route removed")
    # Without a route the name goes to the provider's default upstream (the stand-in here).
    answer = _client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert (answer.choices[0].message.content or "").startswith("echo: ")

    again = factory_cli("undeploy", "exp")
    assert again.returncode == 2 and "has no live deployment" in again.stderr
    assert Deployer().live("exp") is None
    assert not [d.version for d in Deployer().versions("exp") if d.alive]  # nothing left running
