"""The CPU server's HTTP API: the part of vLLM's OpenAI-compatible server the factory uses.

``docs/serving-protocol.md`` is the contract (vLLM's documentation cited there) and
``factory.inference.contract`` holds its shapes; tests/inference/test_contract.py checks this
server against them.

- ``GET /health``: 200 with an empty body once the model is loaded (as vLLM answers).
- ``GET /v1/models``: the base model (``--served-model-name``) and every loaded adapter.
- ``POST /v1/chat/completions``: streaming (SSE, ``stream_options.include_usage``) and not;
  ``max_tokens``/``max_completion_tokens``, ``temperature``/``top_p``/``seed``, ``stop``,
  ``logprobs``/``top_logprobs``; ``n`` > 1 is refused. With ``tools`` (and ``tool_choice`` not
  ``"none"``), calls the model writes in the trainer's format come back as OpenAI's
  ``message.tool_calls`` (``content`` null when nothing else was said, ``finish_reason``
  ``"tool_calls"``), streamed as OpenAI streams tool-call deltas; a malformed call is returned
  as content. ``factory.inference.protocol`` says how, and ``factory.normalize.request`` how a
  request's messages become the canonical conversation that is rendered. ``tool_choice``
  ``"required"`` or a named function constrains the reply to calls of the request's tools (of
  that one), arguments valid against their parameters (``factory.inference.constrain``), as
  vLLM enforces it; ``"auto"`` constrains nothing. vLLM's extra parameters
  ``add_generation_prompt`` (default true), ``return_token_ids`` (the response's
  ``prompt_token_ids`` and ``choices[0].token_ids``) and ``prompt_logprobs`` (non-streamed) are
  honoured: the equivalence gate reads the rendered prompt's token ids with them. OpenAI
  ``image_url`` parts (``data:`` URLs; canonical image parts by sha256 read from the blob store)
  go through a vision-language model's processor and are fed with the prompt; a remote URL
  (never fetched) or an image missing from the blob store is a 400. A text-only model renders an
  image as ``[image]``, the text it was trained on.
  vLLM's ``structured_outputs`` (``{"choice": [...]}`` or ``{"json": SCHEMA}``) constrains
  decoding to one of the strings or to JSON of the schema (``factory.inference.constrain``);
  its other keys are a 400.
- ``POST /v1/completions``: one prompt, text or token ids, not streamed; ``max_tokens``
  (default 16; 0 only with ``echo``), ``echo``, ``logprobs`` (the OpenAI legacy shape:
  ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``, prompt tokens included with
  ``echo``), ``temperature``/``top_p``/``seed``, ``stop``, and vLLM's ``prompt_logprobs``,
  ``return_token_ids``, ``return_tokens_as_token_ids`` and ``structured_outputs``. The
  equivalence gate scores the trainer's token ids with ``echo`` + ``logprobs``.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: vLLM's runtime LoRA API, same bodies, same
  plain-text success replies. With a resolver folder (``--lora-resolver-dir``, default
  ``$VLLM_LORA_RESOLVER_CACHE_DIR``), a completion naming a model the server does not know loads
  the adapter of that name from it first, by vLLM's filesystem resolver's rule
  (``factory.inference.resolver``).
- ``GET /metrics``: Prometheus text; the prefix cache's counters per served model under vLLM's
  names (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``: prompt tokens
  looked up and reused), and ``factory:prefix_cache_requests_total`` (``result`` ``hit`` or
  ``miss``), ``factory:prefix_cache_entries`` and ``factory:prefix_cache_bytes``; prompt
  lookup's drafts under vLLM's speculative decoding names (``vllm:spec_decode_num_drafts_total``,
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total``).
- ``POST /reset_prefix_cache``: forgets every cached prefix (vLLM's route of the same name);
  the counters keep counting.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}``.

``serve`` runs the app on a socket ``python -m factory.inference`` bound before loading the model
(port 0: one the kernel picks, which the launcher is told through ``--port-fd``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from factory.inference.constrain import (
    build_constraint,
    parse_structured_outputs,
    tool_choice_constraint,
)
from factory.inference.contract import TOKEN_ID_PREFIX
from factory.inference.engine import (
    BatchScheduler,
    Engine,
    EngineError,
    GenerationRequest,
    TokenConstraint,
    TokenLogprob,
)
from factory.inference.protocol import FIRST_DELTA, ReplyStream, reply_message
from factory.inference.resolver import find
from factory.normalize.canon import NormalizeError
from factory.normalize.request import canonical_request, chat_template_input
from factory.trainer.cores import CoreShare
from factory.trainer.vision import ImageInput, expand_pads

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


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise EngineError(f"{name}: must be a boolean, got {v!r}")
    return v


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a chat or text completion request, as ``GenerationRequest``'s."""
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise EngineError("stop: must be a string or a list of strings")
    if _int(body, "n", 1, 1) != 1:
        raise EngineError("n: only 1 is supported")
    return {"temperature": _float(body, "temperature", 0.0, 0.0, 2.0),
            "top_p": _float(body, "top_p", 1.0, 0.0, 1.0), "seed": _int(body, "seed", None, 0),
            "stop": stop}


