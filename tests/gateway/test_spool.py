"""The spool and flusher: framing, torn tails, crash recovery, retry while the lake is down,
exactly-once ids; and the routing table in the lake."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.gateway import Gateway, Route, ServerThread, register_route, unregister_route
from factory.gateway.captures import capture_raw_trace_id, parse_json_array_stream, parse_sse
from factory.gateway.flusher import Flusher
from factory.gateway.routes import RoutingTable, load_routes
from factory.gateway.spool import (
    SpoolWriter,
    encode,
    oldest_pending_age_s,
    read_segment,
    sealed_segments,
)
from factory.lake import Lake
from tests.gateway.conftest import Collected, make_config
from tests.waiting import wait_until


def _capture(i: int) -> bytes:
    req = b'{"model":"m","messages":[{"role":"user","content":"c%d"}]}' % i
    header = {"k": "c", "id": f"id-{i}", "provider": "openai", "endpoint": "/v1/chat/completions",
              "status": 200, "partial": False, "stream": None, "at": 1.0, "rl": len(req),
              "project": None, "tags": {}}
    return encode(header, req, b'{"choices":[]}')


def test_segment_roundtrip_and_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "a.seg"
    path.write_bytes(_capture(1) + _capture(2))
    entries, intact = read_segment(path)
    assert intact and [e.header["id"] for e in entries] == ["id-1", "id-2"]
    path.write_bytes(_capture(1) + _capture(2)[:-3])
    entries, intact = read_segment(path)
    assert not intact and len(entries) == 1


def test_writer_recovers_segments_of_dead_processes(tmp_path: Path) -> None:
    dead = tmp_path / f"{1:020d}-999999999-000001.open"  # no such pid
    dead.write_bytes(_capture(1))
    writer = SpoolWriter(tmp_path, segment_max_age_s=0.05)
    writer.start()
    writer.append(_capture(2))
    writer.stop()
    segs = sealed_segments(tmp_path)
    ids = sorted(e.header["id"] for s in segs for e in read_segment(s)[0])
    assert ids == ["id-1", "id-2"] and not list(tmp_path.glob("*.open"))


def test_writer_leaves_the_segment_of_a_live_writer_alone(tmp_path: Path) -> None:
    """A live writer's active segment is locked: another writer starting on the same folder
    (here in the same process, where a pid check cannot tell them apart) does not seal it."""
    first = SpoolWriter(tmp_path, segment_max_age_s=60)
    first.start()
    try:
        first.append(_capture(1))
        second = SpoolWriter(tmp_path, segment_max_age_s=60)
        assert second.recover() == []
        assert len(list(tmp_path.glob("*.open"))) == 1 and not sealed_segments(tmp_path)
    finally:
        first.stop()
    assert second.recover() == [] and len(sealed_segments(tmp_path)) == 1


def test_seal_thread_outlives_an_unexpected_error(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in one seal pass is logged; the thread keeps sealing later captures."""
    writer = SpoolWriter(tmp_path, segment_max_age_s=0.05)
    real = writer._sync_and_maybe_seal
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("a bug")
        real()

    monkeypatch.setattr(writer, "_sync_and_maybe_seal", flaky)
    writer.start()
    try:
        writer.append(_capture(1))
        wait_until(lambda: calls["n"] >= 2 and bool(sealed_segments(tmp_path)), timeout_s=30)
        assert writer._thread is not None and writer._thread.is_alive()
    finally:
        writer.stop()
    ids = [e.header["id"] for s in sealed_segments(tmp_path) for e in read_segment(s)[0]]
    assert ids == ["id-1"]


