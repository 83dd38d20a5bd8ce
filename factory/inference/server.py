"""The CPU server's HTTP API: the OpenAI-compatible subset vLLM serves, plus one factory endpoint.

- ``GET /health``: 200 once the model is loaded.
- ``GET /v1/models``: the base model (``--served-model-name``) and every loaded adapter.
- ``POST /v1/chat/completions``: streaming (SSE, ``stream_options.include_usage``) and not;
  ``max_tokens``/``max_completion_tokens``, ``temperature``/``top_p``/``seed``, ``stop``,
  ``logprobs``/``top_logprobs``; tool calls in the output are parsed (trainer's format) into
  ``tool_calls`` when the request declared ``tools``. ``n`` > 1 is refused.
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


def _tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    from trainer.chat import parse_assistant

    msg = parse_assistant(text)
    calls = [{"id": c["id"], "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in msg.get("tool_calls", [])]
    if not calls:
        return text, []
    body = "\n".join(p["text"] for p in msg["content"] if p["type"] == "text")
    return (body or None), calls


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
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not isinstance(path, str):
                raise EngineError("lora_name and lora_path: both are required strings")
            await asyncio.to_thread(engine.load_adapter, name, path)
        except EngineError as e:
            return _error(400, str(e))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        try:
            body = await _body(request)
            name = body.get("lora_name")
            if not isinstance(name, str):
                raise EngineError("lora_name: required string")
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
            model = body.get("model")
            messages = body.get("messages")
            if not isinstance(model, str) or not isinstance(messages, list) or not messages:
                raise EngineError("model and messages: required (messages a non-empty list)")
            engine.tokenizer_for(model)
            text = engine.render(model, messages, body.get("tools"),
                                 add_generation_prompt=False)
            ids = engine.encode(model, text)
            lps = await asyncio.to_thread(engine.score, model, ids)
        except EngineError as e:
            status = 404 if "does not exist" in str(e) else 400
            return _error(status, str(e), "NotFoundError" if status == 404 else "BadRequestError")
        tok = engine.tokenizer_for(model)
        return JSONResponse({"model": model, "text": text, "token_ids": ids,
                             "tokens": tok.convert_ids_to_tokens(ids), "logprobs": lps})

    async def chat(request: Request) -> Response:
        try:
            body = await _body(request)
            model = body.get("model")
            messages = body.get("messages")
            if not isinstance(model, str):
                raise EngineError("model: required string")
            if not isinstance(messages, list) or not messages:
                raise EngineError("messages: must be a non-empty list")
            engine.tokenizer_for(model)
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
            tools = body.get("tools")
            prompt = engine.render(model, messages, tools)
            ids = engine.encode(model, prompt)
            req = GenerationRequest(
                model=model, prompt_ids=ids, max_tokens=max_tokens,
                temperature=_float(body, "temperature", 0.0, 0.0, 2.0),
                top_p=_float(body, "top_p", 1.0, 0.0, 1.0),
                seed=_int(body, "seed", None, 0), stop=stop, top_logprobs=top_logprobs)
        except EngineError as e:
            status = 404 if "does not exist" in str(e) else 400
            return _error(status, str(e), "NotFoundError" if status == 404 else "BadRequestError")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if body.get("stream"):
            return _stream(req, rid, now, bool(tools),
                           bool((body.get("stream_options") or {}).get("include_usage")))
        result = await asyncio.wrap_future(scheduler.submit(req))
        content, calls = _tool_calls(result.text) if tools else (result.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = result.finish_reason
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if result.logprobs is not None:
            choice["logprobs"] = {"content": result.logprobs}
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": now, "model": model,
            "choices": [choice], "usage": _usage(result.num_prompt_tokens,
                                                 len(result.token_ids))})

    def _stream(req: GenerationRequest, rid: str, now: int, has_tools: bool,
                include_usage: bool) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        def on_token(tid: int, text: str) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, ("delta", text))

        req.on_token = on_token
        # Tool calls can only be recognised once the whole text is there, so a request with
        # tools streams its content at the end (as one delta) rather than token by token.
        if has_tools:
            req.on_token = None
        fut = scheduler.submit(req)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(deltas.put_nowait,
                                                                  ("done", f)))

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
            yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, value = await deltas.get()
                if kind == "delta":
                    if value:
                        yield chunk({"content": value})
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
                if has_tools:
                    content, calls = _tool_calls(result.text)
                    delta: dict[str, Any] = {"content": content}
                    if calls:
                        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
                        finish = "tool_calls"
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
