"""Several writers, each its own process tree with its own ``FACTORY_HOME``, writing at once to
one shared catalog in PostgreSQL and one warehouse: 4 gateways x 2,000 captures, one of them
killed with SIGKILL in the middle of a flush (its ``raw_traces`` commit made, its ``samples``
commit held on a row lock in the catalog) and restarted; beside them a file ingest of 2,000
records from a fifth home and a trainer's 100 signed events through one gateway. Every answered
request and every file record must be in ``raw_traces`` and ``samples`` exactly once, every
event in ``training_events`` once."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import psutil
import psycopg2
import pytest

from factory.gateway.loadgen import Result, run_load
from factory.gateway.server import bind
from factory.lake import Lake
from factory.trainer.webhooks import sign
from tests.waiting import wait_until

WRITERS = 4
PER_WRITER = 2_000
FILE_RECORDS = 2_000
EVENTS = 100
PATH = "/v1/chat/completions"
SECRET = b"shared-writers"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture()
def standin_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "factory.gateway.standin", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    match = re.search(r"http://\S+", proc.stdout.readline())
    assert match, "stand-in did not start"
    yield match.group(0) + "/v1"
    proc.terminate()
    proc.wait(10)


class Node:
    """A gateway process with a home of its own and the shared settings of the environment."""

    def __init__(self, home: Path, upstream: str) -> None:
        self.home = home
        self.upstream = upstream
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        sock = bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        with (self.home.parent / f"{self.home.name}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "factory.app.cli", "serve", "--port", str(port),
                 "--openai-base-url", self.upstream],
                env={**os.environ, "FACTORY_HOME": str(self.home),
                     "FACTORY_WEBHOOK_KEY_ID": "trainer", "FACTORY_WEBHOOK_SECRET": SECRET.decode()},
                stdout=subprocess.DEVNULL, stderr=log)
        wait_until(self._healthy, 60, f"the gateway of {self.home.name} to start")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def spool_depth(self) -> int:
        return int(httpx.get(self.url + "/healthz", timeout=5).json()["spool_depth"])

    def ports(self) -> set[int]:
        """Local ports of this process's TCP connections (its catalog connections among them)."""
        assert self.proc is not None
        return {c.laddr.port for c in psutil.Process(self.proc.pid).net_connections("tcp")}

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def _requests(writer: int, start: int, stop: int) -> list[tuple[str, bytes]]:
    return [(PATH, orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"w{writer}-{i}"}]})) for i in range(start, stop)]


def _answered(writer: int, start: int, results: list[Result]) -> set[str]:
    return {f"w{writer}-{start + r.index}" for r in results if r.status == 200}


def _raw_counts(lake: Lake) -> collections.Counter[str]:
    return collections.Counter(
        orjson.loads(text)["request"]["messages"][0]["content"]
        for text in lake.read("raw_traces", columns=["payload"]).column("payload").to_pylist())


def _sample_counts(lake: Lake) -> collections.Counter[str]:
    return collections.Counter(
        orjson.loads(text)[0]["content"][0]["text"]
        for text in lake.read("samples", columns=["messages"]).column("messages").to_pylist())


def _write_records(path: Path) -> None:
    """A log of ``FILE_RECORDS`` OpenAI calls, as ``factory ingest`` reads them."""
    with path.open("w") as out:
        for i in range(FILE_RECORDS):
            out.write(json.dumps({
                "request": {"model": "m", "messages": [{"role": "user", "content": f"f-{i}"}]},
                "response": {"id": f"c{i}", "object": "chat.completion", "created": 1,
                             "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant",
                                                                    "content": "ok"}}]}}) + "\n")


def _ingest(home: Path, path: Path) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-m", "factory.app.cli", "ingest", str(path)],
                         env={**os.environ, "FACTORY_HOME": str(home)}, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _send_events(url: str) -> list[int]:
    """A trainer's progress events, one signed POST each, as the trainer sends them."""
    statuses = []
    with httpx.Client(timeout=30) as client:
        for i in range(EVENTS):
            body = json.dumps({"event_id": f"e-{i}", "run_id": "shared-run", "type": "progress",
                               "step": i, "seq": i, "segment": "s", "time": time.time(),
                               "loss": 1.0 / (i + 1)}).encode()
            statuses.append(client.post(url + "/v1/trainer/events", content=body,
                                        headers=sign(body, "trainer", SECRET,
                                                     time.time())).status_code)
    return statuses


