"""The CPU engine's prefix cache: the same greedy tokens with it and without, a hit counted when
a prompt shares a cached prefix, LRU eviction under its caps, nothing reused across a replaced
adapter, and its counters on the server's ``/metrics``; vLLM is started with its own."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch

from factory.inference import InferenceServer
from factory.inference.engine import (
    MIN_PREFIX_TOKENS,
    Engine,
    GenerationRequest,
    PrefixCache,
    PrefixCacheStats,
)
from factory.tasks.agent_orders import TOOLS, generate_heldout
from tests.inference.conftest import make_adapter

SYSTEM = ("You answer questions about orders of the shop: look an order up before you say "
          "anything about it, and keep answers short. ") * 6
USERS = ["Where is order 1042?", "Cancel my order 77 please.", "hi",
         "What is the refund policy for damaged items shipped abroad?"]


def _request(engine: Engine, model: str, user: str, *, system: str = SYSTEM,
             tools: list[dict[str, object]] | None = None,
             max_tokens: int = 10) -> GenerationRequest:
    text = engine.render(model, [{"role": "system", "content": system},
                                 {"role": "user", "content": user}], tools)
    return GenerationRequest(model=model, prompt_ids=engine.encode(model, text),
                             max_tokens=max_tokens)


def _tokens(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(requests)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[Engine, Engine]:
    """The tiny model with the prefix cache and without."""
    return (Engine(tiny_model_dir, served_model_name="base"),
            Engine(tiny_model_dir, served_model_name="base", prefix_cache_entries=0))


def test_greedy_tokens_are_the_same_with_the_cache(engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    cached.prefix_cache.drop()
    before = cached.prefix_cache.stats().get("base", PrefixCacheStats())
    singles = [_tokens(cached, [_request(cached, "base", u)])[0] for u in USERS]
    assert singles == [_tokens(plain, [_request(plain, "base", u)])[0] for u in USERS]
    after = cached.prefix_cache.stats()["base"]
    # The first prompt is computed in full; each later one reuses the shared system prompt.
    assert after.miss_requests - before.miss_requests == 1
    assert after.hit_requests - before.hit_requests == len(USERS) - 1
    assert after.hits - before.hits >= (len(USERS) - 1) * MIN_PREFIX_TOKENS
    assert plain.prefix_cache.stats() == {} and len(plain.prefix_cache) == 0
    # A batch whose rows all share the cached prefix, of rests of different lengths (padding
    # between the prefix and each rest), gives each row the tokens it gets alone.
    batch = [_request(cached, "base", u) for u in reversed(USERS)]
    assert _tokens(cached, batch) == singles[::-1]
    assert cached.prefix_cache.stats()["base"].hit_requests - after.hit_requests == len(USERS)
    # A repeated prompt reuses all of it but its last token.
    again = _request(cached, "base", USERS[0])
    hits = cached.prefix_cache.stats()["base"].hits
    assert _tokens(cached, [again]) == [singles[0]]
    assert cached.prefix_cache.stats()["base"].hits - hits == len(again.prompt_ids) - 1


def test_rows_that_share_nothing_are_computed_in_full(engines: tuple[Engine, Engine]) -> None:
    cached, plain = engines
    cached.prefix_cache.drop()
    _tokens(cached, [_request(cached, "base", USERS[0])])
    mixed = [_request(cached, "base", USERS[1]),
             _request(cached, "base", USERS[2], system="Say yes or no, nothing else.")]
    misses = cached.prefix_cache.stats()["base"].miss_requests
    assert _tokens(cached, mixed) == _tokens(plain, mixed)
    assert cached.prefix_cache.stats()["base"].miss_requests - misses == 2
    # The batch kept one entry per system prompt.
    assert len(cached.prefix_cache) == 3


def test_a_replaced_adapter_reuses_nothing_of_the_one_before(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    first = make_adapter(tiny_model_dir, tmp_path / "first", seed=1)
    second = make_adapter(tiny_model_dir, tmp_path / "second", seed=2)
    engine = Engine(tiny_model_dir, served_model_name="base")
    plain = Engine(tiny_model_dir, served_model_name="base", prefix_cache_entries=0)
    engine.load_adapter("a", first)
    plain.load_adapter("a", second)
    _tokens(engine, [_request(engine, "a", USERS[0])])
    _tokens(engine, [_request(engine, "base", USERS[0])])
    assert len(engine.prefix_cache) == 2
    engine.unload_adapter("a")
    assert len(engine.prefix_cache) == 1  # the base model's entry stays: its weights did not change
    engine.load_adapter("a", second)
    hits = engine.prefix_cache.stats()["a"].hit_requests
    assert _tokens(engine, [_request(engine, "a", USERS[1])]) == \
        _tokens(plain, [_request(plain, "a", USERS[1])])
    assert engine.prefix_cache.stats()["a"].hit_requests == hits  # computed, not reused
    # The base model still reuses its own, with an adapter loaded.
    assert _tokens(engine, [_request(engine, "base", USERS[1])]) == \
        _tokens(plain, [_request(plain, "base", USERS[1])])
    assert engine.prefix_cache.stats()["base"].hit_requests == 1


def _layers(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of keys and values for ``n`` tokens: 2 x 2 x n x 4 float32 = 64n bytes."""
    return [(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4)) for _ in range(2)]


