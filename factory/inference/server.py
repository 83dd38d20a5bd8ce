"""The CPU server's HTTP API: the OpenAI-compatible subset vLLM serves, plus one factory endpoint.

- ``GET /health``: 200 once the model is loaded.
- ``GET /v1/models``: the base model (``--served-model-name``) and every loaded adapter.
- ``POST /v1/chat/completions``: streaming (SSE, ``stream_options.include_usage``) and not;
  ``max_tokens``/``max_completion_tokens``, ``temperature``/``top_p``/``seed``, ``stop``,
  ``logprobs``/``top_logprobs``; ``n`` > 1 is refused. With ``tools`` (and ``tool_choice`` not
  ``"none"``), calls the model writes in the trainer's format come back as OpenAI's
  ``message.tool_calls`` (``content`` null when nothing else was said, ``finish_reason``
  ``"tool_calls"``), streamed as OpenAI streams tool-call deltas; a malformed call is returned
  as content. ``factory.inference.protocol`` says how, and how a request's messages become the
  canonical conversation that is rendered. Any other ``tool_choice`` is served as ``"auto"``:
  generation is not constrained.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: vLLM's runtime LoRA API, same bodies, same
  plain-text success replies.
- ``POST /v1/score`` (factory-specific) ``{"model", "messages", "tools"?}``: renders the whole
  conversation with the model's chat template (no generation prompt) and returns
  ``{"model", "text", "token_ids", "tokens", "logprobs"}``, the log-probability of every token
  given the ones before it (``null`` for the first). The train/serve equivalence check reads it.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from factory.inference.engine import BatchScheduler, Engine, EngineError, GenerationRequest
from factory.inference.protocol import (
    FIRST_DELTA,
    ReplyStream,
    canonical_request,
    chat_template_input,
    reply_message,
)
from factory.normalize.canon import NormalizeError

DEFAULT_MAX_TOKENS = 256


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise EngineError(f"body: not JSON ({e})") from None
    if not isinstance(body, dict):
        raise EngineError("body: must be a JSON object")
    return body


def _str(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str):
        raise EngineError(f"{name}: required string")
    return v


def _int(body: dict[str, Any], name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise EngineError(f"{name}: must be an integer >= {lo}, got {v!r}")
    return v


def _float(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise EngineError(f"{name}: must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _prompt(engine: Engine, model: str, body: dict[str, Any], *,
            add_generation_prompt: bool) -> tuple[str, bool]:
    """The request's conversation rendered for ``model``, and whether it declared tools."""
    engine.tokenizer_for(model)
    messages, tools = canonical_request(body.get("messages"), body.get("tools"))
    text = engine.render(model, *chat_template_input(messages, tools),
                         add_generation_prompt=add_generation_prompt)
    return text, bool(tools)


def _request_error(e: ValueError) -> JSONResponse:
    if "does not exist" in str(e):
        return _error(404, str(e), "NotFoundError")
    return _error(400, str(e))


