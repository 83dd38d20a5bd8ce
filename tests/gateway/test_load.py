"""Load tests: 10,000 requests each through a gateway subprocess, once with the lake made
unavailable for a while (the catalog DB held under an exclusive lock) and once with the gateway
killed with SIGKILL and restarted twice; every request that got a 200 is captured exactly once."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from factory.gateway.loadgen import Result, run_load
from factory.gateway.server import bind
from factory.lake import Lake
from tests.waiting import wait_until

N = 10_000
PATH = "/v1/chat/completions"


@pytest.fixture()
def standin_url(factory_home: Path) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "factory.gateway.standin", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    match = re.search(r"http://\S+", proc.stdout.readline())
    assert match, "stand-in did not start"
    yield match.group(0)
    proc.terminate()
    proc.wait(10)


class GatewayProcess:
    def __init__(self, home: Path, upstream: str) -> None:
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "factory.app.cli", "serve", "--port", str(self.port),
                     "--openai-base-url", upstream]
        self.env = {**os.environ, "FACTORY_HOME": str(home)}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_until(self._healthy, 30, "the gateway to start")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        return httpx.get(self.url + "/healthz", timeout=5).json()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def _requests(start: int, stop: int) -> list[tuple[str, bytes]]:
    return [(PATH, orjson.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"load-{i}"}]})) for i in range(start, stop)]


def _captured_counts(lake: Lake) -> collections.Counter[int]:
    counts: collections.Counter[int] = collections.Counter()
    for text in lake.read("raw_traces", columns=["payload"]).column("payload").to_pylist():
        content = orjson.loads(text)["request"]["messages"][0]["content"]
        counts[int(content.split("-")[1])] += 1
    return counts


def _sample_counts(lake: Lake) -> collections.Counter[int]:
    counts: collections.Counter[int] = collections.Counter()
    for text in lake.read("samples", columns=["messages"]).column("messages").to_pylist():
        first = orjson.loads(text)[0]["content"][0]["text"]
        counts[int(first.split("-")[1])] += 1
    return counts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lake_outage_during_10k_requests(factory_home: Path, standin_url: str) -> None:
    lake = Lake()
    for name in ("raw_traces", "samples", "rejected_traces"):
        lake.table(name)
    gateway = GatewayProcess(factory_home, standin_url)
    gateway.start()
    try:
        lock = sqlite3.connect(lake.settings.catalog_db, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # the catalog is unavailable to every other writer
        first = asyncio.run(run_load(gateway.url, _requests(0, N // 2), concurrency=32))
        ok_first = sum(r.status == 200 for r in first)
        # The flusher has tried, and failed, to commit them: nothing committed, all spooled.
        wait_until(lambda: gateway.health()["lake"] == "error", 90, "a failed flush")
        assert gateway.health()["spool_depth"] == ok_first
        lock.execute("ROLLBACK")
        lock.close()
        second = asyncio.run(run_load(gateway.url, _requests(N // 2, N), concurrency=32))
        wait_until(lambda: gateway.health()["spool_depth"] == 0, 90, "the spool to drain")
        metrics = httpx.get(gateway.url + "/metrics").text
        assert "factory_gateway_captures_dropped_total 0" in metrics
    finally:
        gateway.stop()
    ok = {r.index for r in first if r.status == 200} | \
        {N // 2 + r.index for r in second if r.status == 200}
    assert len(ok) == N
    captured = _captured_counts(Lake())
    assert set(captured) == ok and set(captured.values()) == {1}
    samples = _sample_counts(Lake())
    assert set(samples) == ok and set(samples.values()) == {1}
    assert list((factory_home / "spool").glob("*.seg")) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_and_restart_during_10k_requests(factory_home: Path, standin_url: str) -> None:
    gateway = GatewayProcess(factory_home, standin_url)
    gateway.start()
    done = [0]
    kills: list[int] = []

    def count(_: Result) -> None:
        done[0] += 1

    def killer() -> None:
        for at in (3000, 6500):
            wait_until(lambda at=at: done[0] >= at, 120, f"{at} answers")
            gateway.kill()
            kills.append(done[0])
            gateway.start()

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        results = asyncio.run(run_load(gateway.url, _requests(0, N), concurrency=32,
                                       on_result=count, retry_connect_s=0.05))
        thread.join(60)
        assert len(kills) == 2
        wait_until(lambda: gateway.health()["spool_depth"] == 0, 90, "the spool to drain")
    finally:
        thread.join(60)
        gateway.stop()
    ok = {r.index for r in results if r.status == 200}
    failed = {r.index for r in results if r.status != 200}
    # Requests sent while the gateway was down fail (clients would retry); enough got through.
    assert len(ok) > N // 2 and failed
    captured = _captured_counts(Lake())
    assert ok <= set(captured), f"{len(ok - set(captured))} answered requests not captured"
    assert set(captured.values()) == {1}  # exactly once, answered or cut off
    assert not list((factory_home / "spool").glob("*.seg"))
