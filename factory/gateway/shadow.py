"""Shadow mode: a candidate deployment answers a share of a route's live calls in the background.

The client is answered by the frontier upstream exactly as without shadowing. Once its response
is complete, the call is offered to a bounded in-memory queue (``Shadower.offer``, O(1), never
awaits); a few background tasks on the gateway's event loop send the same request to the
candidate (non-streamed, ``model`` rewritten to the candidate's name) through their own
connection pool and timeout, and spool the pair as one ``shadow`` frame: the request, the
frontier's response bytes and the candidate's. The flusher turns shadow frames into
``shadow_pairs`` rows (``pair_rows``); they never become captures, so a candidate's answer can
never become a training target. A full queue drops the shadow call (``/metrics``), never the
client's.

Shadowing applies to OpenAI chat-completions calls (the API the factory's inference servers
speak); a rule on a model called through another provider's API is counted as skipped.

Rules live in the lake table ``shadows`` (append-only, the latest row per route wins,
``active = false`` ends shadowing), re-read by the gateway with its routing table.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from factory.gateway.captures import capture_payload, capture_raw_trace_id
from factory.gateway.upstream import UpstreamError, UpstreamPool
from factory.lake import Lake, Lineage
from factory.normalize import normalize_record

if TYPE_CHECKING:
    from factory.gateway.spool import SpoolEntry
    from factory.lake import Lake, Lineage

log = logging.getLogger("factory.gateway")

SHADOW_KIND = "shadow"
"""The spool frame kind of a shadow pair (``k`` in the frame header)."""


@dataclass(frozen=True, kw_only=True)
class ShadowRule:
    """A candidate deployment shadowing the calls clients send for one model name."""

    route: str
    """The model name clients send (e.g. ``gpt-4o-mini``)."""
    experiment: str
    """The experiment whose deployment is the candidate."""
    version: str
    """The candidate's deployment version."""
    base_url: str
    """The candidate server's OpenAI base URL (``http://host:port/v1``)."""
    deployment: str
    """The model name the candidate server knows (the adapter's name)."""
    share: float = 1.0
    """Share of the route's calls sent to the candidate as well, 0 < share <= 1."""

    def __post_init__(self) -> None:
        if not self.route:
            raise ValueError("a shadow rule needs the route (model name) it shadows")
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"shadow share must be in (0, 1], got {self.share}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"shadow base_url must start with http:// or https://, "
                             f"got {self.base_url!r}")

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        return (base[:-3] if base.endswith("/v1") else base) + "/v1/chat/completions"


def register_shadow(rule: ShadowRule, *, lake: Lake | None = None,
                    lineage: Lineage | None = None) -> None:
    """Start (or replace) shadowing of ``rule.route``; gateways pick it up with their routes."""
    (lake or Lake()).append("shadows", [_row(rule, active=True)], lineage=lineage)


def end_shadow(route: str, *, lake: Lake | None = None, lineage: Lineage | None = None) -> None:
    """Stop shadowing ``route``."""
    lake = lake or Lake()
    current = load_shadows(lake)
    if route not in current:
        raise ValueError(f"no shadow rule for model {route!r}")
    lake.append("shadows", [_row(current[route], active=False)], lineage=lineage)


def load_shadows(lake: Lake) -> dict[str, ShadowRule]:
    """The current rules: the latest row per route, without ended ones."""
    if not lake.exists("shadows"):
        return {}
    rows = lake.read("shadows").to_pylist()
    rows.sort(key=lambda r: r["registered_at"])
    rules: dict[str, ShadowRule] = {}
    for row in rows:
        if row["active"]:
            rules[row["route"]] = ShadowRule(
                route=row["route"], experiment=row["experiment"], version=row["version"],
                base_url=row["base_url"], deployment=row["deployment"], share=row["share"])
        else:
            rules.pop(row["route"], None)
    return rules


def _row(rule: ShadowRule, *, active: bool) -> dict[str, object]:
    return {"route": rule.route, "experiment": rule.experiment, "version": rule.version,
            "base_url": rule.base_url, "deployment": rule.deployment, "share": rule.share,
            "active": active, "registered_at": datetime.now(UTC)}


class ShadowTable:
    """The gateway's in-memory view of ``shadows``, re-read when its snapshot changes."""

    def __init__(self, static: dict[str, ShadowRule] | None = None) -> None:
        self._static = dict(static or {})
        self._rules: dict[str, ShadowRule] = dict(self._static)
        self._snapshot: int | None = None

    def get(self, route: str) -> ShadowRule | None:
        return self._rules.get(route)

    def refresh(self, lake: Lake) -> bool:
        snap = lake.snapshot_id("shadows")  # None while the table does not exist
        if snap == self._snapshot:
            return False
        self._rules = {**load_shadows(lake), **self._static}
        self._snapshot = snap
        return True


