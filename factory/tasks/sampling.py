"""Drawing helpers the generated tasks share, so two tasks never differ in how they sample."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any


def choice(rng: random.Random, items: tuple[Any, ...]) -> Any:
    """One of ``items`` (``rng.randrange``: the same draw on every Python version)."""
    return items[rng.randrange(len(items))]


def schedule(rng: random.Random, n: int, shares: Mapping[str, float]) -> list[str]:
    """``n`` labels in the exact ``shares`` (largest remainders, ties in declaration order),
    shuffled."""
    exact = {k: n * w for k, w in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    order = list(shares)
    short = n - sum(counts.values())
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], order.index(k)))[:short]:
        counts[k] += 1
    labels = [k for k in shares for _ in range(counts[k])]
    rng.shuffle(labels)
    return labels


def capitalized(text: str) -> str:
    """``text`` with its first letter upper-cased and the rest as it is."""
    return text[:1].upper() + text[1:]


def completion(content: str, *, model: str, index: int, digest: str, prompt_tokens: int,
               completion_tokens: int) -> dict[str, Any]:
    """An OpenAI chat-completion response answering ``content``, as a logged frontier call
    records it: id ``chatcmpl-<digest>``, created ``1_760_000_000 + index`` (a fixed clock, so
    records are a pure function of their inputs), one ``stop`` choice, the usage counts."""
    return {
        "id": f"chatcmpl-{digest}", "object": "chat.completion",
        "created": 1_760_000_000 + index, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