def _finite(logprob: float) -> float:
    """-inf written as OpenAI and vLLM write it (JSON has no infinity)."""
    return logprob if math.isfinite(logprob) else -9999.0


def _token_text(tok: Any, token_id: int) -> str:
    return str(tok.decode([token_id], skip_special_tokens=False))


def _chat_logprob(tok: Any, e: TokenLogprob) -> dict[str, Any]:
    """One generated token in a chat response's ``logprobs.content``."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {**entry(e.token_id, e.logprob),
            "top_logprobs": [entry(t, lp) for t, lp in e.top]}


def _prompt_logprobs(tok: Any, entries: list[TokenLogprob | None]) -> list[Any]:
    """vLLM's ``prompt_logprobs``: null for the first token, then per token a map from token
    id to ``{logprob, rank, decoded_token}``, the prompt's own token first."""
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank,
                               "decoded_token": _token_text(tok, e.token_id)}}
        for rank, (t, lp) in enumerate(e.top, start=1):
            d.setdefault(str(t), {"logprob": _finite(lp), "rank": rank,
                                  "decoded_token": _token_text(tok, t)})
        out.append(d)
    return out


def _completion_logprobs(tok: Any, ids: list[int], entries: list[TokenLogprob | None], k: int,
                         *, as_ids: bool) -> dict[str, Any]:
    """The OpenAI legacy ``logprobs`` of a text completion over ``ids`` (with ``echo``, the
    prompt's tokens too, the first one without a log-prob): the token itself and then the ``k``
    most likely at each position in ``top_logprobs``, as vLLM fills it."""
    def name(token_id: int) -> str:
        return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else _token_text(tok, token_id)

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = 0
    for token_id, e in zip(ids, entries, strict=True):
        tokens.append(name(token_id))
        offsets.append(pos)
        pos += len(tokens[-1])
        if e is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(e.logprob))
        top = {tokens[-1]: _finite(e.logprob)}
        for t, lp in e.top[:k]:
            top.setdefault(name(t), _finite(lp))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def _prompt(engine: Engine, model: str, body: dict[str, Any], *,
            add_generation_prompt: bool) -> tuple[str, list[dict[str, Any]], list[ImageInput]]:
    """The request's conversation rendered for ``model``, the tools it declared (canonical), and
    its images through a vision model's processor (each one's pads expanded in the text)."""
    engine.tokenizer_for(model)
    blobs: dict[str, bytes] = {}
    messages, tools = canonical_request(body.get("messages"), body.get("tools"), blobs=blobs)
    text = engine.render(model, *chat_template_input(messages, tools),
                         add_generation_prompt=add_generation_prompt)
    images = engine.images(messages, blobs)
    if engine.vision is not None:
        try:
            text = expand_pads(text, images)
        except ValueError as e:
            raise EngineError(str(e)) from None
    return text, tools, images


async def _constraint(engine: Engine, model: str, body: dict[str, Any],
                      tools: list[dict[str, Any]] | None = None) -> TokenConstraint | None:
    """The request's ``structured_outputs``, or a chat request's ``tool_choice`` over its
    ``tools``, as a constraint over ``model``'s tokens (None when neither constrains); built off
    the event loop (a grammar's first one per tokenizer: ~1 s)."""
    spec = parse_structured_outputs(body.get("structured_outputs"))
    calls = tools is not None and body.get("tool_choice") not in (None, "auto", "none")
    if spec is None and not calls:
        return None  # most requests: no tokenizer work
    tokenizer, stops = engine.tokenizer_for(model), engine.stop_token_ids(model)
    if tools is not None and calls:
        if spec is not None:
            raise EngineError("structured_outputs: not with a tool_choice that asks for a "
                              "call (one constraint per request)")
        return await asyncio.to_thread(tool_choice_constraint, body.get("tool_choice"), tools,
                                       tokenizer, stops)
    assert spec is not None
    return await asyncio.to_thread(build_constraint, spec, tokenizer, stops)


