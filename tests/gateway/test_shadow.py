"""Shadow mode: a candidate answers a share of a route's calls in the background; the client's
call is answered by the frontier upstream as always, the pair lands in ``shadow_pairs`` and the
candidate's answer never becomes a capture."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.gateway import Gateway, ServerThread
from factory.gateway.shadow import ShadowRule, load_shadows, register_shadow
from factory.gateway.standin import StandIn
from factory.lake import Lake
from tests.gateway.conftest import make_config
from tests.waiting import wait_until

ROUTE = "gpt-4o-mini"


def chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": ROUTE, "messages": [{"role": "user", "content": text}], **extra}


def _metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, flags=re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _rows(lake: Lake, table: str) -> list[dict[str, object]]:
    return lake.read(table).to_pylist() if lake.exists(table) else []


@pytest.fixture()
def candidate() -> Iterator[ServerThread]:
    with ServerThread(StandIn(slow_s=6.0)) as srv:
        yield srv


@contextlib.contextmanager
def _shadowing(app: Gateway, lake: Lake, base_url: str, *, deployment: str = "cand-v1",
               share: float = 1.0) -> Iterator[ServerThread]:
    register_shadow(ShadowRule(route=ROUTE, experiment="support", version="v1",
                               base_url=base_url, deployment=deployment, share=share), lake=lake)
    with ServerThread(app) as srv:
        wait_until(lambda: app.shadows.get(ROUTE) is not None, what="the gateway read the rule")
        yield srv


def test_pairs_are_stored_and_the_candidate_is_never_captured(
        factory_home: Path, upstream: ServerThread, candidate: ServerThread) -> None:
    lake = Lake()
    app = Gateway(make_config(upstream))
    with _shadowing(app, lake, candidate.url + "/v1") as srv:
        answers = [httpx.post(srv.url + "/v1/chat/completions", json=chat(f"order {i}"))
                   for i in range(3)]
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json=chat("order streamed", stream=True)) as streamed:
            assert streamed.status_code == 200
            assert b"[DONE]" in b"".join(streamed.iter_bytes())
        # A call for another model is not shadowed.
        other = httpx.post(srv.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert other.status_code == 200
        assert [a.json()["choices"][0]["message"]["content"] for a in answers] == \
            [f"echo: order {i}" for i in range(3)]
        wait_until(lambda: len(_rows(lake, "shadow_pairs")) == 4 and
                   len(_rows(lake, "samples")) == 5, what="4 pairs and 5 captures committed")
        assert _metric(srv.url, "factory_gateway_shadow_offered_total") == 4
        assert _metric(srv.url, "factory_gateway_shadow_answered_total") == 4
    pairs = sorted(_rows(lake, "shadow_pairs"), key=lambda r: str(r["request"]))
    captured = {r["raw_trace_id"] for r in _rows(lake, "raw_traces")}
    # Five captures, all the clients' calls: none is the candidate's answer.
    assert len(captured) == 5
    for pair in pairs:
        assert pair["raw_trace_id"] in captured  # lineage to the frontier's capture
        assert (pair["experiment"], pair["version"], pair["route"], pair["candidate_model"]) \
            == ("support", "v1", ROUTE, "cand-v1")
        text = json.loads(str(pair["request"]))["messages"][0]["content"]
        frontier = json.loads(str(pair["frontier_message"]))
        cand = json.loads(str(pair["candidate_message"]))
        assert frontier["content"][0]["text"] == f"echo: {text}"
        assert cand["content"][0]["text"] == f"echo: {text}"
        assert pair["candidate_status"] == 200 and pair["candidate_error"] is None
        assert float(pair["candidate_latency_ms"]) > 0  # type: ignore[arg-type]
        assert float(pair["frontier_latency_ms"]) > 0  # type: ignore[arg-type]
    assert {json.loads(str(p["request"])).get("stream") for p in pairs} == {None, True}
    samples = _rows(lake, "samples")
    assert all("cand-v1" not in str(s["messages"]) for s in samples)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["dead", "hanging"])
def test_a_dead_or_hanging_candidate_changes_nothing_for_the_client(
        factory_home: Path, upstream: ServerThread, candidate: ServerThread, kind: str) -> None:
    lake = Lake()
    # The hanging candidate (the stand-in's ``slow`` model) answers after 6 s; the shadow
    # timeout is 0.5 s.
    base = f"http://127.0.0.1:{_closed_port()}/v1" if kind == "dead" else candidate.url + "/v1"
    app = Gateway(make_config(upstream, shadow_timeout_s=0.5))
    with _shadowing(app, lake, base, deployment="slow") as srv:
        for i in range(3):
            started = time.perf_counter()
            answer = httpx.post(srv.url + "/v1/chat/completions", json=chat(f"q{i}"))
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["message"]["content"] == f"echo: q{i}"
            assert time.perf_counter() - started < 5.0  # the candidate would take 6 s
        wait_until(lambda: len(_rows(lake, "shadow_pairs")) == 3, what="3 failed pairs")
        assert _metric(srv.url, "factory_gateway_shadow_failed_total") == 3
    for pair in _rows(lake, "shadow_pairs"):
        assert pair["candidate_message"] is None and pair["candidate_status"] == 0
        expected = "could not connect" if kind == "dead" else "did not answer within 0.5s"
        assert expected in str(pair["candidate_error"]), pair["candidate_error"]
    assert len(_rows(lake, "samples")) == 3


class Held:
    """A candidate that answers (as the stand-in) only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inner = StandIn()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await self.inner(scope, receive, send)


