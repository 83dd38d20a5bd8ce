"""Signing and verification: forged, tampered, stale, replayed and unknown-key events fail."""

from __future__ import annotations

import json
import time

import pytest

from factory.trainer.webhooks import (
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ReplayCache,
    WebhookError,
    WebhookSender,
    sign,
    verify,
)

SECRETS = {"k1": b"secret-one", "k2": b"secret-two"}
BODY = json.dumps({"type": "progress", "event_id": "e1", "run_id": "r", "step": 3}).encode()
NOW = 1_800_000_000.0


def test_a_signed_event_verifies_once() -> None:
    headers = sign(BODY, "k1", SECRETS["k1"], NOW)
    assert set(headers) == {KEY_ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER}
    cache = ReplayCache()
    lower = {k.lower(): v for k, v in headers.items()}  # header names are case-insensitive
    assert verify(lower, BODY, SECRETS, now=NOW + 5, replay_cache=cache)["step"] == 3
    with pytest.raises(WebhookError, match="replayed"):
        verify(headers, BODY, SECRETS, now=NOW + 6, replay_cache=cache)


@pytest.mark.parametrize(("case", "reason"), [
    ("wrong-secret", "bad signature"),
    ("tampered-body", "bad signature"),
    ("tampered-timestamp", "bad signature"),
    ("other-key-id", "bad signature"),
    ("unknown-key", "unknown key id"),
    ("stale", "stale"),
    ("future", "stale"),
    ("no-headers", "missing"),
    ("bad-scheme", "scheme"),
])
def test_forged_and_stale_events_are_rejected(case: str, reason: str) -> None:
    body = BODY
    now = NOW + 1
    headers = sign(BODY, "k1", SECRETS["k1"], NOW)
    if case == "wrong-secret":
        headers = sign(BODY, "k1", b"guess", NOW)
    elif case == "tampered-body":
        body = BODY.replace(b'"step": 3', b'"step": 4')
    elif case == "tampered-timestamp":
        headers[TIMESTAMP_HEADER] = str(int(NOW) + 100)
    elif case == "other-key-id":
        headers[KEY_ID_HEADER] = "k2"
    elif case == "unknown-key":
        headers[KEY_ID_HEADER] = "k9"
    elif case == "stale":
        now = NOW + 301
    elif case == "future":
        now = NOW - 301
    elif case == "no-headers":
        headers = {}
    elif case == "bad-scheme":
        headers[SIGNATURE_HEADER] = headers[SIGNATURE_HEADER].replace("v1=", "v0=")
    with pytest.raises(WebhookError, match=reason):
        verify(headers, body, SECRETS, now=now, max_age_s=300, replay_cache=ReplayCache())


def test_sender_retries_transient_failures_and_drops_permanent_ones() -> None:
    calls: list[tuple[int, dict[str, str]]] = []
    statuses = iter([503, 0, 204, 400])

    def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
        status = next(statuses)
        calls.append((status, headers))
        if status == 0:
            raise ConnectionError("receiver down")
        verify(headers, body, {"k1": b"x"}, now=time.time())  # each attempt is signed afresh
        return status

    sender = WebhookSender("http://receiver", "k1", b"x", backoff_s=0.01, post=post)
    sender.send({"type": "started", "event_id": "a"})
    sender.send({"type": "progress", "event_id": "b"})
    sender.close(timeout_s=5)
    assert [c[0] for c in calls] == [503, 0, 204, 400]
    assert sender.num_delivered == 1 and sender.num_dropped == 1