def _request_error(e: ValueError) -> JSONResponse:
    if "does not exist" in str(e):
        return _error(404, str(e), "NotFoundError")
    return _error(400, str(e))


class _EngineCollector:
    """The engine's prefix-cache and prompt-lookup counters as Prometheus metrics, read when
    scraped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        cache = self.engine.prefix_cache
        stats = cache.stats()
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens looked up.",
                                      labels=["model_name"])
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in prompt tokens reused.",
                                   labels=["model_name"])
        requests = CounterMetricFamily("factory:prefix_cache_requests",
                                       "Requests that reused a cached prefix (hit) or not (miss).",
                                       labels=["model_name", "result"])
        for model, s in sorted(stats.items()):
            queries.add_metric([model], s.queries)
            hits.add_metric([model], s.hits)
            requests.add_metric([model, "hit"], s.hit_requests)
            requests.add_metric([model, "miss"], s.miss_requests)
        yield from (queries, hits, requests)
        yield GaugeMetricFamily("factory:prefix_cache_entries", "Cached prompt prefixes.",
                                value=len(cache))
        yield GaugeMetricFamily("factory:prefix_cache_bytes",
                                "Bytes of the cached prefixes' keys and values.",
                                value=cache.nbytes)
        lookup = self.engine.lookup_stats
        yield CounterMetricFamily("vllm:spec_decode_num_drafts",
                                  "Forward passes that checked a prompt-lookup draft.",
                                  value=lookup.drafts)
        yield CounterMetricFamily("vllm:spec_decode_num_draft_tokens",
                                  "Prompt-lookup tokens drafted.", value=lookup.draft_tokens)
        yield CounterMetricFamily("vllm:spec_decode_num_accepted_tokens",
                                  "Drafted tokens the model chose too.",
                                  value=lookup.accepted_tokens)


def create_app(engine: Engine, *, max_batch_size: int = 8,
               cores: CoreShare | None = None, resolver_dir: str | None = None) -> Starlette:
    """The ASGI app serving ``engine``; ``cores``: this server's claim on the machine's cores,
    held while it has requests in flight (``BatchScheduler``); ``resolver_dir``: a request naming
    a model the engine does not know loads the adapter of that name there, as vLLM's filesystem
    resolver does (``factory.inference.resolver``)."""
    scheduler = BatchScheduler(engine, max_batch_size=max_batch_size, cores=cores)
    resolving = asyncio.Lock()

    async def resolve(model: str) -> None:
        """Load ``model`` from ``resolver_dir`` when the engine does not know it (one load at a
        time: two requests for a new adapter load it once)."""
        if resolver_dir is None or model in engine.model_names():
            return
        async with resolving:
            if model in engine.model_names():
                return
            path = find(resolver_dir, model, engine.model_path)
            if path is not None:
                await asyncio.to_thread(engine.load_adapter, model, path)
    created = int(time.time())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(request: Request) -> Response:
        engine.prefix_cache.drop()
        return Response(status_code=200)

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

    async def chat(request: Request) -> Response:
        try:
            body = await _body(request)
            model = _str(body, "model")
            await resolve(model)
            max_tokens = _int(body, "max_completion_tokens", None, 1)
            max_tokens = _int(body, "max_tokens", max_tokens or DEFAULT_MAX_TOKENS, 1)
            assert max_tokens is not None
            top_logprobs: int | None = None
            if body.get("logprobs"):
                top_logprobs = _int(body, "top_logprobs", 0, 0)
            return_ids = _bool(body, "return_token_ids", False)
            prompt_lps = _int(body, "prompt_logprobs", None, 0)
            if prompt_lps is not None and body.get("stream"):
                raise EngineError("prompt_logprobs: not available when stream is true")
            prompt, tools, images = _prompt(
                engine, model, body,
                add_generation_prompt=_bool(body, "add_generation_prompt", True))
            has_tools = bool(tools)
            req = GenerationRequest(model=model, prompt_ids=engine.encode(model, prompt),
                                    max_tokens=max_tokens, top_logprobs=top_logprobs,
                                    images=images, constraint=await _constraint(
                                        engine, model, body, tools), **_sampling(body))
        except (EngineError, NormalizeError) as e:
            return _request_error(e)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        tool_calls = has_tools and body.get("tool_choice") != "none"
        if body.get("stream"):
            return _stream(req, rid, now, tool_calls,
                           bool((body.get("stream_options") or {}).get("include_usage")),
                           req.prompt_ids if return_ids else None)
        result = await asyncio.wrap_future(scheduler.submit(req))
        if tool_calls:
            message, finish = reply_message(result.text, result.finish_reason)
        else:
            message = {"role": "assistant", "content": result.text}
            finish = result.finish_reason
        tok = engine.tokenizer_for(model)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if result.logprobs is not None:
            choice["logprobs"] = {"content": [_chat_logprob(tok, e) for e in result.logprobs]}
        out: dict[str, Any] = {
            "id": rid, "object": "chat.completion", "created": now, "model": model,
            "choices": [choice], "usage": _usage(result.num_prompt_tokens,
                                                 len(result.token_ids))}
        if return_ids:
            choice["token_ids"] = result.token_ids
            out["prompt_token_ids"] = req.prompt_ids
        if prompt_lps is not None:
            entries = await asyncio.wrap_future(scheduler.call(
                engine.prompt_logprobs, model, req.prompt_ids, prompt_lps, req.images))
            out["prompt_logprobs"] = _prompt_logprobs(tok, entries)
        return JSONResponse(out)

    async def completions(request: Request) -> Response:
        try:
            body = await _body(request)
            model = _str(body, "model")
            await resolve(model)
            tok = engine.tokenizer_for(model)
            if body.get("stream"):
                raise EngineError("stream: text completions are not streamed by this server")
            prompt = body.get("prompt")
            if isinstance(prompt, str) and prompt:
                ids = engine.encode(model, prompt)
            elif isinstance(prompt, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = engine.check_prompt(model, list(prompt))
            else:
                raise EngineError("prompt: must be a non-empty string or a list of token ids "
                                  "(one prompt per request)")
            echo = _bool(body, "echo", False)
            max_tokens = _int(body, "max_tokens", 16, 0)
            assert max_tokens is not None
            if max_tokens == 0 and not echo:
                raise EngineError("max_tokens: 0 is only allowed with echo")
            logprobs = _int(body, "logprobs", None, 0)
            prompt_lps = _int(body, "prompt_logprobs", None, 0)
            return_ids = _bool(body, "return_token_ids", False)
            as_ids = _bool(body, "return_tokens_as_token_ids", False)
            sampling = _sampling(body)
            constraint = await _constraint(engine, model, body)
        except (EngineError, NormalizeError) as e:
            return _request_error(e)
        # vLLM computes the prompt's log-probs for prompt_logprobs, or for echo with logprobs.
        prompt_k = prompt_lps if prompt_lps is not None else logprobs if echo else None
        prompt_entries: list[TokenLogprob | None] = []
        if prompt_k is not None:
            prompt_entries = await asyncio.wrap_future(scheduler.call(
                engine.prompt_logprobs, model, ids, prompt_k))
        gen_ids: list[int] = []
        gen_entries: list[TokenLogprob] = []
        text, finish = "", "length"
        if max_tokens > 0:
            result = await asyncio.wrap_future(scheduler.submit(GenerationRequest(
                model=model, prompt_ids=ids, max_tokens=max_tokens, top_logprobs=logprobs,
                constraint=constraint, **sampling)))
            gen_ids, text, finish = result.token_ids, result.text, result.finish_reason
            gen_entries = result.logprobs or []
        if echo:
            text = (prompt if isinstance(prompt, str)
                    else str(tok.decode(ids, skip_special_tokens=False))) + text
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": finish, "stop_reason": None}
        if logprobs is not None:
            shown: list[int] = [*ids, *gen_ids] if echo else gen_ids
            entries: list[TokenLogprob | None] = (
                [*prompt_entries, *gen_entries] if echo else list(gen_entries))
            choice["logprobs"] = _completion_logprobs(tok, shown, entries, logprobs,
                                                      as_ids=as_ids)
        if prompt_k is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(tok, prompt_entries)
        if return_ids:
            choice["prompt_token_ids"] = ids
            choice["token_ids"] = gen_ids
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": _usage(len(ids), len(gen_ids))})

    def _stream(req: GenerationRequest, rid: str, now: int, tool_calls: bool,
                include_usage: bool, prompt_token_ids: list[int] | None) -> StreamingResponse:
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
            first = chunk(dict(FIRST_DELTA) if reply else {"role": "assistant", "content": ""})
            if prompt_token_ids is not None:  # vLLM sends them with the first chunk only
                obj = json.loads(first[len("data: "):])
                first = "data: " + json.dumps({**obj, "prompt_token_ids": prompt_token_ids}) \
                    + "\n\n"
            yield first
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
        Route("/metrics", metrics, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], lifespan=lifespan)
    return app


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def serve(app: Starlette, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Serve ``app`` on ``sock``, a bound TCP socket, until SIGINT/SIGTERM; uvicorn starts
    listening on it here."""
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=[sock])