def test_flusher_keeps_segments_while_lake_fails_then_drains(tmp_path: Path) -> None:
    (tmp_path / f"{1:020d}-1-000001.seg").write_bytes(_capture(1) + _capture(2))
    calls: list[int] = []
    kept = Collected()

    def flaky(lake: Any, records: list[Any], *, new_ids: bool) -> None:
        calls.append(len(records))
        if len(calls) < 3:
            raise OSError("catalog unreachable")
        kept(lake, records, new_ids=new_ids)

    flusher = Flusher(tmp_path, lake_factory=lambda: None, ingest=flaky)
    for _ in range(2):
        with pytest.raises(OSError):
            flusher.flush_once()
        assert len(sealed_segments(tmp_path)) == 1  # nothing deleted on failure
    assert flusher.flush_once() == 2
    assert sealed_segments(tmp_path) == []
    ids = [r.raw_trace_id for r in kept]
    assert ids == [capture_raw_trace_id("id-1"), capture_raw_trace_id("id-2")]
    assert capture_raw_trace_id("id-1") == capture_raw_trace_id("id-1")  # replay-stable
    assert kept.new_ids == [False]  # a segment older than the flush lock: a possible replay


def test_only_a_first_attempt_at_this_process_s_own_segments_skips_the_lake_s_ids(
        tmp_path: Path) -> None:
    """``new_ids`` (ingest does not read raw_traces' ids) holds for segments spooled after
    this flusher took the lock, on their first attempt; a segment from before the lock, or a
    batch whose attempt failed (it may be committed in part), is deduplicated."""
    calls: list[tuple[int, bool]] = []
    fail = {"next": False}

    def ingest(lake: Any, records: list[Any], *, new_ids: bool) -> None:
        calls.append((len(records), new_ids))
        if fail["next"]:
            fail["next"] = False
            raise OSError("commit failed half way")

    flusher = Flusher(tmp_path, lake_factory=lambda: None, ingest=ingest)
    assert flusher._acquire()
    try:
        def segment(i: int, ns: int) -> None:
            (tmp_path / f"{ns:020d}-1-{i:06d}.seg").write_bytes(_capture(i))

        segment(1, time.time_ns())
        assert flusher.flush_once() == 1
        segment(2, time.time_ns())
        fail["next"] = True
        with pytest.raises(OSError):
            flusher.flush_once()
        assert flusher.flush_once() == 1  # the retry of a failed attempt
        segment(3, 1)  # spooled before this flusher held the lock
        assert flusher.flush_once() == 1
        segment(4, time.time_ns())
        assert flusher.flush_once() == 1
        assert calls == [(1, True), (1, True), (1, False), (1, False), (1, True)]
    finally:
        flusher.stop(final_flush_s=0)