def create_app(engine: Engine, *, max_batch_size: int = 8) -> Starlette:
    """The ASGI app serving ``engine``."""
    scheduler = BatchScheduler(engine, max_batch_size=max_batch_size)
    created = int(time.time())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        data = [{"id": engine.served_model_name, "object": "model", "created": created,
                 "owned_by": "factory", "root": engine.model_path, "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "factory",
                  "root": path, "parent": engine.served_model_name}
                 for name, path in engine.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(request: Request) -> Response:
        try:
            body = await _body(request)
            name, path = _str(body, "lora_name"), _str(body, "lora_path")
            await asyncio.to_thread(engine.load_adapter, name, path)
        except EngineError as e:
            return _error(400, str(e))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        try:
            name = _str(await _body(request), "lora_name")
            if name not in engine.adapters:
                return _error(404, f"The lora adapter '{name}' cannot be found.",
                              "NotFoundError")
            await asyncio.to_thread(engine.unload_adapter, name)
        except EngineError as e:
            return _error(400, str(e))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def score(request: Request) -> Response:
        try:
            body = await _body(request)
            model = _str(body, "model")
            text, _ = _prompt(engine, model, body, add_generation_prompt=False)
            ids = engine.encode(model, text)
            lps = await asyncio.to_thread(engine.score, model, ids)
        except (EngineError, NormalizeError) as e:
            return _request_error(e)
        tok = engine.tokenizer_for(model)
        return JSONResponse({"model": model, "text": text, "token_ids": ids,
                             "tokens": tok.convert_ids_to_tokens(ids), "logprobs": lps})

    async def chat(request: Request) -> Response:
        try:
            body = await _body(request)
            model = _str(body, "model")
            if _int(body, "n", 1, 1) != 1:
                raise EngineError("n: only 1 is supported")
            max_tokens = _int(body, "max_completion_tokens", None, 1)
            max_tokens = _int(body, "max_tokens", max_tokens or DEFAULT_MAX_TOKENS, 1)
            assert max_tokens is not None
            stop = body.get("stop") or []
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise EngineError("stop: must be a string or a list of strings")
            top_logprobs: int | None = None
            if body.get("logprobs"):
                top_logprobs = _int(body, "top_logprobs", 0, 0)
            prompt, has_tools = _prompt(engine, model, body, add_generation_prompt=True)
            req = GenerationRequest(
                model=model, prompt_ids=engine.encode(model, prompt), max_tokens=max_tokens,
                temperature=_float(body, "temperature", 0.0, 0.0, 2.0),
                top_p=_float(body, "top_p", 1.0, 0.0, 1.0),
                seed=_int(body, "seed", None, 0), stop=stop, top_logprobs=top_logprobs)
        except (EngineError, NormalizeError) as e:
            return _request_error(e)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        tool_calls = has_tools and body.get("tool_choice") != "none"
        if body.get("stream"):
            return _stream(req, rid, now, tool_calls,
                           bool((body.get("stream_options") or {}).get("include_usage")))
        result = await asyncio.wrap_future(scheduler.submit(req))
        if tool_calls:
            message, finish = reply_message(result.text, result.finish_reason)
        else:
            message = {"role": "assistant", "content": result.text}
            finish = result.finish_reason
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if result.logprobs is not None:
            choice["logprobs"] = {"content": result.logprobs}
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": now, "model": model,
            "choices": [choice], "usage": _usage(result.num_prompt_tokens,
                                                 len(result.token_ids))})

    def _stream(req: GenerationRequest, rid: str, now: int, tool_calls: bool,
                include_usage: bool) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def on_token(tid: int, text: str) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, ("delta", text))

        req.on_token = on_token
        fut = scheduler.submit(req)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(deltas.put_nowait,
                                                                  ("done", f)))
        reply = ReplyStream() if tool_calls else None

        def chunk(delta: dict[str, Any], finish: str | None = None,
                  usage: dict[str, int] | None = None, with_choice: bool = True) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                   "created": now, "model": req.model,
                                   "choices": ([{"index": 0, "delta": delta,
                                                 "finish_reason": finish, "logprobs": None}]
                                               if with_choice else [])}
            if include_usage:
                obj["usage"] = usage
            return "data: " + json.dumps(obj) + "\n\n"

        async def events() -> Any:
            yield chunk(dict(FIRST_DELTA) if reply else {"role": "assistant", "content": ""})
            while True:
                kind, value = await deltas.get()
                if kind == "delta":
                    for delta in (reply.feed(value) if reply else [{"content": value}]):
                        if delta != {"content": ""}:
                            yield chunk(delta)
                    continue
                try:
                    result = value.result()
                except Exception as e:  # the engine failed mid-stream: say so in the stream
                    err = {"error": {"message": str(e), "type": "InternalServerError",
                                     "code": 500}}
                    yield "data: " + json.dumps(err) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                finish = result.finish_reason
                if reply:
                    last, finish = reply.close(finish)
                    for delta in last:
                        yield chunk(delta)
                yield chunk({}, finish)
                if include_usage:
                    yield chunk({}, usage=_usage(result.num_prompt_tokens,
                                                 len(result.token_ids)), with_choice=False)
                yield "data: [DONE]\n\n"
                return

        return StreamingResponse(events(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(scheduler.close)

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
    ], lifespan=lifespan)
    return app


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
