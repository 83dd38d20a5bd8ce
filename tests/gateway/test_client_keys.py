"""The factory's own clients of a keyed gateway send the factory key of its settings
(``$FACTORY_GATEWAY_KEY``): a synthesis teacher behind the gateway is answered, not refused with
a 401; no other endpoint is ever sent the key. (The comparison page's vibe check:
tests/app/test_compare.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from factory.curation import synthesis
from factory.experiments import SynthesizeSpec
from factory.gateway import Gateway, ServerThread
from factory.gateway.keys import KEY_HEADER, KeyStore, client_headers
from factory.settings import get_settings
from tests.gateway.conftest import Collected, make_config


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


def test_settings_carry_the_gateway_and_its_key(factory_home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FACTORY_GATEWAY_URL", raising=False)  # a developer's shell may set them
    monkeypatch.delenv("FACTORY_GATEWAY_KEY", raising=False)
    settings = get_settings()
    assert (settings.gateway_url, settings.gateway_key) == ("http://127.0.0.1:8787", None)
    assert client_headers(settings) == {}
    monkeypatch.setenv("FACTORY_GATEWAY_URL", "http://gw.internal:8787/")
    monkeypatch.setenv("FACTORY_GATEWAY_KEY", "fk-secret")
    settings = get_settings()
    assert settings.gateway_url == "http://gw.internal:8787"
    assert client_headers(settings) == {KEY_HEADER: "fk-secret"}
    assert "fk-secret" not in repr(settings)  # settings get logged


def test_a_teacher_behind_a_keyed_gateway_is_answered(
        keyed_gateway: tuple[ServerThread, str]) -> None:
    gateway, key = keyed_gateway
    messages = [{"role": "user", "content": "Write one request."}]
    refused = httpx.post(gateway.url + "/v1/chat/completions",
                         json={"model": "gpt-4o-mini", "messages": messages})
    assert refused.status_code == 401  # without the key

    teacher = synthesis.teacher_for(SynthesizeSpec(teacher="gpt-4o-mini"), "triage")
    try:
        assert teacher.base_url == gateway.url + "/v1"
        reply = teacher.call("request", messages, max_tokens=16)
    finally:
        teacher.close()
    assert reply["choices"][0]["message"]["content"] == "echo: Write one request."


def test_a_teacher_elsewhere_is_never_sent_the_factory_key(
        keyed_gateway: tuple[ServerThread, str], upstream: ServerThread) -> None:
    _, key = keyed_gateway
    spec = SynthesizeSpec(teacher="gpt-4o-mini", base_url=upstream.url + "/v1")
    teacher = synthesis.teacher_for(spec, "triage")
    try:
        assert KEY_HEADER.lower() not in {h.lower() for h in teacher.client.http.headers}
        assert key not in teacher.client.http.headers.values()
    finally:
        teacher.close()
