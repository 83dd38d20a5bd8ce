"""The suite's one way to wait: poll a condition until it holds, never sleep and hope.

A test that needs something to have happened (a server listening, a capture committed, a
trainer at step 3) asks for that event with ``wait_until``; the timeout only bounds a failure,
so a slow machine makes a test slower, never red.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The first polls come quickly (most events are milliseconds away), later ones back off so a
# long wait (a server start, a training run) does not spin a core: 5 ms doubling to 200 ms.
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.2


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "") -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    Fails with an ``AssertionError`` naming ``what`` (or the predicate) and the last value it
    returned once ``timeout_s`` has passed. An exception from ``predicate`` propagates at once:
    a predicate that sees the event can never come (the process died) raises to say why.
    """
    deadline = time.monotonic() + timeout_s
    pause = FIRST_POLL_S
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            name = what or getattr(predicate, "__qualname__", repr(predicate))
            raise AssertionError(f"timed out after {timeout_s} s waiting for {name} "
                                 f"(last value: {value!r})")
        time.sleep(min(pause, left))
        pause = min(pause * 2, MAX_POLL_S)
