"""Signed trainer events: signing, verification (used by the gateway's receiver), delivery.

Every event is a JSON object POSTed to the job's ``webhook_url`` with three headers::

    X-Factory-Key-Id:    the job's webhook_key_id (the receiver picks the secret by it)
    X-Factory-Timestamp: unix seconds when this attempt was signed
    X-Factory-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}.".encode() + body)>

``verify`` rejects a missing/unknown key id, a bad signature (constant-time compare), a
timestamp more than ``max_age_s`` from ``now`` (either direction), and a replay of an accepted
(timestamp, signature) within that window. Each retry is signed afresh (a receiver that was down
for ten minutes must not see stale stamps), so a retry after a lost response is a new delivery:
receivers deduplicate stored events by the body's ``event_id``.

Delivery never blocks training: events are appended (and fsynced) to the local events file
first, then a background thread POSTs them in order with exponential backoff.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

KEY_ID_HEADER = "X-Factory-Key-Id"
TIMESTAMP_HEADER = "X-Factory-Timestamp"
SIGNATURE_HEADER = "X-Factory-Signature"
SCHEME = "v1"
DEFAULT_MAX_AGE_S = 300.0
EVENT_TYPES = ("started", "progress", "checkpoint", "finished", "failed", "nan", "preempted")


class WebhookError(ValueError):
    """An event that must be rejected (the receiver answers 401 and logs the reason)."""


class ReplayStore(Protocol):
    """Remembers accepted signatures; ``seen`` records ``key`` and says if it was there."""

    def seen(self, key: str, *, now: float, ttl_s: float) -> bool: ...


class ReplayCache:
    """In-memory ``ReplayStore``: keys expire after the freshness window (stale is rejected
    anyway), so memory is bounded by the event rate times ``max_age_s``."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def seen(self, key: str, *, now: float, ttl_s: float) -> bool:
        with self._lock:
            if len(self._expiry) > 10_000:
                self._expiry = {k: t for k, t in self._expiry.items() if t > now}
            expiry = self._expiry.get(key)
            if expiry is not None and expiry > now:
                return True
            self._expiry[key] = now + ttl_s
            return False


def sign(body: bytes, key_id: str, secret: bytes, timestamp: int | float) -> dict[str, str]:
    """The headers that authenticate ``body`` at ``timestamp``."""
    ts = str(int(timestamp))
    mac = hmac.new(secret, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {KEY_ID_HEADER: key_id, TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"{SCHEME}={mac}"}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        lower = name.lower()
        for k, v in headers.items():
            if k.lower() == lower:
                return v
    return value


def verify(headers: Mapping[str, str], body: bytes, secrets_by_key_id: Mapping[str, bytes], *,
           now: float | None = None, max_age_s: float = DEFAULT_MAX_AGE_S,
           replay_cache: ReplayStore | None = None) -> dict[str, Any]:
    """The event in ``body`` if it is authentic, fresh and new; else raise WebhookError.

    ``replay_cache`` is required in production (without it replays inside the window pass);
    pass one shared ``ReplayCache`` (or a durable ``ReplayStore``) per receiver.
    """
    now = time.time() if now is None else now
    key_id = _header(headers, KEY_ID_HEADER)
    ts = _header(headers, TIMESTAMP_HEADER)
    sig = _header(headers, SIGNATURE_HEADER)
    if not key_id or not ts or not sig:
        raise WebhookError("missing signature headers")
    secret = secrets_by_key_id.get(key_id)
    if secret is None:
        raise WebhookError(f"unknown key id {key_id!r}")
    try:
        stamp = int(ts)
    except ValueError:
        raise WebhookError("timestamp is not an integer") from None
    scheme, _, mac = sig.partition("=")
    if scheme != SCHEME or not mac:
        raise WebhookError("unsupported signature scheme")
    expected = sign(body, key_id, secret, stamp)[SIGNATURE_HEADER].partition("=")[2]
    if not hmac.compare_digest(expected, mac):
        raise WebhookError("bad signature")
    # Checked after the signature, so an attacker learns nothing about the window.
    if abs(now - stamp) > max_age_s:
        raise WebhookError(f"stale timestamp ({now - stamp:.0f} s old, max {max_age_s:.0f})")
    if replay_cache is not None and replay_cache.seen(f"{key_id}:{stamp}:{mac}", now=now,
                                                      ttl_s=2 * max_age_s):
        raise WebhookError("replayed event")
    try:
        event = json.loads(body)
    except json.JSONDecodeError:
        raise WebhookError("body is not JSON") from None
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        raise WebhookError("body is not a trainer event")
    return event


class EventLog:
    """Append-only JSONL of every event, fsynced: nothing is lost if the receiver is down."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, sort_keys=True, allow_nan=False) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event in an events file; a torn last line (SIGKILL mid-write) is skipped."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


Post = Callable[[str, bytes, dict[str, str], float], int]


def _httpx_post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    import httpx

    r = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"},
                   timeout=timeout_s)
    return r.status_code


class WebhookSender:
    """Posts events in order from a background thread, retrying with exponential backoff.

    Network errors, 408, 429 and 5xx are retried (``max_attempts`` in all); other 4xx are
    permanent (a receiver that rejects the signature will keep rejecting it) and dropped; the
    event stays in the events file either way. ``close`` waits up to ``timeout_s`` to drain.
    """

    def __init__(self, url: str, key_id: str, secret: bytes, *, max_attempts: int = 6,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, timeout_s: float = 10.0,
                 post: Post | None = None) -> None:
        self.url, self.key_id, self.secret = url, key_id, secret
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, \
            max_backoff_s
        self.timeout_s = timeout_s
        self._post = post or _httpx_post
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._stop = threading.Event()
        self.num_delivered = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="webhook-sender", daemon=True)
        self._thread.start()

    def send(self, event: dict[str, Any]) -> None:
        self._queue.put(json.dumps(event, sort_keys=True, allow_nan=False).encode())

    def _deliver(self, body: bytes) -> bool:
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            headers = sign(body, self.key_id, self.secret, time.time())
            try:
                status = self._post(self.url, body, headers, self.timeout_s)
            except Exception:  # network errors of any transport are retried alike
                status = 0
            if 200 <= status < 300:
                return True
            if status and status < 500 and status not in (408, 429):
                return False
            if attempt < self.max_attempts and self._stop.wait(delay):
                return False
            delay = min(delay * 2, self.max_backoff_s)
        return False

    def _run(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            if self._deliver(body):
                self.num_delivered += 1
            else:
                self.num_dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(1.0)
