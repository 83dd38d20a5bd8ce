"""The gateway's ASGI application: auth, the provider proxy routes, OTLP, health and metrics.

Written directly against ASGI (no router or request objects) because every microsecond here is
added to a frontier model's latency. The hot path parses only what it must: it validates the
request JSON and reads the model name, forwards the original bytes, relays streamed bytes as they
arrive, and writes the capture with one ``write(2)`` into the spool; response bodies and streams
are parsed later by the flusher, off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode

import orjson

from factory.gateway.asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    reply,
)
from factory.gateway.captures import stream_complete
from factory.gateway.config import PROVIDERS, GatewayConfig
from factory.gateway.errors import error_body
from factory.gateway.flusher import Flusher, IngestFn
from factory.gateway.keys import KeyStore, keys_path
from factory.gateway.metrics import Metrics
from factory.gateway.routes import RoutingTable
from factory.gateway.shadow import Shadower, ShadowTable
from factory.gateway.spool import SpoolWriter, encode, oldest_pending_age_s, pending_files
from factory.gateway.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from factory.lake import Lake
from factory.normalize.otlp import split_otlp
from factory.normalize.request import as_trained
from factory.settings import Settings, get_settings

log = logging.getLogger("factory.gateway")

# Never forwarded upstream: hop-by-hop headers, our own headers, and framing we set ourselves.
_DROP_REQUEST = frozenset({b"host", b"content-length", b"connection", b"keep-alive", b"te",
                           b"transfer-encoding", b"upgrade", b"trailer", b"accept-encoding",
                           b"proxy-authorization", b"proxy-connection"})
_DROP_RESPONSE = frozenset({b"content-length", b"transfer-encoding", b"connection",
                            b"keep-alive"})
_AUTH_HEADERS = frozenset({b"authorization", b"x-api-key", b"x-goog-api-key"})
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
TRAINER_EVENTS_PATH = "/v1/trainer/events"  # factory.control.receiver.PATH
# How long one lake call of the gateway (a flush, a routes read, a trainer event) retries a
# locked catalog or a lost commit race before it fails. The flusher retries whole batches
# itself; without a bound, a locked SQLite catalog kept one attempt waiting silently for
# minutes (20 catalog opens of up to 5 s each, then 60 commit tries), with nothing in the log
# or /metrics. Races between writers resolve in well under a second.
LAKE_PATIENCE_S = 5.0
_GEMINI_PREFIX = "/v1beta/models/"
SHADOW_GROUP_COMMIT_MS = 1000.0


def _upstream_url(base: str, path: str, query: bytes) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]  # OpenAI-style base URLs carry /v1; our paths do too
    url = base + path
    return f"{url}?{query.decode('latin-1')}" if query else url


def parse_tags(value: str) -> dict[str, str]:
    """``k=v,k=v`` -> dict; ValueError naming the bad item."""
    tags: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"X-Factory-Tags item {item!r} is not key=value")
        tags[key.strip()] = val.strip()
    return tags


class Gateway:
    """The ASGI app. ``start()``/``stop()`` run from the ASGI lifespan (or by hand in tests)."""

    def __init__(self, config: GatewayConfig, *, settings: Settings | None = None,
                 routes: RoutingTable | None = None, keys: KeyStore | None = None,
                 lake_factory: Callable[[], Any] | None = None,
                 ingest: IngestFn | None = None,
                 shadows: ShadowTable | None = None) -> None:
        self.config = config
        self.settings = (settings or get_settings()).ensure()
        self.metrics = Metrics()
        self.keys = keys or KeyStore(keys_path(self.settings))
        self.routes = routes or RoutingTable()
        self.shadows = shadows or ShadowTable()
        self.shadower = Shadower(self._spool_shadow, queue_size=config.shadow_queue_size,
                                 concurrency=config.shadow_concurrency,
                                 timeout_s=config.shadow_timeout_s)
        self.spool = SpoolWriter(self.settings.spool, group_commit_ms=config.group_commit_ms,
                                 segment_max_age_s=config.segment_max_age_s,
                                 segment_max_bytes=config.segment_max_bytes)

        def default_lake() -> Any:
            return Lake(self.settings, patience_s=LAKE_PATIENCE_S)

        self._lake_factory = lake_factory or default_lake
        self.flusher = Flusher(self.settings.spool, lake_factory=self._lake_factory,
                               ingest=ingest, interval_s=config.flush_interval_s,
                               max_records=config.flush_max_records,
                               retry_max_s=config.flush_retry_max_s,
                               expire_every_s=config.snapshot_expiry_every_s,
                               retention_s=config.snapshot_retention_s) if config.flush else None
        # Shadow pairs have a spool and a flusher of their own: a commit to shadow_pairs costs
        # about as much for ten pairs as for a thousand, so they are committed every
        # shadow_flush_s rather than with every batch of captures.
        shadow_dir = self.settings.spool / "shadow"
        # A pair lost to a power cut is one eval sample, not traffic: their fsyncs are grouped
        # over a second rather than config.group_commit_ms.
        self.shadow_spool = SpoolWriter(shadow_dir, group_commit_ms=SHADOW_GROUP_COMMIT_MS,
                                        segment_max_age_s=config.shadow_flush_s,
                                        segment_max_bytes=config.segment_max_bytes)
        self.shadow_flusher = Flusher(shadow_dir, lake_factory=self._lake_factory,
                                      interval_s=config.shadow_flush_s,
                                      max_records=config.flush_max_records,
                                      retry_max_s=config.flush_retry_max_s) \
            if config.flush else None  # the capture flusher expires shadow_pairs' snapshots
        self._bases = {p: config.base_url(p) for p in PROVIDERS}
        self.client: UpstreamPool | None = None
        self._started = False
        self._initial_pending = 0
        self._initial_pairs = 0
        self._trainer_route: Any = None
        self._register_gauges()

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        self.spool.start()
        self._initial_pending = _sealed_frames(self.spool.dir)
        if self.flusher is not None:
            self.flusher.start()
        self.shadow_spool.start()
        self._initial_pairs = _sealed_frames(self.shadow_spool.dir)
        if self.shadow_flusher is not None:
            self.shadow_flusher.start()
        self.routes.start(self._lake_factory, self.config.routes_poll_s,
                          also=(self.shadows.refresh,))
        self.client = UpstreamPool(timeout_s=self.config.upstream_timeout_s,
                                   connect_timeout_s=self.config.upstream_connect_timeout_s,
                                   max_idle_per_origin=self.config.max_upstream_connections)
        self._started = True

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.shadower.drain()
        await self.shadower.stop()
        if self.client is not None:
            self.client.close()
        self.routes.stop()
        self.spool.stop()  # seals the active segment so the final flush sees it
        self.shadow_spool.stop()
        if self.flusher is not None:
            await asyncio.to_thread(self.flusher.stop)
        if self.shadow_flusher is not None:
            await asyncio.to_thread(self.shadow_flusher.stop)

    def _register_gauges(self) -> None:
        m = self.metrics
        m.gauge("factory_gateway_spool_depth", "Captures spooled and not yet committed.",
                self.spool_depth)
        m.gauge("factory_gateway_spool_bytes", "Bytes in spool segments awaiting the lake.",
                lambda: float(sum(p.stat().st_size for p in pending_files(self.settings.spool))))
        m.gauge("factory_gateway_flush_lag_seconds",
                "Age of the oldest capture not yet committed to the lake.",
                lambda: oldest_pending_age_s(self.settings.spool))
        m.gauge("factory_gateway_captures_committed_total",
                "Captures committed to the lake by this process.",
                lambda: float(self.flusher.num_committed if self.flusher else 0))
        m.gauge("factory_gateway_captures_rejected_total",
                "Committed captures that ingest rejected (see rejected_traces for why).",
                lambda: float(self.flusher.num_rejected if self.flusher else 0))
        m.gauge("factory_gateway_flush_failures_total",
                "Flush attempts that failed, each logged with its traceback (the batch stays "
                "spooled and is retried).",
                lambda: float(self.flusher.num_failures if self.flusher else 0))
        m.gauge("factory_gateway_flush_last_failure_timestamp_seconds",
                "Unix time of the last failed flush attempt (0: none).",
                lambda: float((self.flusher.last_error_at or 0) if self.flusher else 0))
        m.gauge("factory_gateway_flush_last_success_timestamp_seconds",
                "Unix time of the last commit to the lake (0: none yet).",
                lambda: float((self.flusher.last_success_at or 0) if self.flusher else 0))
        m.gauge("factory_gateway_flusher_up",
                "1 while the flusher thread runs; 0 when it stopped on an error (or is off).",
                lambda: float(self.flusher is not None and self.flusher.running))
        shadow = self.shadower
        m.gauge("factory_gateway_shadow_pairs_pending",
                "Shadow pairs spooled and not yet committed to shadow_pairs.",
                self.shadow_depth)
        m.gauge("factory_gateway_shadow_queue_depth",
                "Shadow calls waiting for a candidate (the queue is bounded).",
                lambda: float(shadow.depth))
        m.gauge("factory_gateway_shadow_offered_total",
                "Completed calls chosen for shadowing by their rule's share.",
                lambda: float(shadow.num_offered))
        m.gauge("factory_gateway_shadow_dropped_total",
                "Shadow calls dropped because the shadow queue was full (the client's call "
                "was answered as always).", lambda: float(shadow.num_dropped))
        m.gauge("factory_gateway_shadow_skipped_total",
                "Calls on a shadowed model not shadowed: not OpenAI chat completions, or the "
                "frontier's answer was an error or cut short.",
                lambda: float(shadow.num_skipped))
        m.gauge("factory_gateway_shadow_answered_total",
                "Candidate calls that got an HTTP answer.", lambda: float(shadow.num_sent))
        m.gauge("factory_gateway_shadow_failed_total",
                "Candidate calls that got no answer (refused, timed out, broken); stored as "
                "pairs with the reason.", lambda: float(shadow.num_failed))

    def _trainer_events_route(self) -> Any:
        if self._trainer_route is None:
            # the control plane loads torch (~2 s): built on the first trainer event
            from factory.control.receiver import env_secrets, trainer_events_route

            self._trainer_route = trainer_events_route(self._lake_factory(), env_secrets)
        return self._trainer_route

    def shadow_depth(self) -> float:
        """Shadow pairs spooled and not yet committed."""
        return _pending(self._initial_pairs, self.shadow_spool, self.shadow_flusher)

    def spool_depth(self) -> float:
        return _pending(self._initial_pending, self.spool, self.flusher)

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/healthz":
            await self._healthz(send)
            return
        if path == TRAINER_EVENTS_PATH:
            # Trainer webhooks authenticate with their own HMAC signature, not a factory key.
            await self._trainer_events_route()(scope, receive, send)
            return
        provider, route, model, action = "openai", "", None, ""
        if path == "/v1/chat/completions":
            route = "chat.completions"
        elif path == "/v1/messages":
            provider, route = "anthropic", "messages"
        elif path.startswith(_GEMINI_PREFIX):
            model, _, action = path[len(_GEMINI_PREFIX):].rpartition(":")
            if action in ("generateContent", "streamGenerateContent") and model:
                provider, route = "gemini", action
        elif path in ("/v1/models", "/v1/traces", "/metrics"):
            route = path.rsplit("/", 1)[1]
        if not route:
            await reply(send, 404, error_body(provider, 404, f"no route {method} {path}"))
            return
        expected = "GET" if route in ("models", "metrics") else "POST"
        if method != expected:
            await reply(send, 405, error_body(provider, 405,
                                              f"{path} accepts {expected}, not {method}"))
            return
        headers = dict(scope["headers"])
        denied = self._check_access(scope, headers)
        if denied is not None:
            status, message = denied
            await reply(send, status, error_body(provider, status, message))
            return
        if route == "metrics":
            await reply(send, 200, self.metrics.render(),
                        [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        elif route == "models":
            await self._models(scope, headers, send)
        elif route == "traces":
            await self._traces(scope, headers, receive, send)
        else:
            await self._proxy(scope, headers, receive, send, provider, route, model)

    def _check_access(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        verdict = self.keys.check(headers.get(b"x-factory-key"))
        if verdict is None:
            client = scope.get("client")
            if client is None or client[0] not in _LOOPBACK:
                return 403, ("the gateway has no factory keys yet, so it serves only 127.0.0.1; "
                             "create one with `factory keys create` and send it in X-Factory-Key")
            return None
        if not verdict:
            return 401, "missing or invalid X-Factory-Key"
        return None

    # -- the proxy -------------------------------------------------------------------------------
    async def _proxy(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive,
                     send: Send, provider: str, route: str, model: str | None) -> None:
        started = time.perf_counter()
        try:
            body = await read_body(receive, limit=self.config.max_body_bytes,
                                   declared=headers.get(b"content-length"))
        except BodyTooLarge:
            await self._fail(send, provider, route, started, 413,
                             f"request body over the gateway limit of "
                             f"{self.config.max_body_bytes} bytes")
            return
        except ClientGone:
            return
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            await self._fail(send, provider, route, started, 400,
                             f"request body is not valid JSON: {exc}")
            return
        if not isinstance(request, dict):
            await self._fail(send, provider, route, started, 400,
                             "request body must be a JSON object")
            return
        try:
            project, tags = _metadata(headers)
        except ValueError as exc:
            await self._fail(send, provider, route, started, 400, str(exc))
            return
        query: bytes = scope["query_string"]
        stream_kind: str | None = None
        if provider == "gemini":
            if route == "streamGenerateContent":
                alt = dict(parse_qsl(query.decode("latin-1"))).get("alt") if query else None
                stream_kind = "sse" if alt == "sse" else "json"
        else:
            model = request.get("model") if isinstance(request.get("model"), str) else None
            if request.get("stream") is True:
                stream_kind = "sse"

        path: str = scope["path"]
        upstream_body = body
        base = self._bases[provider]
        target = self.routes.get(model) if model else None
        if target is not None:
            if target.provider != provider:
                await self._fail(send, provider, route, started, 400,
                                 f"model {model!r} is served through the {target.provider} API, "
                                 f"not {provider}'s")
                return
            base = target.base_url
            if target.version:
                tags = {**tags, "route_version": target.version}
            if target.deployment and provider == "gemini":
                path = f"{_GEMINI_PREFIX}{target.deployment}:{route}"
            elif target.deployment or (target.structured_outputs and provider == "openai"):
                sent = {**request, "model": target.deployment or request.get("model")}
                if target.deployment and route == "chat.completions":
                    # A factory deployment gets the conversation as its trainer rendered it:
                    # vLLM renders what it is sent (spaced tool-call arguments are other tokens).
                    sent.update(as_trained(request) or {})
                if target.structured_outputs and provider == "openai" \
                        and "structured_outputs" not in request:
                    # The deployment answers its closed task constrained, as it was evaluated.
                    sent["structured_outputs"] = target.structured_outputs
                upstream_body = orjson.dumps(sent)

        forward = [(k, v) for k, v in headers.items()
                   if k not in _DROP_REQUEST and not k.startswith(b"x-factory-")]
        injected = self.config.api_key(provider)
        if injected:
            forward = [(k, v) for k, v in forward if k not in _AUTH_HEADERS]
            forward.append(_auth_header(provider, injected))
            if query and provider == "gemini":
                query = urlencode([(k, v) for k, v in parse_qsl(query.decode("latin-1"))
                                   if k != "key"]).encode("latin-1")
        forward.append((b"accept-encoding", b"identity"))
        url = _upstream_url(base, path, query)
        shadow = self.shadows.get(model) if model else None

        capture = {"k": "c", "id": str(uuid.uuid4()), "provider": provider,
                   "endpoint": scope["path"], "status": 0, "partial": False,
                   "stream": stream_kind, "at": time.time(), "rl": len(body),
                   "project": project, "tags": tags}
        assert self.client is not None, "gateway used before start()"
        up_started = time.perf_counter()
        try:
            upstream = await self.client.request("POST", url, forward, upstream_body)
        except UpstreamTimeout as exc:
            await self._upstream_failed(send, capture, body, provider, route, started, 504,
                                        str(exc))
            return
        except UpstreamError as exc:
            await self._upstream_failed(send, capture, body, provider, route, started, 502,
                                        str(exc))
            return
        capture["status"] = upstream.status
        encoding = upstream.header(b"content-encoding")
        if encoding and encoding.lower() != b"identity":
            capture["ce"] = encoding.decode("latin-1")  # the flusher decodes it for capture
        out_headers = [(k, v) for k, v in upstream.headers if k not in _DROP_RESPONSE]
        content_type = (upstream.header(b"content-type") or b"").decode("latin-1")
        if stream_kind and upstream.status < 400 and (
                stream_kind == "json" or "event-stream" in content_type):
            await self._relay_stream(upstream, out_headers, capture, body, receive, send,
                                     provider, route, started, up_started)
            if shadow is not None:
                self.shadower.offer(shadow, provider=provider, route=route, request=request,
                                    body=body, frontier=capture.pop("_data", b""),
                                    header=capture)
            return
        if stream_kind and "event-stream" not in content_type:
            capture["stream"] = None  # an error answer to a streaming call is one JSON body
        try:
            data = await upstream.read()
        except UpstreamTimeout:
            await self._upstream_failed(send, capture, body, provider, route, started, 504,
                                        "upstream stopped answering mid-response")
            return
        except UpstreamError as exc:
            await self._upstream_failed(send, capture, body, provider, route, started, 502,
                                        str(exc))
            return
        up_seconds = time.perf_counter() - up_started
        self._spool(capture, body, data)
        out_headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": out_headers})
        await send({"type": "http.response.body", "body": data})
        self.metrics.request(provider, route, upstream.status,
                             time.perf_counter() - started, up_seconds)
        if shadow is not None:
            self.shadower.offer(shadow, provider=provider, route=route, request=request,
                                body=body, frontier=data,
                                header={**capture, "ms": up_seconds * 1000.0})

    async def _relay_stream(self, upstream: UpstreamResponse,
                            out_headers: list[tuple[bytes, bytes]],
                            capture: dict[str, Any], body: bytes, receive: Receive, send: Send,
                            provider: str, route: str, started: float,
                            up_started: float) -> None:
        chunks: list[bytes] = []
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": out_headers})

        async def relay() -> None:
            async for chunk in upstream.chunks():
                chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        relay_task = asyncio.ensure_future(relay())
        watcher = asyncio.ensure_future(receive())  # resolves on http.disconnect
        try:
            await asyncio.wait((relay_task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            client_gone = watcher.done() and not relay_task.done()
            for task in (relay_task, watcher):
                if not task.done():
                    task.cancel()
            await asyncio.gather(relay_task, watcher, return_exceptions=True)
            upstream.release()
        data = b"".join(chunks)
        # A client that hangs up after the last event (the openai SDK closes the response on
        # [DONE]) while the upstream's end of body is still on its way has the whole answer:
        # only a hang-up before the stream's end marker cuts the capture short.
        if client_gone and not stream_complete(capture["stream"], data):
            capture["partial"] = True
            capture["error"] = "client disconnected mid-stream"
        elif not client_gone and relay_task.exception() is not None:
            exc = relay_task.exception()
            capture["partial"] = True
            capture["error"] = f"upstream stream failed: {type(exc).__name__}"
        up_seconds = time.perf_counter() - up_started
        self._spool(capture, body, data)
        capture["ms"] = up_seconds * 1000.0
        capture["_data"] = data  # the relayed answer, for a shadow call after this returns
        if not client_gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.metrics.request(provider, route, upstream.status,
                             time.perf_counter() - started, up_seconds)

    def _spool(self, header: dict[str, Any], request: bytes, response: bytes) -> None:
        try:
            self.spool.append(encode(header, request, response))
            self.metrics.captures_spooled += 1
        except OSError as exc:
            self.metrics.captures_dropped += 1
            log.error("capture %s dropped: the spool refused it: %s", header.get("id"), exc)

    def _spool_shadow(self, header: dict[str, Any], request: bytes, response: bytes) -> None:
        try:
            self.shadow_spool.append(encode(header, request, response))
        except OSError as exc:
            self.shadower.num_dropped += 1
            log.error("shadow pair %s dropped: the spool refused it: %s", header.get("id"), exc)

    async def _upstream_failed(self, send: Send, capture: dict[str, Any], body: bytes,
                               provider: str, route: str, started: float, status: int,
                               message: str) -> None:
        capture["status"] = status
        capture["stream"] = None
        capture["error"] = message
        answer = error_body(provider, status, message)
        self._spool(capture, body, answer)
        await self._fail(send, provider, route, started, status, message, answer)

    async def _fail(self, send: Send, provider: str, route: str, started: float, status: int,
                    message: str, answer: bytes | None = None) -> None:
        await reply(send, status, answer or error_body(provider, status, message))
        self.metrics.request(provider, route, status, time.perf_counter() - started, None)

    # -- other routes ----------------------------------------------------------------------------
    async def _models(self, scope: Scope, headers: dict[bytes, bytes], send: Send) -> None:
        started = time.perf_counter()
        forward = [(k, v) for k, v in headers.items()
                   if k not in _DROP_REQUEST and not k.startswith(b"x-factory-")]
        key = self.config.api_key("openai")
        if key:
            forward = [(k, v) for k, v in forward if k not in _AUTH_HEADERS]
            forward.append(_auth_header("openai", key))
        url = _upstream_url(self._bases["openai"], "/v1/models", scope["query_string"])
        assert self.client is not None, "gateway used before start()"
        forward.append((b"accept-encoding", b"identity"))
        try:
            upstream = await self.client.request("GET", url, forward)
            data = await upstream.read()
        except UpstreamTimeout as exc:
            await self._fail(send, "openai", "models", started, 504, str(exc))
            return
        except UpstreamError as exc:
            await self._fail(send, "openai", "models", started, 502, str(exc))
            return
        out = [(k, v) for k, v in upstream.headers if k not in _DROP_RESPONSE]
        out.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": upstream.status,
                    "headers": out})
        await send({"type": "http.response.body", "body": data})
        self.metrics.request("openai", "models", upstream.status,
                             time.perf_counter() - started, None)

    async def _traces(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive,
                      send: Send) -> None:
        started = time.perf_counter()
        try:
            body = await read_body(receive, limit=self.config.max_body_bytes,
                                   declared=headers.get(b"content-length"))
        except BodyTooLarge:
            await self._fail(send, "otel", "traces", started, 413,
                             f"OTLP body over the limit of {self.config.max_body_bytes} bytes")
            return
        except ClientGone:
            return
        content_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0]
        content_type = content_type.strip().lower()
        if content_type not in ("application/json", "application/x-protobuf"):
            await self._fail(send, "otel", "traces", started, 415,
                             "OTLP/HTTP needs Content-Type application/x-protobuf or "
                             f"application/json, got {content_type or 'none'!r}")
            return
        encoding = headers.get(b"content-encoding")
        try:
            project, tags = _metadata(headers)

            records = split_otlp(body, content_type,
                                 encoding.decode("latin-1") if encoding else None)
        except (ValueError, OSError, EOFError) as exc:
            await self._fail(send, "otel", "traces", started, 400, f"bad OTLP payload: {exc}")
            return
        except Exception as exc:  # protobuf's DecodeError has no common base with ValueError
            if type(exc).__name__ != "DecodeError":
                raise
            await self._fail(send, "otel", "traces", started, 400, f"bad OTLP protobuf: {exc}")
            return
        now = time.time()
        for record in records:
            header = {"k": "otel", "at": now, "project": project, "tags": tags}
            self._spool(header, b"", orjson.dumps(record))
        answer = b"{}" if content_type == "application/json" else b""
        await reply(send, 200, answer, [(b"content-type", content_type.encode())])
        self.metrics.request("otel", "traces", 200, time.perf_counter() - started, None)

    async def _healthz(self, send: Send) -> None:
        flusher = self.flusher
        body = {"status": "ok", "spool_depth": int(self.spool_depth()),
                "shadow_pairs_pending": int(self.shadow_depth()),
                "lake": ("unknown" if flusher is None or flusher.last_success_at is None
                         and flusher.last_error is None
                         else "error" if flusher.last_error else "ok")}
        if flusher is not None and flusher.last_error:
            body["lake_error"] = flusher.last_error
        if flusher is not None and self._started and not flusher.running:
            body["flusher"] = "stopped"
        await reply(send, 200, orjson.dumps(body))


def _auth_header(provider: str, key: str) -> tuple[bytes, bytes]:
    if provider == "anthropic":
        return b"x-api-key", key.encode()
    if provider == "gemini":
        return b"x-goog-api-key", key.encode()
    return b"authorization", b"Bearer " + key.encode()


def _metadata(headers: dict[bytes, bytes]) -> tuple[str | None, dict[str, str]]:
    raw_project = headers.get(b"x-factory-project")
    raw_tags = headers.get(b"x-factory-tags")
    project = raw_project.decode("utf-8", errors="replace").strip() or None \
        if raw_project else None
    tags = parse_tags(raw_tags.decode("utf-8", errors="replace")) if raw_tags else {}
    return project, tags


def _sealed_frames(directory: Any) -> int:
    """Records in a spool folder's sealed segments (left by an earlier process)."""
    return sum(_count_frames(p) for p in pending_files(directory) if p.suffix == ".seg")


def _pending(initial: int, spool: SpoolWriter, flusher: Flusher | None) -> float:
    """Records of one spool not yet committed: those found at start plus those written since,
    less what its flusher committed (captures and shadow pairs)."""
    done = flusher.num_committed + flusher.num_pairs if flusher else 0
    return float(max(0, initial + spool.num_written - done))


def _count_frames(path: Any) -> int:
    """Records in a segment, walking frame headers only."""
    import struct

    num = 0
    with open(path, "rb") as f:
        while True:
            head = f.read(12)
            if len(head) < 12:
                return num
            magic, length, _ = struct.unpack("<4sII", head)
            if magic != b"FSP1":
                return num
            f.seek(length, 1)
            num += 1
