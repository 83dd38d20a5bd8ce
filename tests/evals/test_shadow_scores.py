"""Shadow evaluation from live calls to promotion: pairs the real gateway stored are scored by
``shadow_scores`` on the experiment's rubric against the frontier's answers, and the experiment's
``deploy: {shadow: ...}`` policy promotes the candidate behind ``factory/<experiment>``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest

from factory.evals.judges import EmbeddedJudge
from factory.evals.rubric import Criterion, Rubric
from factory.evals.shadow import ShadowSummary, score_pairs, summarize
from factory.gateway import Gateway, ServerThread
from factory.gateway.routes import load_routes
from factory.gateway.shadow import ShadowRule, register_shadow
from factory.gateway.standin import StandIn
from factory.inference import free_port
from factory.lake import Lake
from tests.gateway.conftest import make_config
from tests.waiting import wait_until

ROUTE = "gpt-4o-mini"
LABELS = Rubric(criteria=(Criterion(name="label", description="the same label",
                                    check="label_match",
                                    params={"labels": ["billing", "bug", "other"]}),))


@pytest.fixture(scope="module")
def upstream() -> Iterator[ServerThread]:
    """The frontier model: a stand-in that answers ``echo: <text>``."""
    with ServerThread(StandIn()) as srv:
        yield srv


def _message(text: str) -> str:
    return json.dumps({"role": "assistant", "content": [{"type": "text", "text": text}]})


def _pair(pair_id: str, frontier: str, candidate: str | None, error: str | None = None
          ) -> dict[str, Any]:
    return {"pair_id": pair_id, "experiment": "triage", "version": "v1",
            "request": json.dumps({"model": ROUTE, "messages": [
                {"role": "user", "content": "my card was charged twice"}]}),
            "frontier_message": _message(frontier),
            "candidate_message": _message(candidate) if candidate is not None else None,
            "candidate_error": error}


def test_each_pair_is_scored_against_the_frontier_answer(factory_home: Path) -> None:
    rows = score_pairs([_pair("a", "billing", "billing"), _pair("b", "billing", "bug"),
                        _pair("c", "billing", None, "candidate gave no answer: upstream did "
                                                    "not answer within 60s")],
                       LABELS, EmbeddedJudge())
    by_id = {r["pair_id"]: r for r in rows}
    assert by_id["a"]["score"] == 1.0 and by_id["a"]["passed"] is True
    assert by_id["b"]["score"] == 0.0 and by_id["b"]["passed"] is False
    assert "bug" in by_id["b"]["assessment"]
    assert by_id["c"]["score"] == 0.0 and by_id["c"]["passed"] is False
    assert "did not answer within 60s" in by_id["c"]["assessment"]
    # A garbage answer: the label check fails it with its reason.
    garbage = score_pairs([_pair("d", "billing", "{{{ <html>")], LABELS, EmbeddedJudge())[0]
    assert garbage["score"] == 0.0 and not garbage["passed"]


@pytest.fixture()
def candidate_server() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A real HTTP server process standing in for a candidate deployment's inference server
    (its argv carries ``--port``, which is how the deployer recognizes its servers)."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "factory.gateway.standin", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _up(port), what="the candidate server answers")
        yield port, proc
    finally:
        proc.kill()
        proc.wait()


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _materialize(experiment: str) -> Any:
    from factory.assets.shadow import shadow_scores
    from factory.resources.deployer import CPUDeployerResource
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", [experiment])
    return dg.materialize([shadow_scores], instance=instance, partition_key=experiment,
                          resources={"lake": LakeResource(), "judge": EmbeddedJudgeResource(),
                                     "deployer": CPUDeployerResource(drain_s=0.0)})


# 4 of 4 pairs pass: agreement 1.000, but its 95% interval is [0.510, 1.000]: a 0.5 policy
# promotes, a 0.9 one does not (a high share of few pairs), nor does a policy without agreement.
@pytest.mark.parametrize("agreement, promoted", [(0.5, True), (0.9, False), (None, False)])
def test_live_pairs_are_scored_and_the_policy_promotes_the_candidate(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, upstream: ServerThread,
        candidate_server: tuple[int, subprocess.Popen[bytes]], agreement: float | None,
        promoted: bool) -> None:
    port, proc = candidate_server
    exps = factory_home / "experiments"
    exps.mkdir()
    policy = f"{{route: {ROUTE}, agreement: {agreement if agreement else 'null'}, min_pairs: 4}}"
    (exps / "triage.yaml").write_text(
        "name: triage\nrecipe: smollm2-135m-lora\n"
        f"deploy: {{shadow: {policy}}}\n")
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exps))
    lake = Lake()
    now = datetime.now(UTC)
    # What the loop left: a rubric (exact answers) and a candidate version, live beside no
    # other; both the frontier and the candidate are stand-ins answering ``echo: <text>``.
    rubric = Rubric(criteria=(Criterion(name="same", description="the same answer",
                                        check="label_match", params={}),))
    lake.append("rubrics", [{"experiment": "triage", "version": rubric.version,
                             "source": "inline", "num_examples": 0,
                             "rubric": rubric.to_json(), "created_at": now}])
    endpoint = f"http://127.0.0.1:{port}/v1"
    lake.append("deployments", [{
        "name": "triage", "version": "v1", "checkpoint": str(factory_home / "ckpt"),
        "base_model": "smollm2-135m-instruct", "adapter": "triage-v1",
        "route_model": "factory/triage", "endpoint": endpoint, "backend": "transformers",
        "status": "candidate", "pid": proc.pid, "port": port, "log_path": "",
        "started_at": now, "updated_at": now}])
    register_shadow(ShadowRule(route=ROUTE, experiment="triage", version="v1",
                               base_url=endpoint, deployment="triage-v1"), lake=lake)
    app = Gateway(make_config(upstream))
    with ServerThread(app) as srv:
        wait_until(lambda: app.shadows.get(ROUTE) is not None, what="the gateway read the rule")
        for text in ("billing", "bug", "other", "billing"):
            answer = httpx.post(srv.url + "/v1/chat/completions",
                                json={"model": ROUTE,
                                      "messages": [{"role": "user", "content": text}]})
            assert answer.status_code == 200
        wait_until(lambda: lake.exists("shadow_pairs")
                   and lake.read("shadow_pairs").num_rows == 4, what="4 pairs")
    result = _materialize("triage")
    assert result.success
    meta = result.asset_materializations_for_node("shadow_scores")[0].metadata
    assert meta["num_scored_now"].value == 4 and meta["agreement"].value == 1.0
    # Two of the four requests are asked the same way ("billing"): one phrasing cluster.
    assert meta["agreement_interval"].value == \
        "1.000 [0.510, 1.000] n=4 in 3 clusters (Wilson, clustered)"
    summary = summarize(lake, "triage", "v1")
    assert (summary.num_pairs, summary.num_scored, summary.num_passed) == (4, 4, 4)
    from factory.deploy import Deployer

    live = Deployer(lake).live("triage")
    routes = load_routes(lake)
    if promoted:
        assert meta["promoted"].value == "v1"
        assert live is not None and live.version == "v1"
        assert routes["factory/triage"].base_url == endpoint
    else:
        assert meta["promoted"].value == ""
        assert live is None and "factory/triage" not in routes
    # A second materialization scores nothing twice.
    again = _materialize("triage")
    assert again.asset_materializations_for_node("shadow_scores")[0] \
        .metadata["num_scored_now"].value == 0


def _summary(num_scored: int, num_passed: int) -> ShadowSummary:
    return ShadowSummary(experiment="triage", version="v1", num_pairs=num_scored,
                         num_scored=num_scored, num_passed=num_passed, num_failed_calls=0,
                         agreement=num_passed / num_scored if num_scored else None,
                         mean_score=None)


def test_promotion_asks_the_interval_of_the_agreement_to_clear_the_policy() -> None:
    """The lower bound of the agreement's 95% Wilson interval must reach the policy's
    agreement: a high share of few pairs is refused."""
    every_one = _summary(20, 20)                      # 1.000, but [0.839, 1.000]
    assert every_one.agreement == 1.0 and not every_one.meets(0.9, 10)
    assert every_one.meets(0.8, 10)
    assert every_one.describe() == "1.000 [0.839, 1.000] n=20 (Wilson)"
    # At the default 200 pairs a 0.95 policy needs 197 passing (lower bound 0.957).
    assert _summary(200, 197).meets(0.95, 200)
    assert not _summary(200, 196).meets(0.95, 200)    # 0.980, lower bound 0.9497
    assert not _summary(199, 199).meets(0.5, 200)     # too few pairs, however many pass
    assert not _summary(0, 0).meets(0.0, 0) and _summary(0, 0).describe() == "no scored pairs"


def test_shadow_sensor_asks_for_scores_when_pairs_arrive(factory_home: Path) -> None:
    from factory.resources.lake import LakeResource
    from factory.sensors.shadow import shadow_sensor

    lake = Lake()

    def pairs(*ids: str, experiment: str = "triage") -> list[dict[str, Any]]:
        return [{**_pair(i, "billing", "billing"), "experiment": experiment,
                 "created_at": datetime.now(UTC)} for i in ids]

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("experiments", ["triage"])

        def tick(cursor: str | None) -> tuple[Any, str | None]:
            context = dg.build_sensor_context(instance=instance, cursor=cursor,
                                              resources={"lake": LakeResource()})
            return shadow_sensor(context), context.cursor

        result, cursor = tick(None)
        assert isinstance(result, dg.SkipReason)  # no pairs yet
        lake.append("shadow_pairs", pairs("a", "b"))
        [request], cursor = tick(cursor)
        assert request.partition_key == "triage" and "2 new shadow pair(s)" in \
            request.tags["factory/reason"]
        assert isinstance(tick(cursor)[0], dg.SkipReason)  # nothing new since
        # Pairs of an experiment without a partition are not requested.
        lake.append("shadow_pairs", pairs("c", experiment="gone") + pairs("d"))
        [again], cursor = tick(cursor)
        assert again.partition_key == "triage" and "1 new shadow pair(s)" in \
            again.tags["factory/reason"]
        assert again.run_key != request.run_key
