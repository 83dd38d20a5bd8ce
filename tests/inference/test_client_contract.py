"""The client side of the serving protocol: ``InferenceClient`` and the equivalence gate against a
stand-in for ``vllm serve`` that answers exactly the contract's shapes, the way vLLM fills them
(an empty ``/health``, ``owned_by: vllm``, echoed tokens as ``token_id:N``, its extra fields),
and refuses any request outside the contract. The gate's verdicts on scripted answers are the
ones it gave on ``/v1/score``: same tolerance, same per-sample reasons."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from factory.evals import check_equivalence
from factory.evals.answers import to_openai_messages
from factory.evals.equivalence import trainer_view
from factory.inference import InferenceClient, InferenceClientError
from factory.inference.contract import ContractError, check
from factory.tasks import generate_conversations
from factory.trainer.chat import IGNORE_INDEX

Render = Callable[[list[Any], list[Any] | None], list[int]]
Score = Callable[[list[int]], list[float | None]]


class VllmStandIn:
    """An ASGI app answering the contract's requests with scripted values in vLLM's shapes.

    ``render(messages, tools)``: the prompt token ids a chat request renders to;
    ``score(ids)``: the log-prob of each prompt token (None first); ``echo(ids)``: the tokens a
    completion echoes (the prompt's, unless a test scripts a server that re-tokenizes).
    """

    def __init__(self, render: Render, score: Score,
                 echo: Callable[[list[int]], list[int]] = list) -> None:
        self.render, self.score, self.echo = render, score, echo
        self.adapters: dict[str, str] = {}
        self.requests: list[str] = []
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])

    async def _request(self, request: Request, name: str) -> dict[str, Any]:
        self.requests.append(name)
        body: dict[str, Any] = check(f"{name}.request", json.loads(await request.body()))
        return body

    @staticmethod
    def _error(status: int, message: str, kind: str) -> Response:
        return JSONResponse(check("error", {"error": {"message": message, "type": kind,
                                                      "param": None, "code": status}}),
                            status_code=status)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        card = {"object": "model", "created": 0, "owned_by": "vllm", "max_model_len": 4096,
                "permission": [{"id": "modelperm-0", "object": "model_permission"}]}
        data = [{"id": "base", "root": "/models/base", "parent": None, **card}]
        data += [{"id": n, "root": p, "parent": "base", **card} for n, p in self.adapters.items()]
        return JSONResponse(check("models.response", {"object": "list", "data": data}))

    async def load(self, request: Request) -> Response:
        try:
            body = await self._request(request, "load_lora_adapter")
        except ContractError as e:
            return self._error(400, str(e), "BadRequestError")
        self.adapters[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added "
                                 "successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            body = await self._request(request, "unload_lora_adapter")
        except ContractError as e:
            return self._error(400, str(e), "BadRequestError")
        if self.adapters.pop(body["lora_name"], None) is None:
            return self._error(404, f"The lora adapter '{body['lora_name']}' cannot be found.",
                               "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed "
                                 "successfully.")

    async def chat(self, request: Request) -> Response:
        try:
            body = await self._request(request, "chat")
        except ContractError as e:
            return self._error(400, str(e), "BadRequestError")
        ids = self.render(body["messages"], body.get("tools"))
        out = {"id": "chatcmpl-0", "object": "chat.completion", "created": 0,
               "model": body["model"],
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok",
                                                    "refusal": None, "reasoning": None},
                            "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                            "token_ids": [7, 2] if body.get("return_token_ids") else None}],
               "service_tier": None, "system_fingerprint": None,
               "usage": {"prompt_tokens": len(ids), "completion_tokens": 2,
                         "total_tokens": len(ids) + 2, "prompt_tokens_details": None},
               "prompt_logprobs": None,
               "prompt_token_ids": ids if body.get("return_token_ids") else None,
               "kv_transfer_params": None}
        return JSONResponse(check("chat.response", out))

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._request(request, "completion")
        except ContractError as e:
            return self._error(400, str(e), "BadRequestError")
        ids = body["prompt"]
        # The gate's request: echo, logprobs, max_tokens 0, tokens as ids.
        assert isinstance(ids, list) and body.get("echo") and body.get("max_tokens") == 0
        assert body.get("return_tokens_as_token_ids") and body.get("logprobs") is not None
        tokens = [f"token_id:{t}" for t in self.echo(ids)]
        values = self.score(ids)
        top = [None if v is None else {name: v} for name, v in zip(tokens, values, strict=True)]
        plp = [None if v is None else {str(t): {"logprob": v, "rank": 1, "decoded_token": "x"}}
               for t, v in zip(ids, values, strict=True)]
        out = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": body["model"],
               "choices": [{"index": 0, "text": "", "finish_reason": "length",
                            "stop_reason": None, "prompt_logprobs": plp,
                            "prompt_token_ids": None, "token_ids": None,
                            "logprobs": {"text_offset": [10 * i for i in range(len(tokens))],
                                         "token_logprobs": values, "tokens": tokens,
                                         "top_logprobs": top}}],
               "usage": {"prompt_tokens": len(ids), "completion_tokens": 1,
                         "total_tokens": len(ids) + 1}, "system_fingerprint": None}
        return JSONResponse(check("completion.response", out))


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` on 127.0.0.1 in a thread, on a port bound here (port 0) before it serves;
    yields its OpenAI base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:  # bound and listening
            assert thread.is_alive(), "the stand-in server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _canonical(conv: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                         for m in conv["messages"]], "tools": []}


SAMPLES = [_canonical(c) for c in generate_conversations(2, seed=5)]


@pytest.fixture(scope="module")
def views(adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> list[Any]:
    return trainer_view(str(adapter_dirs["good"]), SAMPLES, base_model=str(tiny_model_dir))


def _key(messages: Any) -> str:
    return json.dumps(messages, sort_keys=True)


def _stand_in(views: list[Any], *, render_at: dict[int, int] | None = None,
              shift: Callable[[int, int, bool], float] | None = None,
              echo: Callable[[list[int]], list[int]] = list) -> VllmStandIn:
    """A stand-in that renders each sample to the trainer's ids (``render_at``: sample -> a
    position whose id it changes) and scores them with the trainer's log-probs (``shift``:
    added at (sample, position, trained?))."""
    by_messages = {_key(to_openai_messages(s["messages"])): k for k, s in enumerate(SAMPLES)}

    def render(messages: list[Any], tools: list[Any] | None) -> list[int]:
        k = by_messages[_key(messages)]
        ids = list(views[k][0])
        if render_at and k in render_at:
            ids[render_at[k]] += 1
        return ids

    def score(ids: list[int]) -> list[float | None]:
        k = next(k for k, v in enumerate(views) if v[0] == ids)
        _, labels, lps = views[k]
        return [None, *(lp + (shift(k, i + 1, labels[i + 1] != IGNORE_INDEX) if shift else 0.0)
                        for i, lp in enumerate(lps))]

    return VllmStandIn(render, score, echo)


def _gate(stand_in: VllmStandIn, adapter_dirs: dict[str, Path],
          tiny_model_dir: Path) -> Any:
    with serving(stand_in.app) as url:
        client = InferenceClient(url)
        try:
            return check_equivalence(client, "ok", str(adapter_dirs["good"]), SAMPLES,
                                     base_model=str(tiny_model_dir))
        finally:
            client.close()


def test_the_client_sends_and_reads_only_the_contract() -> None:
    stand_in = VllmStandIn(lambda messages, tools: [5, 6, 7], lambda ids: [None, -0.5, -1.5])
    with serving(stand_in.app) as url:
        client = InferenceClient(url)
        client.load_adapter("a", "/ckpt/a")
        assert client.models() == ["base", "a"]
        reply = client.chat("a", [{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply["choices"][0]["message"]["content"] == "ok"
        assert client.rendered_ids("a", [{"role": "user", "content": "hi"}]) == [5, 6, 7]
        assert client.prompt_logprobs("a", [5, 6, 7]) == [-0.5, -1.5]
        client.unload_adapter("a")
        with pytest.raises(InferenceClientError, match="HTTP 404.*cannot be found"):
            client.unload_adapter("a")
        # A field vLLM does not know is refused by the stand-in, as a contract violation.
        with pytest.raises(InferenceClientError, match="HTTP 400.*Additional properties"):
            client.chat("a", [{"role": "user", "content": "hi"}], best_of=2)
        client.close()
    assert stand_in.requests == ["load_lora_adapter", "chat", "chat", "completion",
                                 "unload_lora_adapter", "unload_lora_adapter", "chat"]


def test_the_gate_passes_a_server_that_matches_the_trainer(
        views: list[Any], adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    result = _gate(_stand_in(views), adapter_dirs, tiny_model_dir)
    assert result.passed, result.problems
    trained = sum(sum(1 for lab in labels[1:] if lab != IGNORE_INDEX) for _, labels, _ in views)
    assert result.num_tokens == trained > 20
    assert result.max_abs_diff == 0.0
    # Log-probs of tokens the trainer does not train (system, user) are not compared.
    untrained = _gate(_stand_in(views, shift=lambda k, i, trained: 0.0 if trained else 3.0),
                      adapter_dirs, tiny_model_dir)
    assert untrained.passed and untrained.max_abs_diff == 0.0


def test_the_gate_fails_on_log_probs_beyond_the_tolerance(
        views: list[Any], adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    # 0.01 nats on one trained token of sample 1: ten times the default tolerance (1e-3).
    first = next(i for i, lab in enumerate(views[1][1]) if i > 0 and lab != IGNORE_INDEX)
    result = _gate(_stand_in(views, shift=lambda k, i, trained: 0.01 if (k, i) == (1, first)
                             else 0.0), adapter_dirs, tiny_model_dir)
    assert not result.passed and len(result.problems) == 1
    assert result.problems[0].startswith("sample 1: log-probs differ by up to 0.01 nats "
                                         "(> 0.001) over ")
    assert result.problems[0].endswith("-- the server's weights or adapter differ from the "
                                       "trainer's")
    assert result.max_abs_diff == pytest.approx(0.01)


def test_the_gate_fails_on_a_different_rendering(
        views: list[Any], adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    result = _gate(_stand_in(views, render_at={0: 5}), adapter_dirs, tiny_model_dir)
    assert not result.passed and len(result.problems) == 1
    assert result.problems[0].startswith("sample 0: the server renders different tokens than "
                                         f"the trainer (first difference at token 5 of "
                                         f"{len(views[0][0])}: server {views[0][0][5] + 1} (")
    assert result.problems[0].endswith("-- chat template or tokenizer mismatch")
    assert result.num_tokens > 0  # sample 1 was still compared


def test_a_server_that_scores_other_tokens_is_an_error(
        views: list[Any], adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    retokenized = _stand_in(views, echo=lambda ids: [ids[0], ids[1] + 1, *ids[2:]])
    with pytest.raises(InferenceClientError, match="echoed other tokens"):
        _gate(retokenized, adapter_dirs, tiny_model_dir)
