"""Constrained decoding on the CPU server: vLLM's ``structured_outputs`` enforced token by token.

The tiny model is random-init, so what it writes unconstrained is noise; every answer below
that lands in the choice set or parses as JSON of the schema does so because of the
constraint. Batching is checked on the engine itself: a free request batched with constrained
ones answers as it does alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from factory.inference import InferenceServer
from factory.inference.constrain import OutputSpec, build_constraint, parse_structured_outputs
from factory.inference.engine import Engine, EngineError, GenerationRequest

# The engine passes ``past_key_values``, which transformers 5.25 deprecates for ``cache``.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`past_key_values` is deprecated:FutureWarning")

CHOICES = ["billing", "bug", "bug report", "account_access", "shipping"]
"""Labels with one a prefix of another (the trie must let ``bug`` end or go on)."""
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"team": {"enum": ["billing", "bug", "shipping"]},
                   "urgent": {"type": "boolean"},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9},
                   "note": {"type": "string", "maxLength": 6}},
    "required": ["team", "urgent", "count", "note"], "additionalProperties": False}
"""Every value bounded, so a random model's answer ends within the token budget."""


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": "Route the ticket."},
             {"role": "user", "content": f"Ticket {i}: " + "the desk wobbles " * (i % 3 + 1)}]
            for i in range(n)]


def _chat(server: InferenceServer, messages: list[dict[str, str]], **extra: Any) -> Any:
    r = httpx.post(server.base_url + "/chat/completions", timeout=300,
                   json={"model": "base", "messages": messages, "max_tokens": 40,
                         "temperature": 0, **extra})
    return r


def test_choice_answers_are_always_one_of_the_choices(cpu_server: InferenceServer) -> None:
    prompts = _prompts(6)
    free = [_chat(cpu_server, p).json()["choices"][0]["message"]["content"] for p in prompts[:2]]
    assert not any(f in CHOICES for f in free)  # the model alone writes noise

    with ThreadPoolExecutor(max_workers=6) as pool:  # concurrent: the server batches them
        answers = list(pool.map(lambda p: _chat(
            cpu_server, p, structured_outputs={"choice": CHOICES}).json(), prompts))
    for a in answers:
        assert a["choices"][0]["message"]["content"] in CHOICES
        assert a["choices"][0]["finish_reason"] == "stop"
    # sampled too: a hot temperature still never leaves the set
    for seed in range(4):
        hot = _chat(cpu_server, prompts[0], temperature=1.5, seed=seed,
                    structured_outputs={"choice": CHOICES}).json()
        assert hot["choices"][0]["message"]["content"] in CHOICES

    streamed = httpx.post(cpu_server.base_url + "/chat/completions", timeout=300, json={
        "model": "base", "messages": prompts[0], "max_tokens": 40, "temperature": 0,
        "stream": True, "structured_outputs": {"choice": CHOICES}})
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in streamed.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text == answers[0]["choices"][0]["message"]["content"]

    completion = httpx.post(cpu_server.base_url + "/completions", timeout=300, json={
        "model": "base", "prompt": "The team is", "max_tokens": 10,
        "structured_outputs": {"choice": CHOICES}}).json()
    assert completion["choices"][0]["text"] in CHOICES


def test_json_answers_parse_and_validate_against_the_schema(cpu_server: InferenceServer
                                                            ) -> None:
    free = _chat(cpu_server, _prompts(1)[0]).json()["choices"][0]["message"]["content"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    for p in _prompts(3):
        r = _chat(cpu_server, p, max_tokens=80, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(("field", "message"), [
    ({"regex": "[a-z]+"}, "structured_outputs.regex: not supported by this server; "
                          "supported: choice, json, disable_any_whitespace"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
    ({"choice": ["a"], "json": {}}, "give exactly one of choice, json, got 2"),
    ({"json": "{not json"}, "structured_outputs.json: not JSON"),
    ("yes", "structured_outputs: must be an object"),
])
def test_a_bad_structured_outputs_is_a_400_naming_the_field(cpu_server: InferenceServer,
                                                            field: Any, message: str) -> None:
    r = _chat(cpu_server, _prompts(1)[0], structured_outputs=field)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_a_schema_no_grammar_can_hold_is_a_400(cpu_server: InferenceServer) -> None:
    r = _chat(cpu_server, _prompts(1)[0], structured_outputs={"json": {"type": "nonsense"}})
    assert r.status_code == 400
    assert "structured_outputs.json" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    yield Engine(tiny_model_dir, served_model_name="base")


def _request(engine: Engine, i: int, spec: OutputSpec | None = None) -> GenerationRequest:
    ids = engine.encode("base", engine.render("base", _prompts(4)[i]))
    constraint = None if spec is None else build_constraint(
        spec, engine.tokenizer_for("base"), engine.stop_token_ids("base"))
    return GenerationRequest(model="base", prompt_ids=ids, max_tokens=24, constraint=constraint)


def test_constrained_and_free_requests_share_a_batch(engine: Engine) -> None:
    choice = parse_structured_outputs({"choice": CHOICES})
    schema = parse_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True})
    alone = engine.generate([_request(engine, 0)])[0]
    batch = engine.generate([_request(engine, 1, choice), _request(engine, 0),
                             _request(engine, 2, schema), _request(engine, 3, choice)])
    assert batch[1].text == alone.text  # the free row is untouched by its neighbours' masks
    assert batch[0].text in CHOICES and batch[3].text in CHOICES
    jsonschema.validate(json.loads(batch[2].text), SCHEMA)


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]
"""Arguments bounded, so a random model's calls end within the token budget."""