def _prompt(first: int, n: int = MIN_PREFIX_TOKENS + 8) -> list[int]:
    return [first, *range(100, 100 + n - 1)]


def test_least_recently_used_entries_are_evicted_under_the_caps() -> None:
    cache = PrefixCache(max_entries=2, max_bytes=10**6)
    a, b, c = _prompt(1), _prompt(2), _prompt(3)
    cache.store("m", a, _layers(len(a)))
    cache.store("m", b, _layers(len(b)))
    assert cache.match("m", [a + [7]])[1] == len(a)  # a is now the most recently used
    cache.store("m", c, _layers(len(c)))
    assert len(cache) == 2
    assert cache.match("m", [b + [7]]) == (None, 0)  # b was evicted
    assert cache.match("m", [a + [7]])[1] == len(a) and cache.match("m", [c + [7]])[1] == len(c)
    # Bytes: 64 a token; room for two 40-token prompts, not three; one above the cap not kept.
    small = PrefixCache(max_entries=8, max_bytes=2 * 64 * len(a))
    for p in (a, b, c):
        small.store("m", p, _layers(len(p)))
    assert len(small) == 2 and small.nbytes == 2 * 64 * len(a)
    assert small.match("m", [a + [7]]) == (None, 0)
    big = _prompt(4, n=3 * len(a))
    small.store("m", big, _layers(len(big)))
    assert len(small) == 2 and small.match("m", [big])[0] is None


def test_matching_needs_a_long_enough_prefix_and_keeps_models_apart() -> None:
    cache = PrefixCache(max_entries=4, max_bytes=10**6)
    p = _prompt(1)
    cache.store("m", p, _layers(len(p)))
    short = p[:MIN_PREFIX_TOKENS - 1] + [9, 9]
    assert cache.match("m", [short]) == (None, 0)
    assert cache.match("other", [p + [7]]) == (None, 0)
    entry, k = cache.match("m", [p[:MIN_PREFIX_TOKENS] + [9], p + [7]])
    assert entry is not None and k == MIN_PREFIX_TOKENS  # what every row shares
    assert cache.match("m", [p])[1] == len(p) - 1  # the last token is always computed
    longer = p + [5, 6]
    cache.store("m", longer, _layers(len(longer)))
    assert len(cache) == 1  # the longer prompt holds everything the shorter one did
    stats = cache.stats()
    assert stats["m"].hit_requests == 3 and stats["m"].miss_requests == 1
    assert stats["other"].miss_requests == 1
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        PrefixCache(max_entries=1, max_bytes=-1)


@pytest.mark.slow
def test_smollm2_agent_prompts_give_the_same_tokens(smollm2_dir: Path) -> None:
    """Real weights, the agent task's ~600-token system prompt and tools block."""
    engine = Engine(smollm2_dir, served_model_name="base")
    plain = Engine(smollm2_dir, served_model_name="base", prefix_cache_entries=0)
    users = [r["messages"][-1]["content"] for r in generate_heldout(3, seed=7)]
    system = generate_heldout(1, seed=7)[0]["messages"][0]["content"]

    def ask(e: Engine, batch: list[str]) -> list[list[int]]:
        return _tokens(e, [_request(e, "base", u, system=system, tools=TOOLS, max_tokens=24)
                           for u in batch])

    singles = [ask(engine, [u])[0] for u in users]
    assert engine.prefix_cache.stats()["base"].hit_requests == len(users) - 1
    assert engine.prefix_cache.stats()["base"].hits >= 500 * (len(users) - 1)
    assert singles == [ask(plain, [u])[0] for u in users]
    assert ask(engine, users) == ask(plain, users)


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_server_reports_hits_and_resets(cpu_server: InferenceServer) -> None:
    url = cpu_server.url
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]

    def ask() -> None:
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "base", "messages": messages, "max_tokens": 2})
        r.raise_for_status()

    def metric(name: str, **labels: str) -> float:
        r = httpx.get(url + "/metrics", timeout=30)
        r.raise_for_status()
        return _metric(r.text, name, **labels)

    assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200
    assert metric("factory:prefix_cache_entries") == 0
    hits = metric("factory:prefix_cache_requests_total", model_name="base", result="hit")
    misses = metric("factory:prefix_cache_requests_total", model_name="base", result="miss")
    tokens = metric("vllm:prefix_cache_hits_total", model_name="base")
    ask()
    ask()
    assert metric("factory:prefix_cache_requests_total", model_name="base",
                  result="miss") == misses + 1
    assert metric("factory:prefix_cache_requests_total", model_name="base",
                  result="hit") == hits + 1
    assert metric("vllm:prefix_cache_hits_total", model_name="base") > tokens
    assert metric("factory:prefix_cache_entries") == 1
    assert metric("factory:prefix_cache_bytes") > 0
    httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
    assert metric("factory:prefix_cache_entries") == 0
    ask()
    assert metric("factory:prefix_cache_requests_total", model_name="base",
                  result="miss") == misses + 2


def test_vllm_is_started_with_prefix_caching(factory_home: Path) -> None:
    cmd = InferenceServer("/models/smollm2", backend="vllm", port=8123).command()
    assert "--enable-prefix-caching" in cmd