def test_the_flusher_expires_old_capture_snapshots_and_keeps_every_capture(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each flush is a commit; every ``expire_every_s`` the flusher expires the capture tables'
    old snapshots, so their metadata stops growing with every flush, and no row goes."""
    from factory.gateway import flusher as flusher_module
    from factory.lake import Lake

    monkeypatch.setattr(flusher_module, "KEEP_LAST_SNAPSHOTS", 2)
    flusher = Flusher(tmp_path, lake_factory=Lake, expire_every_s=1e-9, retention_s=0)
    assert flusher._acquire()
    try:
        for i in range(6):
            (tmp_path / f"{time.time_ns():020d}-1-{i:06d}.seg").write_bytes(_capture(i))
            assert flusher.flush_once() == 1
    finally:
        flusher.stop(final_flush_s=0)
    lake = Lake()
    assert len(lake.table("raw_traces").snapshots()) == 2
    assert len(lake.table("rejected_traces").snapshots()) == 2  # (no answer: rejected)
    assert flusher.num_expired > 0
    assert sorted(lake.read("raw_traces").column("raw_trace_id").to_pylist()) == sorted(
        capture_raw_trace_id(f"id-{i}") for i in range(6))


def test_stream_parsers_handle_cut_streams() -> None:
    sse = b'event: x\ndata: {"a":1}\n\ndata: {"a":2}\n\ndata: [DONE]\n\n'
    assert parse_sse(sse) == [{"a": 1}, {"a": 2}]
    assert parse_sse(b'data: {"a":1}\n\ndata: {"a"') == [{"a": 1}]
    assert parse_json_array_stream(b'[{"a":1}\r\n,{"a":2}]') == [{"a": 1}, {"a": 2}]
    assert parse_json_array_stream(b'[{"a":1}\r\n,{"a":') == [{"a": 1}]


def test_gateway_drains_after_lake_outage(factory_home: Path, upstream: ServerThread) -> None:
    down = {"on": True}
    kept = Collected()

    def ingest(lake: Any, records: list[Any], *, new_ids: bool) -> None:
        if down["on"]:
            raise RuntimeError("database is locked")
        kept(lake, records)

    app = Gateway(make_config(upstream), lake_factory=lambda: None, ingest=ingest)
    with ServerThread(app) as srv:
        for i in range(20):
            r = httpx.post(srv.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": str(i)}]})
            assert r.status_code == 200
        wait_until(lambda: app.flusher is not None and app.flusher.num_failures >= 2, what="failed flushes")
        assert app.spool_depth() == 20 and kept == []
        assert httpx.get(srv.url + "/healthz").json()["lake"] == "error"
        down["on"] = False
        wait_until(lambda: len(kept) == 20, what="the drain")
        wait_until(lambda: app.spool_depth() == 0, what="an empty spool")
    assert len({r.raw_trace_id for r in kept}) == 20


def test_routing_table_in_the_lake_sends_a_model_elsewhere(factory_home: Path,
                                                           upstream: ServerThread) -> None:
    lake = Lake()
    with pytest.raises(ValueError, match="provider"):
        Route(model="x", provider="cohere", base_url="http://a")
    register_route(Route(model="factory/exp1", provider="openai", base_url=upstream.url + "/v1",
                         deployment="served-exp1", version="v3"), lake=lake)
    assert load_routes(lake)["factory/exp1"].deployment == "served-exp1"
    app = Gateway(make_config(upstream, openai_base_url="http://127.0.0.1:9"))
    with ServerThread(app) as srv:
        wait_until(lambda: app.routes.get("factory/exp1"), what="the route")
        body = {"model": "factory/exp1", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "served-exp1"
        r = httpx.post(srv.url + "/v1/messages", json={**body, "max_tokens": 5})
        assert r.status_code == 400 and "openai API" in r.json()["error"]["message"]
        unregister_route("factory/exp1", lake=lake)
        wait_until(lambda: app.routes.get("factory/exp1") is None, what="the removal")
        r = httpx.post(srv.url + "/v1/chat/completions", json=body)
        assert r.status_code == 502  # back to the default upstream, which is down
        wait_until(lambda: lake.exists("raw_traces") and lake.read("raw_traces").num_rows == 2,
                   what="captures")
        # The 502 is committed to rejected_traces; the flusher counts it apart from the sample.
        wait_until(lambda: app.flusher is not None and app.flusher.num_rejected == 1,
                   what="the rejected capture counted")
        assert b"factory_gateway_captures_rejected_total 1.0" in app.metrics.render()
    tags = [dict(t) for t in lake.read("raw_traces").column("tags").to_pylist()]
    assert {"route_version": "v3"} in tags
    table = RoutingTable()
    assert table.refresh(lake) and not table.refresh(lake)  # unchanged snapshot: no re-read
    assert os.environ["FACTORY_HOME"] == str(factory_home)


def test_a_segment_removed_while_listed_is_not_pending(tmp_path: Path) -> None:
    # The flusher removes a committed segment at any time; one gone between the listing and
    # its stat (a dangling link stands for it: listed, then not there) must not fail /metrics.
    opened = time.time_ns() - 5_000_000_000
    (tmp_path / f"{opened}-1-000001.seg").write_bytes(b"x")
    (tmp_path / f"{opened - 10**12}-1-000000.seg").symlink_to(tmp_path / "committed-and-gone")
    assert 4.0 <= oldest_pending_age_s(tmp_path) < 60.0
