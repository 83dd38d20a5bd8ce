"""The official SDKs (and a Gemini REST client) work unchanged through the gateway, and every
conversation lands in ``samples`` with the upstream's answer, project and tags."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from factory.gateway import Gateway, ServerThread
from factory.lake import Lake
from tests.gateway.conftest import make_config
from tests.waiting import wait_until

HEADERS = {"X-Factory-Project": "support", "X-Factory-Tags": "team=core,env=test"}


@pytest.fixture()
def lake_gateway(factory_home: Path, upstream: ServerThread) -> Iterator[ServerThread]:
    config = make_config(upstream, openai_api_key="sk-UPSTREAM-SECRET-0123456789")
    with ServerThread(Gateway(config)) as srv:
        yield srv


def _texts(messages_json: str) -> list[tuple[str, str]]:
    return [(m["role"], "".join(p.get("text", "") for p in m["content"]))
            for m in orjson.loads(messages_json)]


def test_every_provider_and_mode_lands_in_samples(lake_gateway: ServerThread,
                                                  upstream: ServerThread,
                                                  factory_home: Path) -> None:
    url = lake_gateway.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="sk-client-side-key",
                        default_headers=HEADERS, max_retries=0)
    answer = oai.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "openai plain"}])
    assert answer.choices[0].message.content == "echo: openai plain"
    # The gateway holds the OpenAI key: the upstream saw it, not the client's.
    assert upstream.app.seen_auth == {"authorization": "Bearer sk-UPSTREAM-SECRET-0123456789"}
    stream = oai.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "openai streamed reply"}],
        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        "echo: openai streamed reply"

    ant = anthropic.Anthropic(base_url=url, api_key="sk-ant-client-key",
                              default_headers=HEADERS, max_retries=0)
    message = ant.messages.create(model="claude-x", max_tokens=64, system="be kind",
                                  messages=[{"role": "user", "content": "anthropic plain"}])
    assert message.content[0].text == "echo: anthropic plain"
    # No Anthropic key held: the client's own auth header is passed unchanged.
    assert "sk-ant-client-key" in " ".join(upstream.app.seen_auth.values())
    with ant.messages.stream(model="claude-x", max_tokens=64,
                             messages=[{"role": "user", "content": "anthropic streamed"}]) as st:
        assert st.get_final_text() == "echo: anthropic streamed"

    gem = httpx.Client(base_url=url, headers={**HEADERS, "x-goog-api-key": "AIza-client-key"})
    for suffix, text in ((":generateContent", "gemini plain"),
                         (":streamGenerateContent?alt=sse", "gemini sse"),
                         (":streamGenerateContent", "gemini array")):
        r = gem.post("/v1beta/models/gemini-2.0-flash" + suffix,
                     json={"contents": [{"role": "user", "parts": [{"text": text}]}]})
        assert r.status_code == 200, r.text
        assert f"echo: {text}".split(" ")[0] in r.text

    expected = {"openai plain", "openai streamed reply", "anthropic plain", "anthropic streamed",
                "gemini plain", "gemini sse", "gemini array"}
    lake = Lake()

    def found() -> dict[str, dict]:
        if not lake.exists("samples"):
            return {}
        rows = lake.read("samples").to_pylist()
        got = {}
        for row in rows:
            turns = _texts(row["messages"])
            users = [t for r, t in turns if r == "user"]
            if users and users[-1] in expected:
                got[users[-1]] = {"row": row, "turns": turns}
        return got if set(got) == expected else {}

    samples = wait_until(found, 30, "all seven conversations in samples")
    for text, hit in samples.items():
        assert hit["turns"][-1] == ("assistant", f"echo: {text}"), (text, hit["turns"])
        assert hit["row"]["source"] == "proxy"
        assert hit["row"]["project"] == "support"
        assert dict(hit["row"]["tags"]) == {"team": "core", "env": "test"}
    assert samples["openai plain"]["turns"][0] == ("system", "be brief")
    assert samples["anthropic plain"]["turns"][0] == ("system", "be kind")
    providers = {hit["row"]["provider"] for hit in samples.values()}
    assert providers == {"openai", "anthropic", "gemini"}
    raw = lake.read("raw_traces").to_pylist()
    assert len(raw) == 7 and {r["source"] for r in raw} == {"proxy"}

    lake_gateway.stop()
    # No key (upstream's or client's) anywhere under FACTORY_HOME: grep every file.
    for secret in ("sk-UPSTREAM-SECRET", "sk-client-side-key", "sk-ant-client-key",
                   "AIza-client-key"):
        found_in = subprocess.run(["grep", "-rl", "-a", secret, str(factory_home)],
                                  capture_output=True, text=True).stdout
        assert found_in == "", f"{secret} leaked into {found_in}"


def test_models_list_and_gemini_query_key_not_kept(gateway: ServerThread, upstream: ServerThread,
                                                   factory_home: Path, collected: list) -> None:
    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
    assert [m.id for m in oai.models.list().data] == ["stand-in"]
    r = httpx.post(gateway.url + "/v1beta/models/g:generateContent?key=AIza-QUERY-SECRET",
                   json={"contents": [{"parts": [{"text": "q"}]}]})
    assert r.status_code == 200
    assert upstream.app.seen_auth == {"key": "AIza-QUERY-SECRET"}  # passed through unchanged
    wait_until(lambda: len(collected) == 1, what="the capture")
    assert b"AIza-QUERY-SECRET" not in orjson.dumps(collected[0].payload)
    gateway.stop()
    out = subprocess.run(["grep", "-rl", "-a", "AIza-QUERY-SECRET", str(factory_home)],
                         capture_output=True, text=True).stdout
    assert out == ""
