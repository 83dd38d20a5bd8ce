"""The flusher never fails or stalls silently: a failed commit is logged with its traceback,
counted in /metrics and retried; a locked catalog shows as failures while it lasts; a flusher
thread that dies says so in the log, /metrics and /healthz."""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.gateway import Gateway, ServerThread
from factory.lake import Lake
from tests.gateway.conftest import make_config
from tests.waiting import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, flags=re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _samples(lake: Lake) -> int:
    return lake.read("samples").num_rows if lake.exists("samples") else 0


class RefusingLake(Lake):
    """The real lake, whose appends first raise each of ``refusals`` (shared by the lakes the
    flusher opens: it opens a fresh one after a failure)."""

    def __init__(self, refusals: list[Exception]) -> None:
        super().__init__()
        self.refusals = refusals

    def append(self, name: str, data: Any, **kwargs: Any) -> int | None:
        if self.refusals:
            raise self.refusals.pop(0)
        return super().append(name, data, **kwargs)


def test_a_failed_commit_is_logged_counted_and_retried(
        factory_home: Path, upstream: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    refusals = [OSError("injected: the warehouse refused the write")]
    app = Gateway(make_config(upstream), lake_factory=functools.partial(RefusingLake, refusals))
    with caplog.at_level(logging.ERROR, logger="factory.gateway"), ServerThread(app) as srv:
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
        lake = Lake()
        wait_until(lambda: _samples(lake) == 1, what="the capture committed on the retry")
        assert _metric(srv.url, "factory_gateway_flush_failures_total") == 1
        assert _metric(srv.url, "factory_gateway_flush_last_failure_timestamp_seconds") > 0
        assert _metric(srv.url, "factory_gateway_flush_last_success_timestamp_seconds") >= \
            _metric(srv.url, "factory_gateway_flush_last_failure_timestamp_seconds")
        assert _metric(srv.url, "factory_gateway_flusher_up") == 1
        assert httpx.get(srv.url + "/healthz").json()["lake"] == "ok"
    [record] = [r for r in caplog.records if "committing captures" in r.getMessage()]
    assert record.exc_info is not None and "injected" in str(record.exc_info[1])
    assert "Traceback" in caplog.text and "OSError: injected" in caplog.text


@pytest.mark.slow
def test_a_locked_catalog_shows_as_failures_while_it_lasts(
        factory_home: Path, upstream: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    lake = Lake()
    for name in ("raw_traces", "samples", "rejected_traces"):
        lake.table(name)
    app = Gateway(make_config(upstream))
    lock = sqlite3.connect(lake.settings.catalog_db, isolation_level=None)
    try:
        with caplog.at_level(logging.ERROR, logger="factory.gateway"), ServerThread(app) as srv:
            lock.execute("BEGIN EXCLUSIVE")  # no other connection can read or write the catalog
            assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
            # Each attempt gives up after the gateway's lake patience (5 s) plus one SQLite
            # busy wait (5 s); the deadline only bounds a failure.
            wait_until(lambda: _metric(srv.url, "factory_gateway_flush_failures_total") >= 1,
                       60, "a failed flush while the catalog is locked")
            health = httpx.get(srv.url + "/healthz").json()
            assert health["lake"] == "error" and "locked" in health["lake_error"]
            assert health["spool_depth"] == 1
            lock.execute("ROLLBACK")
            wait_until(lambda: _samples(lake) == 1, 60, "the capture once the catalog is free")
            assert httpx.get(srv.url + "/healthz").json()["lake"] == "ok"
    finally:
        lock.close()
    assert "database is locked" in caplog.text and "Traceback" in caplog.text


class Crash(BaseException):
    """Not an ``Exception``: what a bug in a native extension (a Rust panic) raises."""


def test_a_flusher_that_dies_says_so(factory_home: Path, upstream: ServerThread,
                                     caplog: pytest.LogCaptureFixture) -> None:
    def ingest(lake: Any, records: list[Any], *, new_ids: bool) -> None:
        raise Crash("injected")

    app = Gateway(make_config(upstream), lake_factory=lambda: None, ingest=ingest)
    with caplog.at_level(logging.ERROR, logger="factory.gateway"), ServerThread(app) as srv:
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
        wait_until(lambda: _metric(srv.url, "factory_gateway_flusher_up") == 0,
                   what="the flusher to stop")
        assert _metric(srv.url, "factory_gateway_flush_failures_total") == 1
        health = httpx.get(srv.url + "/healthz").json()
        assert health["flusher"] == "stopped" and health["lake_error"] == "tests.gateway." \
            "test_flusher.Crash: injected"
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert "flusher: stopped" in record.getMessage() and record.exc_info is not None