@dataclass(kw_only=True)
class _Job:
    rule: ShadowRule
    request: dict[str, Any]
    body: bytes
    frontier: bytes
    header: dict[str, Any]


class Shadower:
    """The bounded queue and the background tasks that call candidates."""

    def __init__(self, spool: Callable[[dict[str, Any], bytes, bytes], None], *,
                 queue_size: int = 256, concurrency: int = 4, timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0) -> None:
        self._spool = spool
        self.queue_size = queue_size
        self.concurrency = concurrency
        self._pool = UpstreamPool(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                  max_idle_per_origin=concurrency)
        self._queue: asyncio.Queue[_Job] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self.num_offered = 0
        """Calls chosen for shadowing (by the rule's share)."""
        self.num_dropped = 0
        """Of those, dropped because the queue was full."""
        self.num_skipped = 0
        """Calls on a shadowed route that cannot be shadowed (not OpenAI chat, or failed)."""
        self.num_sent = 0
        """Candidate calls that got an HTTP answer."""
        self.num_failed = 0
        """Candidate calls that got no answer (refused, timed out, broken)."""

    @property
    def depth(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    def offer(self, rule: ShadowRule, *, provider: str, route: str, request: dict[str, Any],
              body: bytes, frontier: bytes, header: dict[str, Any]) -> bool:
        """Queue the candidate's call for a completed frontier call; False when not queued.

        Called on the event loop after the client's response is sent; never waits.
        """
        if rule.share < 1.0 and random.random() >= rule.share:
            return False
        if provider != "openai" or route != "chat.completions" or header.get("partial") \
                or not 200 <= int(header.get("status") or 0) < 300:
            self.num_skipped += 1
            return False
        self.num_offered += 1
        if self._queue is None:
            self._queue = asyncio.Queue(maxsize=self.queue_size)
            self._workers = [asyncio.ensure_future(self._work())
                             for _ in range(self.concurrency)]
        try:
            self._queue.put_nowait(_Job(rule=rule, request=request, body=body,
                                        frontier=frontier, header=header))
        except asyncio.QueueFull:
            self.num_dropped += 1
            return False
        return True

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = await self._queue.get()
            try:
                await self._call(job)
            except Exception:  # a bug here must never reach the client path: logged, counted
                self.num_failed += 1
                log.exception("shadow call to %s failed unexpectedly", job.rule.url)
            finally:
                self._queue.task_done()

    async def _call(self, job: _Job) -> None:
        rule = job.rule
        request = {k: v for k, v in job.request.items() if k not in ("stream", "stream_options")}
        request["model"] = rule.deployment
        payload = orjson.dumps(request)
        started = time.perf_counter()
        status, answer, error = 0, b"", None
        try:
            response = await self._pool.request(
                "POST", rule.url, [(b"content-type", b"application/json"),
                                   (b"accept-encoding", b"identity")], payload)
            answer = await response.read()
            status = response.status
            self.num_sent += 1
        except UpstreamError as exc:
            error = f"candidate gave no answer: {exc}"
            self.num_failed += 1
        latency_ms = (time.perf_counter() - started) * 1000.0
        h = job.header
        header = {"k": SHADOW_KIND, "id": str(uuid.uuid4()), "capture_id": h["id"],
                  "at": time.time(), "project": h.get("project"), "tags": h.get("tags") or {},
                  "route": rule.route, "experiment": rule.experiment, "version": rule.version,
                  "deployment": rule.deployment, "rl": len(job.body), "fl": len(job.frontier),
                  "stream": h.get("stream"), "ce": h.get("ce"), "fs": h.get("status"),
                  "fms": h.get("ms"), "cs": status, "cms": latency_ms}
        if error:
            header["error"] = error
        self._spool(header, job.body, job.frontier + answer)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for queued shadow calls to finish; used before stopping."""
        if self._queue is not None and self._queue.qsize() + len(self._workers):
            try:
                async with asyncio.timeout(timeout_s):
                    await self._queue.join()
            except TimeoutError:
                pass

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        self._queue = None
        self._pool.close()


# -- the flusher's side: shadow frames -> shadow_pairs rows ---------------------------------------


def _final_message(provider_payload: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                               dict[str, int], str | None]:
    """The canonical assistant message a chat-completions capture ends with, its token usage,
    and why there is none (a garbage or error answer)."""
    usage: dict[str, int] = {}
    response = provider_payload.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        usage = {k: int(v) for k, v in response["usage"].items()
                 if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int)}
    try:
        samples = normalize_record(provider_payload)
    except Exception as exc:  # the normalizers' own errors name the field and what was wrong
        return None, usage, f"unusable answer: {str(exc).splitlines()[0][:300]}"
    for sample in samples[-1:]:
        messages = sample.get("messages") if isinstance(sample, dict) else None
        if messages and messages[-1].get("role") == "assistant":
            return messages[-1], usage, None
    return None, usage, "unusable answer: no assistant message"


def pair_rows(entries: list[SpoolEntry]) -> list[dict[str, Any]]:
    """``shadow_pairs`` rows from shadow frames (ids are the frames' own, so a batch replayed
    after a crash between commit and delete is recognized)."""
    rows = []
    for entry in entries:
        h = entry.header
        req_len, front_len = h["rl"], h["fl"]
        request_bytes = entry.body[:req_len]
        frontier_entry = type(entry)(header={**h, "id": h["capture_id"], "provider": "openai",
                                             "endpoint": "/v1/chat/completions",
                                             "status": h.get("fs") or 0, "partial": False},
                                     body=entry.body[:req_len + front_len])
        frontier, f_usage, _ = _final_message(capture_payload(frontier_entry))
        candidate_bytes = entry.body[req_len + front_len:]
        candidate: dict[str, Any] | None = None
        c_usage: dict[str, int] = {}
        error = h.get("error")
        if error is None:
            try:
                response = orjson.loads(candidate_bytes) if candidate_bytes else None
            except orjson.JSONDecodeError:
                response = None
            if not 200 <= int(h.get("cs") or 0) < 300:
                error = f"candidate answered HTTP {h.get('cs')}: " \
                        f"{candidate_bytes[:300].decode('utf-8', errors='replace')}"
            elif not isinstance(response, dict):
                error = "candidate's answer is not JSON: " \
                        f"{candidate_bytes[:300].decode('utf-8', errors='replace')}"
            else:
                candidate, c_usage, error = _final_message({
                    "capture_id": h["id"], "provider": "openai",
                    "endpoint": "/v1/chat/completions",
                    "request": orjson.loads(request_bytes), "response": response,
                    "status": h.get("cs"), "partial": False})
        rows.append({
            "pair_id": h["id"], "raw_trace_id": capture_raw_trace_id(h["capture_id"]),
            "experiment": h["experiment"], "version": h["version"], "route": h["route"],
            "candidate_model": h["deployment"], "project": h.get("project"),
            "request": request_bytes.decode("utf-8", errors="replace"),
            "frontier_message": _dumps(frontier), "candidate_message": _dumps(candidate),
            "frontier_status": int(h.get("fs") or 0), "candidate_status": int(h.get("cs") or 0),
            "candidate_error": error,
            "frontier_latency_ms": h.get("fms"), "candidate_latency_ms": h.get("cms"),
            "frontier_prompt_tokens": f_usage.get("prompt_tokens"),
            "frontier_completion_tokens": f_usage.get("completion_tokens"),
            "candidate_prompt_tokens": c_usage.get("prompt_tokens"),
            "candidate_completion_tokens": c_usage.get("completion_tokens"),
            "created_at": datetime.fromtimestamp(h["at"], tz=UTC)})
    return rows


def _dumps(message: dict[str, Any] | None) -> str | None:
    return None if message is None else orjson.dumps(message).decode()


def commit_pairs(lake: Lake, entries: list[SpoolEntry], *, check_existing: bool = True) -> int:
    """Append the pairs of ``entries`` not yet in ``shadow_pairs``; returns how many.

    ``check_existing`` False skips looking for them in the table: the flusher knows a batch
    cannot be a replay when every segment of it was created after it took the flush lock."""
    rows = pair_rows(entries)
    if check_existing and lake.exists("shadow_pairs") and rows:
        low = min(r["created_at"] for r in rows).isoformat()
        high = max(r["created_at"] for r in rows).isoformat()
        seen = set(lake.read("shadow_pairs", columns=["pair_id"],
                             row_filter=f"created_at >= '{low}' and created_at <= '{high}'")
                   .column("pair_id").to_pylist())
        rows = [r for r in rows if r["pair_id"] not in seen]
    if rows:
        lake.append("shadow_pairs", rows,
                    lineage=Lineage(run_id="gateway", asset_key="shadow_pairs"))
    return len(rows)
