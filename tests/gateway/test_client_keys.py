"""The factory's own clients of a keyed gateway send the factory key of its settings
(``$FACTORY_GATEWAY_KEY``): a synthesis teacher, an LLM judge, ``factory chat`` and the demo's
traffic are answered through the gateway, not refused with a 401; no other endpoint is ever sent
the key (a teacher or judge elsewhere, ``factory chat --direct``). (The comparison page's vibe
check: tests/app/test_compare.py.)"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from factory.app.cli import main
from factory.app.demo import _send_traffic
from factory.curation import synthesis
from factory.experiments import SynthesizeSpec
from factory.gateway import ServerThread
from factory.gateway.asgi import Receive, Scope, Send
from factory.gateway.keys import KEY_HEADER, client_headers
from factory.gateway.standin import StandIn
from factory.lake import Lake
from factory.resources.judge import LLMJudgeResource
from factory.settings import get_settings
from factory.tasks import generate_records

MESSAGES = [{"role": "user", "content": "Write one request."}]


class HeadersSeen:
    """The stand-in upstream, keeping the headers of every request it is sent: what an endpoint
    other than the gateway was told."""

    def __init__(self) -> None:
        self.app = StandIn()
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)

    def sent_a_factory_key(self) -> bool:
        return any(KEY_HEADER.lower() in h for h in self.headers)


@pytest.fixture()
def elsewhere() -> Iterator[tuple[ServerThread, HeadersSeen]]:
    """An OpenAI-compatible endpoint that is not the gateway, and what it was sent."""
    seen = HeadersSeen()
    with ServerThread(seen) as server:
        yield server, seen


def test_settings_carry_the_gateway_and_its_key(factory_home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    settings = get_settings()  # factory_home unsets both: a developer's shell may set them
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
    refused = httpx.post(gateway.url + "/v1/chat/completions",
                         json={"model": "gpt-4o-mini", "messages": MESSAGES})
    assert refused.status_code == 401  # without the key

    teacher = synthesis.teacher_for(SynthesizeSpec(teacher="gpt-4o-mini"), "triage")
    try:
        assert teacher.base_url == gateway.url + "/v1"
        reply = teacher.call("request", MESSAGES, max_tokens=16)
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


def test_an_llm_judge_behind_a_keyed_gateway_is_answered(
        keyed_gateway: tuple[ServerThread, str]) -> None:
    gateway, _ = keyed_gateway
    judge = LLMJudgeResource(base_url=gateway.url + "/v1/", model="gpt-4o-mini",
                             max_retries=0).judge()
    assert judge.complete(MESSAGES) == "echo: Write one request."
    # The copy a Spark executor scores with (``factory.curation.spark``) opens its own client,
    # with the key.
    copy = pickle.loads(pickle.dumps(judge))
    assert copy.complete(MESSAGES) == "echo: Write one request."


def test_an_llm_judge_elsewhere_is_never_sent_the_factory_key(
        keyed_gateway: tuple[ServerThread, str],
        elsewhere: tuple[ServerThread, HeadersSeen]) -> None:
    server, seen = elsewhere
    judge = LLMJudgeResource(base_url=server.url + "/v1", model="judge-1",
                             max_retries=0).judge()
    assert judge.complete(MESSAGES) == "echo: Write one request."
    assert seen.headers and not seen.sent_a_factory_key()


def test_factory_chat_through_a_keyed_gateway(keyed_gateway: tuple[ServerThread, str],
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "gpt-4o-mini", "-m", "hello there"]) == 0  # $FACTORY_GATEWAY_URL
    assert capsys.readouterr().out.strip() == "echo: hello there"
    monkeypatch.delenv("FACTORY_GATEWAY_KEY")
    assert main(["chat", "gpt-4o-mini", "-m", "hello there"]) == 2
    err = capsys.readouterr().err
    assert "answered 401" in err and "set FACTORY_GATEWAY_KEY" in err


def test_factory_chat_direct_is_never_sent_the_factory_key(
        keyed_gateway: tuple[ServerThread, str], elsewhere: tuple[ServerThread, HeadersSeen],
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--direct`` talks to the live deployment's server, which is not the gateway."""
    server, seen = elsewhere
    now = datetime.now(UTC)
    Lake().append("deployments", [{
        "name": "triage", "version": "v1", "checkpoint": "/ckpt", "base_model": "base",
        "adapter": "triage-v1", "route_model": "factory/triage",
        "endpoint": server.url + "/v1", "backend": "transformers", "status": "live",
        "pid": os.getpid(), "port": server.port, "log_path": "", "started_at": now,
        "updated_at": now}])
    assert main(["chat", "factory/triage", "--direct", "-m", "hello there"]) == 0
    assert capsys.readouterr().out.strip() == "echo: hello there"
    assert seen.headers and not seen.sent_a_factory_key()


def test_the_demo_s_traffic_is_answered_by_a_keyed_gateway(
        keyed_gateway: tuple[ServerThread, str]) -> None:
    """The demo's gateway serves the home the demo runs in: a key created there (``factory keys
    create``) holds for the demo's own calls too."""
    gateway, _ = keyed_gateway
    records = generate_records(4, 0)  # one of them streamed
    _send_traffic(gateway.url, records, "demo")  # refused (AuthenticationError) without the key
