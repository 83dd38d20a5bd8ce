"""Fixtures for the gateway tests: a stand-in upstream and a gateway, both on 127.0.0.1 in threads
(the load tests start them as subprocesses instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factory.gateway import Gateway, GatewayConfig, ServerThread
from factory.gateway.keys import KeyStore
from factory.gateway.standin import StandIn


@pytest.fixture(scope="module")
def upstream() -> Iterator[ServerThread]:
    with ServerThread(StandIn(slow_s=2.0)) as srv:
        yield srv


def make_config(upstream: ServerThread, **overrides: Any) -> GatewayConfig:
    """A gateway config for tests. The upstream timeout is generous (the stand-in and the gateway
    share one process, and a lake commit can hold it for a second on a busy machine); the test of
    the 504 sets a short one."""
    values: dict[str, Any] = {
        "port": 0, "openai_base_url": upstream.url + "/v1", "anthropic_base_url": upstream.url,
        "gemini_base_url": upstream.url, "upstream_timeout_s": 15.0, "flush_interval_s": 0.05,
        "segment_max_age_s": 0.05, "routes_poll_s": 0.1, "flush_retry_max_s": 0.2,
        "shadow_flush_s": 0.05}
    values.update(overrides)
    return GatewayConfig(**values)


class Collected(list):
    """An ingest stand-in for tests that check captures, not the lake: keeps the records, and
    each call's ``new_ids`` in ``new_ids``."""

    def __init__(self) -> None:
        super().__init__()
        self.new_ids: list[bool] = []

    def __call__(self, lake: Any, records: list[Any], *, new_ids: bool = False) -> None:
        self.new_ids.append(new_ids)
        self.extend(records)


@pytest.fixture()
def collected() -> Collected:
    return Collected()


@pytest.fixture()
def gateway(factory_home: Path, upstream: ServerThread,
            collected: Collected) -> Iterator[ServerThread]:
    """A gateway whose flusher hands captures to ``collected`` (no lake)."""
    app = Gateway(make_config(upstream), lake_factory=lambda: None, ingest=collected)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture()
def keyed_gateway(factory_home: Path, upstream: ServerThread,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ServerThread, str]]:
    """A gateway with one factory key, named by ``$FACTORY_GATEWAY_URL`` and
    ``$FACTORY_GATEWAY_KEY`` as the factory's settings carry them; (gateway, key)."""
    _, key = KeyStore().create("internal clients")
    with ServerThread(Gateway(make_config(upstream), lake_factory=lambda: None,
                              ingest=Collected())) as gateway:
        monkeypatch.setenv("FACTORY_GATEWAY_URL", gateway.url + "/")
        monkeypatch.setenv("FACTORY_GATEWAY_KEY", key)
        yield gateway, key