def test_a_full_shadow_queue_drops_shadow_calls_never_client_calls(
        factory_home: Path, upstream: ServerThread) -> None:
    lake = Lake()
    # One worker, a queue of one: the first call occupies the worker (the candidate holds its
    # answer), the second waits in the queue, the other three find it full.
    held = Held()
    app = Gateway(make_config(upstream, shadow_queue_size=1, shadow_concurrency=1))
    with ServerThread(held) as cand, _shadowing(app, lake, cand.url + "/v1") as srv:
        try:
            for i in range(5):
                answer = httpx.post(srv.url + "/v1/chat/completions", json=chat(f"q{i}"))
                assert answer.status_code == 200
                assert answer.json()["choices"][0]["message"]["content"] == f"echo: q{i}"
            assert _metric(srv.url, "factory_gateway_shadow_offered_total") == 5
            assert _metric(srv.url, "factory_gateway_shadow_dropped_total") == 3
            wait_until(lambda: len(_rows(lake, "samples")) == 5,
                       what="every client call captured")
        finally:
            held.release.set()
        wait_until(lambda: len(_rows(lake, "shadow_pairs")) == 2, what="the two queued pairs")
    texts = sorted(json.loads(str(p["candidate_message"]))["content"][0]["text"]
                   for p in _rows(lake, "shadow_pairs"))
    assert texts == ["echo: q0", "echo: q1"]


def test_rules_are_kept_in_the_lake(factory_home: Path) -> None:
    lake = Lake()
    rule = ShadowRule(route=ROUTE, experiment="support", version="v2",
                      base_url="http://127.0.0.1:9/v1", deployment="support-v2", share=0.2)
    register_shadow(rule, lake=lake)
    assert load_shadows(lake) == {ROUTE: rule}
    from factory.gateway.shadow import end_shadow

    end_shadow(ROUTE, lake=lake)
    assert load_shadows(lake) == {}
    with pytest.raises(ValueError, match="share must be in"):
        ShadowRule(route=ROUTE, experiment="e", version="v1", base_url="http://x/v1",
                   deployment="d", share=0.0)


def test_a_replayed_batch_stores_each_pair_once(factory_home: Path, upstream: ServerThread,
                                                candidate: ServerThread) -> None:
    """A flusher that stops after committing a batch but before deleting its segments (a
    crash) leaves them for the next one, which must not store their pairs again."""
    from factory.gateway.flusher import Flusher
    from factory.gateway.shadow import commit_pairs
    from factory.gateway.spool import read_segment, sealed_segments
    from factory.settings import get_settings

    lake = Lake()
    app = Gateway(make_config(upstream, flush=False))  # spools only: nothing is committed
    with _shadowing(app, lake, candidate.url + "/v1") as srv:
        for i in range(3):
            assert httpx.post(srv.url + "/v1/chat/completions",
                              json=chat(f"q{i}")).status_code == 200
        wait_until(lambda: app.shadower.num_sent == 3, what="3 candidate answers")
    spool = get_settings().spool / "shadow"
    frames = [e for seg in sealed_segments(spool) for e in read_segment(seg)[0]
              if e.header["k"] == "shadow"]
    assert len(frames) == 3
    commit_pairs(lake, frames[:2], check_existing=False)  # the crashed flusher's commit
    flusher = Flusher(spool, lake_factory=Lake)
    flusher.start()
    try:
        wait_until(lambda: not sealed_segments(spool), what="the spool drained")
    finally:
        flusher.stop()
    ids = [r["pair_id"] for r in _rows(lake, "shadow_pairs")]
    assert sorted(ids) == sorted(f.header["id"] for f in frames)  # each once
