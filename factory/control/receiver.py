"""The trainer-event receiver: ``POST /v1/trainer/events`` as a Starlette route.

Each request carries one signed event (``factory.trainer.webhooks``). The route verifies it with the
trainer's own ``verify`` (forged, stale and replayed events get 401 and a log line with the
reason and the client), then stores it in ``training_events``; a ``checkpoint`` event also
becomes a verified row of ``checkpoints``, which the checkpoint sensor turns into evals. The
event is acknowledged only after the lake commit, so a 2xx means stored; a storage failure
answers 503 and the trainer retries. The optional ``?segment=`` query names the control plane's
segment (it is in the URL the control plane gave that trainer). A retry after a lost response
is a new signature over the same body: duplicates are dropped by ``event_id``. The commits
carry lineage (``store_events``): a checkpoint leads back to the run, its plan and its data.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from factory.control.plane import event_row, store_events
from factory.lake import Lake
from factory.trainer.webhooks import (
    DEFAULT_MAX_AGE_S,
    KEY_ID_HEADER,
    ReplayCache,
    ReplayStore,
    WebhookError,
    verify,
)

log = logging.getLogger("factory.control.receiver")
PATH = "/v1/trainer/events"
MAX_BODY_BYTES = 1 << 20


def env_secrets() -> dict[str, bytes]:
    """Key id -> secret from ``$FACTORY_WEBHOOK_KEY_ID`` (default ``trainer``) and
    ``$FACTORY_WEBHOOK_SECRET``; empty (every event rejected) when no secret is set."""
    secret = os.environ.get("FACTORY_WEBHOOK_SECRET")
    if not secret:
        return {}
    return {os.environ.get("FACTORY_WEBHOOK_KEY_ID") or "trainer": secret.encode()}


def trainer_events_route(lake: Lake,
                         secrets: Mapping[str, bytes] | Callable[[], Mapping[str, bytes]], *,
                         max_age_s: float = DEFAULT_MAX_AGE_S,
                         replay_cache: ReplayStore | None = None,
                         path: str = PATH) -> Route:
    """The route to mount in the gateway. ``secrets``: key id -> secret (or a callable giving
    the current mapping, so keys can rotate without a restart)."""
    cache = replay_cache if replay_cache is not None else ReplayCache()
    stored: OrderedDict[str, None] = OrderedDict()

    async def receive(request: Request) -> JSONResponse:
        client = request.client.host if request.client else "?"
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            log.warning("rejected trainer event from %s: body of %d bytes", client, len(body))
            return JSONResponse({"error": "body too large"}, status_code=413)
        current = secrets() if callable(secrets) else secrets
        try:
            event = verify(request.headers, body, current, max_age_s=max_age_s,
                           replay_cache=cache)
        except WebhookError as e:
            log.warning("rejected trainer event from %s (key id %r): %s", client,
                        request.headers.get(KEY_ID_HEADER), e)
            return JSONResponse({"error": f"unauthorized: {e}"}, status_code=401)
        event_id = str(event.get("event_id", ""))
        if event_id and event_id in stored:
            return JSONResponse({"stored": False, "duplicate": True})
        row = event_row(event, segment_id=request.query_params.get("segment"),
                        source="webhook", received_at=datetime.now(UTC),
                        key_id=request.headers.get(KEY_ID_HEADER))
        try:
            await run_in_threadpool(store_events, lake, [row])
        except Exception:
            log.exception("could not store trainer event %s", event_id)
            return JSONResponse({"error": "storage unavailable"}, status_code=503)
        if event_id:
            stored[event_id] = None
            while len(stored) > 50_000:
                stored.popitem(last=False)
        return JSONResponse({"stored": True, "event_id": event_id})

    return Route(path, receive, methods=["POST"], name="trainer_events")
