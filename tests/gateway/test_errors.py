"""Errors in each provider's format, pass-through of upstream statuses, 413/400/504, partial
captures on client disconnect, factory keys, and the ``/metrics`` text."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from factory.app.cli import main
from factory.gateway import Gateway, ServerThread
from factory.gateway.app import parse_tags
from factory.gateway.keys import KeyStore
from tests.gateway.conftest import Collected, make_config
from tests.waiting import wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_malformed_json_is_400_in_each_format_and_not_forwarded(
        gateway: ServerThread, upstream: ServerThread) -> None:
    before = upstream.app.num_requests
    r = httpx.post(gateway.url + "/v1/chat/completions", content=b'{"model": ')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(gateway.url + "/v1/messages", content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(gateway.url + "/v1beta/models/g:generateContent", content=b"nope")
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert upstream.app.num_requests == before
    assert httpx.get(gateway.url + "/v1/nothing").status_code == 404
    assert httpx.get(gateway.url + "/v1/messages").status_code == 405


def test_upstream_errors_pass_through_and_are_recorded(factory_home: Path, upstream: ServerThread,
                                                       collected: Collected) -> None:
    app = Gateway(make_config(upstream, upstream_timeout_s=0.5), lake_factory=lambda: None,
                  ingest=collected)
    with ServerThread(app) as gateway:
        oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            oai.chat.completions.create(model="error-429", messages=CHAT["messages"])
        ant = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.RateLimitError):
            ant.messages.create(model="error-429", max_tokens=5, messages=CHAT["messages"])
        with pytest.raises(openai.APIStatusError) as info:  # the stand-in waits 2 s, limit 0.5 s
            oai.chat.completions.create(model="slow", messages=CHAT["messages"])
        assert info.value.status_code == 504
        wait_until(lambda: len(collected) == 3, what="three captures")
    statuses = sorted(r.payload["status"] for r in collected)
    assert statuses == [429, 429, 504]
    assert {r.payload["provider"] for r in collected} == {"openai", "anthropic"}


def test_body_over_limit_is_413_before_read(factory_home: Path, upstream: ServerThread) -> None:
    app = Gateway(make_config(upstream, max_body_bytes=1000), lake_factory=lambda: None,
                  ingest=Collected())
    with ServerThread(app) as srv:
        big = orjson.dumps({**CHAT, "pad": "x" * 5000})
        r = httpx.post(srv.url + "/v1/chat/completions", content=big)
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b" " * 500
        r = httpx.post(srv.url + "/v1/messages", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        # A declared 100 MB body is refused on its headers alone.
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 100000000\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 413")


def test_client_disconnect_mid_stream_leaves_partial_capture(gateway: ServerThread,
                                                             collected: Collected) -> None:
    async def cut() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        body = orjson.dumps({"model": "slow-stream", "stream": True,
                             "messages": [{"role": "user", "content": "a b c d e f g h"}]})
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.readuntil(b"data: ")  # the first chunk arrived
        writer.close()

    asyncio.run(cut())
    wait_until(lambda: len(collected) == 1, what="the partial capture")
    payload = collected[0].payload
    assert payload["partial"] is True and payload["status"] == 200
    assert 1 <= len(payload["stream"]) < 10


def test_keys_cli_and_gateway_auth(gateway: ServerThread, capsys: pytest.CaptureFixture) -> None:
    url = gateway.url + "/v1/chat/completions"
    assert httpx.post(url, json=CHAT).status_code == 200  # no key yet: loopback is served
    assert main(["keys", "create", "--name", "ci"]) == 0
    out = capsys.readouterr().out
    key = out.splitlines()[0]
    assert key.startswith("fk-")
    assert "export FACTORY_GATEWAY_KEY=" in out  # what the factory's own clients send
    store = KeyStore()
    [info] = store.infos()
    assert key not in (store.path.read_text()) and info.sha256 in store.path.read_text()

    def status(headers: dict[str, str]) -> int:
        return httpx.post(url, json=CHAT, headers=headers).status_code

    wait_until(lambda: status({}) == 401, 10, "the key file to be noticed")
    assert status({"X-Factory-Key": "fk-wrong"}) == 401
    assert status({"X-Factory-Key": key}) == 200
    assert main(["keys", "list", "--format", "json"]) == 0
    assert orjson.loads(capsys.readouterr().out)[0]["key_id"] == info.key_id
    assert main(["keys", "revoke", info.key_id]) == 0
    # Revoked, and no valid key left: back to loopback-only without a key.
    wait_until(lambda: status({"X-Factory-Key": key}) == 200 and status({}) == 200, 10)
    assert main(["keys", "revoke", "nope"]) == 2


def test_remote_clients_refused_while_no_key_exists(factory_home: Path,
                                                    upstream: ServerThread) -> None:
    app = Gateway(make_config(upstream), lake_factory=lambda: None, ingest=Collected())
    sent: list[dict] = []

    async def call(client: str) -> int:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "query_string": b"", "headers": [], "client": (client, 5555)}

        async def receive() -> dict:
            return {"type": "http.request", "body": orjson.dumps(CHAT), "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return int(sent[-2]["status"])

    assert asyncio.run(call("10.1.2.3")) == 403
    assert b"factory keys create" in sent[-1]["body"]


def test_metrics_and_healthz(gateway: ServerThread, collected: Collected) -> None:
    httpx.post(gateway.url + "/v1/chat/completions", json=CHAT)
    wait_until(lambda: collected, what="the capture")
    text = httpx.get(gateway.url + "/metrics").text
    assert 'factory_gateway_requests_total{provider="openai",route="chat.completions",' \
           'status="200"} 1' in text
    assert 'factory_gateway_overhead_seconds_bucket{provider="openai",le="+Inf"} 1' in text
    for name in ("factory_gateway_spool_depth 0", "factory_gateway_captures_dropped_total 0",
                 "factory_gateway_flush_lag_seconds", "factory_gateway_captures_committed_total"):
        assert name in text
    assert httpx.get(gateway.url + "/healthz").json()["status"] == "ok"


def test_parse_tags() -> None:
    assert parse_tags("a=1, b = two ,") == {"a": "1", "b": "two"}
    with pytest.raises(ValueError, match="not key=value"):
        parse_tags("a=1,broken")


def test_bad_tags_header_is_400(gateway: ServerThread) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT,
                   headers={"X-Factory-Tags": "novalue"})
    assert r.status_code == 400 and "novalue" in r.json()["error"]["message"]