def _blocked_on_lock(database_url: str, node: Node) -> bool:
    """Whether one of ``node``'s catalog connections waits on a lock."""
    con = psycopg2.connect(database_url)
    try:
        with con.cursor() as cur:
            cur.execute("SELECT client_port FROM pg_stat_activity "
                        "WHERE wait_event_type = 'Lock' AND client_port IS NOT NULL")
            waiting = {row[0] for row in cur.fetchall()}
    finally:
        con.close()
    return bool(waiting & node.ports())


def test_4_gateways_x_2000_captures_with_one_killed_mid_commit_beside_ingest_and_events(
        shared_factory: Path, database_url: str, tmp_path: Path, standin_url: str) -> None:
    lake = Lake()
    for name in ("raw_traces", "samples", "rejected_traces"):
        lake.table(name)
    nodes = [Node(tmp_path / f"node-{w}", standin_url) for w in range(WRITERS)]
    for node in nodes:
        node.start()
    records = tmp_path / "calls.jsonl"
    _write_records(records)
    half = PER_WRITER // 2
    answered: set[str] = set()
    at_kill: dict[str, int] = {}
    side: dict[str, object] = {}
    started = time.monotonic()

    async def drive() -> None:
        others = [asyncio.create_task(run_load(nodes[w].url, _requests(w, 0, PER_WRITER),
                                               concurrency=8)) for w in range(1, WRITERS)]
        ingest = asyncio.create_task(asyncio.to_thread(_ingest, tmp_path / "node-ingest",
                                                       records))
        events = asyncio.create_task(asyncio.to_thread(_send_events, nodes[1].url))
        first = await run_load(nodes[0].url, _requests(0, 0, half), concurrency=8)
        answered.update(_answered(0, 0, first))
        # Hold the samples row of the catalog: every flusher's samples commit now waits on it,
        # after its raw_traces commit went through.
        lock = psycopg2.connect(database_url)
        try:
            with lock.cursor() as cur:
                cur.execute("SELECT metadata_location FROM iceberg_tables "
                            "WHERE table_namespace = %s AND table_name = %s FOR UPDATE",
                            ("factory", "samples"))
                assert cur.fetchone() is not None
            more = await run_load(nodes[0].url, _requests(0, half, half + 50), concurrency=4)
            answered.update(_answered(0, half, more))
            await asyncio.to_thread(wait_until, lambda: _blocked_on_lock(database_url, nodes[0]),
                                    60, "node-0's samples commit to wait on the lock")
            nodes[0].kill()
            raw, samples = _raw_counts(Lake()), _sample_counts(Lake())
            at_kill["raw"] = sum(1 for k in raw if k.startswith("w0-"))
            at_kill["samples"] = sum(1 for k in samples if k.startswith("w0-"))
        finally:
            lock.rollback()
            lock.close()
        await asyncio.to_thread(nodes[0].start)
        rest = await run_load(nodes[0].url, _requests(0, half + 50, PER_WRITER), concurrency=8)
        answered.update(_answered(0, half + 50, rest))
        for w, task in zip(range(1, WRITERS), others, strict=True):
            answered.update(_answered(w, 0, await task))
        side["ingest"], side["events"] = await ingest, await events

    try:
        asyncio.run(drive())
        for node in nodes:
            wait_until(lambda node=node: node.spool_depth() == 0, 120,
                       f"{node.home.name}'s spool to drain")
    finally:
        for node in nodes:
            node.stop()
    elapsed = time.monotonic() - started

    # The kill came between the two commits of one flush: raw rows without their samples.
    assert at_kill["raw"] > at_kill["samples"], at_kill
    assert len(answered) == WRITERS * PER_WRITER
    assert side["ingest"] == {"read": FILE_RECORDS, "ingested": FILE_RECORDS, "rejected": 0,
                              "duplicates": 0}
    assert side["events"] == [200] * EVENTS
    expected = answered | {f"f-{i}" for i in range(FILE_RECORDS)}
    raw, samples = _raw_counts(Lake()), _sample_counts(Lake())
    assert set(raw) == expected and set(raw.values()) == {1}
    assert set(samples) == expected and set(samples.values()) == {1}
    assert lake.read("rejected_traces").num_rows == 0
    events = collections.Counter(lake.read("training_events").column("event_id").to_pylist())
    assert events == {f"e-{i}": 1 for i in range(EVENTS)}
    for node in nodes:
        assert not list((node.home / "spool").glob("*.seg"))
    print(f"{WRITERS} x {PER_WRITER} captures, {FILE_RECORDS} file records and {EVENTS} "
          f"events in {elapsed:.1f} s; at the kill node-0 had "
          f"{at_kill['raw']} raw rows and {at_kill['samples']} samples")