def _valid_calls(message: dict[str, Any], names: set[str]) -> list[str]:
    """The names of the message's calls, each checked against its tool's parameters."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[name])
        out.append(name)
    return out


def test_tool_choice_required_or_named_makes_the_reply_calls(cpu_server: InferenceServer
                                                            ) -> None:
    """OpenAI's ``tool_choice``, enforced as vLLM enforces it: ``required``, one or more calls of
    the request's tools; a named function, one call of it; arguments valid against the tool's
    parameters. Unconstrained, the random model writes no call at all."""
    for messages in _prompts(3):
        free = _chat(cpu_server, messages, tools=TOOLS, max_tokens=60).json()
        assert not free["choices"][0]["message"].get("tool_calls")
        named = _chat(cpu_server, messages, tools=TOOLS, max_tokens=60, tool_choice={
            "type": "function", "function": {"name": "get_time"}})
        assert named.status_code == 200, named.text
        choice = named.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert _valid_calls(choice["message"], {"get_time"}) == ["get_time"]
        required = _chat(cpu_server, messages, tools=TOOLS, max_tokens=200,
                         tool_choice="required").json()["choices"][0]
        assert _valid_calls(required["message"], {"get_weather", "get_time"})
        # more calls may follow until the budget: whatever was cut stays as content
        assert required["finish_reason"] == "tool_calls" or required["finish_reason"] == "length"


def test_the_call_grammar_is_the_trainers_rendering_of_calls(tiny_model_dir: Path) -> None:
    """What the trainer renders for calls (``factory.trainer.chat``: arguments compact, keys
    sorted) is what the constraint lets through, token by token; spaced arguments are not."""
    from transformers import AutoTokenizer

    from factory.inference.constrain import tool_choice_constraint
    from factory.normalize.request import canonical_request
    from factory.trainer.chat import render

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages, tools = canonical_request(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Zürich"}'}},
             {"id": "2", "type": "function", "function": {
                 "name": "get_time", "arguments": '{"zone": "UTC"}'}}]}], TOOLS)
    rendered = render(messages, tools)
    reply = rendered[rendered.rindex("assistant\n"):]
    calls = reply[reply.index("<tool_call>"):reply.rindex("</tool_call>") + len("</tool_call>")]

    def accepted(text: str) -> bool:
        c = tool_choice_constraint("required", tools, tok, [tok.eos_token_id])
        assert c is not None
        for t in tok.encode(text, add_special_tokens=False):
            if not bool(c.mask()[t]):
                return False
            c.advance(t)
        return bool(c.mask()[tok.eos_token_id])  # and it may end there

    assert accepted(calls)
    assert not accepted(calls.replace('{"city":"Zürich"}', '{"city": "Zürich"}'))


@pytest.mark.parametrize(("tool_choice", "tools", "error"), [
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "has no tool 'nope'"),
    ("required", None, "needs tools"),
    ("always", TOOLS, 'must be "auto", "none", "required"'),
    ({"type": "function"}, TOOLS, "a named tool is"),
])
def test_a_tool_choice_that_cannot_be_kept_is_a_400(cpu_server: InferenceServer,
                                                   tool_choice: Any, tools: Any,
                                                   error: str) -> None:
    r = _chat(cpu_server, _prompts(1)[0], tool_choice=tool_choice,
              **({"tools": tools} if tools else {}))
    assert r.status_code == 400 and error in r.json()["error"]["message"], r.text
    both = _chat(cpu_server, _prompts(1)[0], tools=TOOLS, tool_choice="required",
                 structured_outputs={"choice": CHOICES})
    assert both.status_code == 400 and "one constraint per request" in both.text


def test_structured_outputs_is_read_as_vllm_writes_it() -> None:
    assert parse_structured_outputs(None) is None
    spec = parse_structured_outputs({"choice": ["a", "b", "a"], "json": None})
    assert spec == OutputSpec(choice=("a", "b"))
    assert spec.to_request() == {"choice": ["a", "b"]}
    assert parse_structured_outputs({"json": json.dumps(SCHEMA)}) == OutputSpec(
        json_schema=SCHEMA)
    with pytest.raises(EngineError, match="non-empty strings"):
        parse_structured_outputs({"choice": ["a", ""]})


def test_a_route_with_a_constraint_answers_its_label_set_through_the_gateway(
        cpu_server: InferenceServer, factory_home: Path) -> None:
    """A deployment's route carries the constraint its run was evaluated under: the gateway adds
    it to requests that send none, so a client of ``factory/<name>`` never gets an answer outside
    the label set; a request that sends its own keeps it. Stored and read back from the lake's
    ``routes`` table, as the deployer writes it."""
    from factory.gateway import Gateway, GatewayConfig, ServerThread
    from factory.gateway.routes import Route, load_routes, register_route
    from factory.lake import Lake

    lake = Lake()
    register_route(Route(model="factory/triage", provider="openai", base_url=cpu_server.url,
                         deployment="base", version="v1",
                         structured_outputs={"choice": CHOICES}), lake=lake)
    assert load_routes(lake)["factory/triage"].structured_outputs == {"choice": CHOICES}
    config = GatewayConfig(port=0, openai_base_url="http://127.0.0.1:9", upstream_timeout_s=300,
                           routes_poll_s=0.1)
    app = Gateway(config, ingest=lambda *a, **k: None)
    with ServerThread(app) as gw:
        from tests.waiting import wait_until

        wait_until(lambda: app.routes.get("factory/triage"), what="the route")
        for messages in _prompts(3):
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=300,
                           json={"model": "factory/triage", "messages": messages,
                                 "max_tokens": 40, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] in CHOICES
        own = {"choice": ["shipping"]}
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=300,
                       json={"model": "factory/triage", "messages": _prompts(1)[0],
                             "max_tokens": 40, "temperature": 0, "structured_outputs": own})
        assert r.json()["choices"][0]["message"]["content"] == "shipping"
