"""Prompt lookup decoding in the CPU engine: a greedy request served alone checks drafted tokens
(from the model's recent completions, else from its own text) several a forward pass and
answers the tokens one-a-pass decoding gives, through constraints, log-probs, stop strings and
budgets; sampled requests and batches decode one token a pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.inference import InferenceServer
from factory.inference import engine as engine_module
from factory.inference.constrain import ChoiceConstraint
from factory.inference.engine import (
    RECENT_LOOKUP_TOKENS,
    Engine,
    GenerationRequest,
    LookupStats,
    _lookup,
    _recent_lookup,
)
from factory.tasks.agent_orders import TOOLS, generate_heldout
from tests.inference.conftest import train_adapter
from tests.inference.test_prefix_cache import _metric
from tests.inference.test_vllm_gate import _tool_sample

SYSTEM = ("You answer questions about orders of the shop: look an order up before you say "
          "anything about it, and keep answers short. ") * 4


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_last_tokens() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # the last 3 tokens (1 5 6) occur nowhere earlier; the last 2 (5 6) at 5-6, latest first
    assert _lookup(history, 4) == [7, 1, 5, 6]
    assert _lookup(history, 2) == [7, 1]
    # a copy that reaches the end goes on from its own start: 7 1 5 6, then 7 1 again
    assert _lookup(history, 6) == [7, 1, 5, 6, 7, 1]
    assert _lookup([1, 2, 3, 9], 4) == []  # 9 never came before
    assert _lookup([4, 4], 3) == [4, 4, 4]
    assert _lookup([1, 2, 1], 0) == []
    assert _lookup([7], 5) == []


def test_recent_completions_draft_what_followed_the_answer_s_last_tokens() -> None:
    older, newer = [1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8]
    # the newest completion holding the last two tokens (2 3) drafts what followed them there
    assert _recent_lookup([5, 2, 3], [older, newer], 4) == [7, 8]
    # a longer run of last tokens held by a completion, at its first occurrence there
    assert _recent_lookup([1, 2, 3], [older], 2) == [4, 5]
    assert _recent_lookup([8, 1, 2], [[1, 2, 7, 8, 1, 2, 9]], 3) == [9]  # 8 1 2: the longer
    assert _recent_lookup([0, 1, 2], [[1, 2, 7, 8, 1, 2, 9]], 3) == [7, 8, 1]  # the first
    assert _recent_lookup([4, 5], [older, newer], 8) == [6]  # only the older one holds 4 5
    assert _recent_lookup([0, 3], [older, newer], 4) == []  # one token alone (3) drafts nothing
    assert _recent_lookup([2, 3], [older, newer], 0) == []
    assert _recent_lookup([3], [older], 4) == [] and _recent_lookup([2, 3], [], 4) == []
    assert _recent_lookup([5, 6], [older], 4) == []  # nothing followed it


class _Passes:
    """Counts the forward passes of an engine's model."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.calls = engine, 0
        self._forward = engine.model.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._forward(*args, **kwargs)

        engine.model.forward = counted

    def close(self) -> None:
        self.engine.model.forward = self._forward


def _request(engine: Engine, model: str, user: str, *, system: str = SYSTEM,
             tools: list[dict[str, Any]] | None = None, **kw: Any) -> GenerationRequest:
    text = engine.render(model, [{"role": "system", "content": system},
                                 {"role": "user", "content": user}], tools)
    kw.setdefault("max_tokens", 24)
    return GenerationRequest(model=model, prompt_ids=engine.encode(model, text), **kw)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Engine, Engine]:
    """The tiny model drafting 8 tokens a pass, and one token a pass."""
    return (Engine(tiny_model_dir, served_model_name="base", prompt_lookup_tokens=8),
            Engine(tiny_model_dir, served_model_name="base", prompt_lookup_tokens=0))


def test_the_tiny_model_answers_the_same_with_fewer_passes(tiny: tuple[Engine, Engine]) -> None:
    lookup, plain = tiny
    users = ["Where is order 1042?", "Cancel my order 77 please.", "hi", "order order order"]
    before = replace(lookup.lookup_stats)
    counter = _Passes(lookup)
    try:
        for user in users:
            got = lookup.generate([_request(lookup, "base", user, max_tokens=40,
                                            top_logprobs=2)])[0]
            want = plain.generate([_request(plain, "base", user, max_tokens=40,
                                            top_logprobs=2)])[0]
            assert got.token_ids == want.token_ids and got.text == want.text
            assert got.finish_reason == want.finish_reason
            assert got.logprobs is not None and want.logprobs is not None
            assert [lp.token_id for lp in got.logprobs] == want.token_ids
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-4)
        generated = sum(len(plain.generate([_request(plain, "base", u, max_tokens=40)])[0]
                            .token_ids) for u in users)
    finally:
        counter.close()
    # a random model repeats itself, and what it repeats is drafted: the prompt's pass gives a
    # request's first token, each later pass one more than the drafted tokens it took
    accepted = lookup.lookup_stats.accepted_tokens - before.accepted_tokens
    assert accepted > 0
    assert counter.calls == generated - accepted
    assert plain.lookup_stats == LookupStats()


def test_drafts_cut_short_leave_the_answer_as_it_was(tiny: tuple[Engine, Engine],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts whose first two tokens are right and the rest wrong (an oracle reading the
    one-a-pass answer): each pass takes two, replaces the third, and drops the keys and values
    of the rest; the answer is the same token for token."""
    lookup, plain = tiny
    user = "Where is order 1042?"
    want = plain.generate([_request(plain, "base", user, max_tokens=30)])[0].token_ids
    prompt = _request(lookup, "base", user).prompt_ids
    wrong = next(t for t in range(5, 100) if t not in want)

    def oracle(history: list[int], most: int, longest: int = 3) -> list[int]:
        done = len(history) - len(prompt)
        return [*want[done:done + 2], wrong, wrong][:most]

    monkeypatch.setattr(engine_module, "_lookup", oracle)
    monkeypatch.setattr(engine_module, "_recent_lookup", lambda *_: [])
    before = replace(lookup.lookup_stats)
    counter = _Passes(lookup)
    try:
        got = lookup.generate([_request(lookup, "base", user, max_tokens=30)])[0].token_ids
    finally:
        counter.close()
    assert got == want
    stats = lookup.lookup_stats
    passes = stats.drafts - before.drafts
    assert passes >= 5
    # every pass but the last (whose draft the budget shortens) took 2 of its 4
    assert stats.accepted_tokens - before.accepted_tokens >= 2 * passes - 1
    assert stats.draft_tokens - before.draft_tokens > 4 * (passes - 1)
    assert counter.calls == 1 + -(-(len(want) - 1) // 3)  # the prompt, then three a pass


def test_stops_budgets_constraints_and_streams_are_kept(tiny: tuple[Engine, Engine]) -> None:
    lookup, plain = tiny

    def both(**kw: Any) -> tuple[Any, Any, list[str], list[str]]:
        streams: tuple[list[str], list[str]] = ([], [])
        got = lookup.generate([_request(lookup, "base", "order order order",
                                        on_token=lambda _t, d: streams[0].append(d), **kw)])[0]
        want = plain.generate([_request(plain, "base", "order order order",
                                        on_token=lambda _t, d: streams[1].append(d), **kw)])[0]
        return got, want, *streams

    for budget in (0, 1, 2, 3, 7):
        got, want, s1, s2 = both(max_tokens=budget)
        assert got.token_ids == want.token_ids and len(got.token_ids) == budget
        assert "".join(s1) == got.text == "".join(s2)
    full = plain.generate([_request(plain, "base", "order order order", max_tokens=40)])[0]
    stop = full.text[len(full.text) // 2:][:3]
    got, want, s1, _ = both(max_tokens=40, stop=[stop])
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
    assert "".join(s1) == got.text and stop not in got.text
    choices = ["refund", "shipping", "cancel order"]
    got = lookup.generate([_request(lookup, "base", "order order order", max_tokens=12,
                                    constraint=ChoiceConstraint(choices, lookup.tokenizer_for("base"),
                                                                lookup.stop_token_ids("base")))])[0]
    want = plain.generate([_request(plain, "base", "order order order", max_tokens=12,
                                    constraint=ChoiceConstraint(choices, plain.tokenizer_for("base"),
                                                                plain.stop_token_ids("base")))])[0]
    assert got.token_ids == want.token_ids and got.text in choices


def test_an_answer_given_before_is_drafted_from_it_until_the_model_is_reloaded(
        tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The same request again: its first answer drafts RECENT_LOOKUP_TOKENS a pass, every one
    taken; the same tokens. Loading another adapter under the name forgets its completions."""
    lookup = Engine(tiny_model_dir, served_model_name="base", prompt_lookup_tokens=3)
    first = lookup.generate([_request(lookup, "base", "Where is order 1042?",
                                      max_tokens=40)])[0].token_ids
    assert len(first) == 40  # the random model does not stop
    before = replace(lookup.lookup_stats)
    counter = _Passes(lookup)
    try:
        again = lookup.generate([_request(lookup, "base", "Where is order 1042?",
                                          max_tokens=40)])[0].token_ids
    finally:
        counter.close()
    assert again == first
    # the prompt's pass gives the first token; the second token has no run of 2 yet to match,
    # then each pass takes 8 drafted tokens and chooses one more
    assert lookup.lookup_stats.accepted_tokens - before.accepted_tokens >= 40 - 2 - 4
    assert counter.calls <= 2 + -(-(40 - 2) // (RECENT_LOOKUP_TOKENS + 1)) + 1
    assert lookup._recent["base"][-1] == again
    lookup.load_adapter("a", adapter_dirs["good"])
    lookup.generate([_request(lookup, "a", "Where is order 1042?", max_tokens=5)])
    assert len(lookup._recent["a"]) == 1
    lookup.unload_adapter("a")
    assert "a" not in lookup._recent and len(lookup._recent["base"]) == 2
    for off in (Engine(tiny_model_dir, served_model_name="base", prompt_lookup_tokens=0),
                Engine(tiny_model_dir, served_model_name="base", recent_lookup_tokens=0)):
        off.generate([_request(off, "base", "Where is order 1042?", max_tokens=5)])
        assert off._recent == {}  # no drafts from completions: nothing kept
    with pytest.raises(ValueError, match="recent_lookup_tokens: must be >= 0"):
        Engine(tiny_model_dir, recent_lookup_tokens=-1)


def test_sampled_requests_and_batches_decode_a_token_a_pass(
        tiny: tuple[Engine, Engine]) -> None:
    lookup, plain = tiny
    counter = _Passes(lookup)
    try:
        sampled = lookup.generate([_request(lookup, "base", "order order order", max_tokens=20,
                                            temperature=0.8, seed=3)])[0]
        assert counter.calls == len(sampled.token_ids)  # the prompt's pass, then one a token
        assert sampled.token_ids == plain.generate([_request(
            plain, "base", "order order order", max_tokens=20, temperature=0.8,
            seed=3)])[0].token_ids
        counter.calls = 0
        batch = lookup.generate([_request(lookup, "base", u, max_tokens=20)
                                 for u in ("order order order", "hi there")])
        assert counter.calls == max(len(r.token_ids) for r in batch)
    finally:
        counter.close()


def test_the_server_counts_drafts_as_vllm_does(cpu_server: InferenceServer) -> None:
    url = cpu_server.url

    def metric(name: str) -> float:
        r = httpx.get(url + "/metrics", timeout=30)
        r.raise_for_status()
        return _metric(r.text, name)

    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    before = [metric(n) for n in names]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "base", "max_tokens": 30, "temperature": 0,
        "messages": [{"role": "user", "content": "order order order order"}]})
    r.raise_for_status()
    drafts, drafted, accepted = (metric(n) - b for n, b in zip(names, before, strict=True))
    assert drafts >= 1 and drafted >= drafts and 0 <= accepted <= drafted


@pytest.mark.slow
def test_smollm2_tool_calls_are_the_same_in_fewer_passes(smollm2_dir: Path,
                                                          tmp_path: Path) -> None:
    """Real weights and the tool-calling adapter, on three of the agent task's prompts: the
    same calls, and fewer than half the passes of one token each."""
    cache = smollm2_dir.parent / "smollm2-tool-caller-lora-v1"
    adapter = train_adapter(smollm2_dir, cache, _tool_sample(), name=cache.name)
    lookup = Engine(smollm2_dir, served_model_name="base", prompt_lookup_tokens=8)
    plain = Engine(smollm2_dir, served_model_name="base", prompt_lookup_tokens=0)
    for e in (lookup, plain):
        e.load_adapter("caller", adapter)
    requests = generate_heldout(3, seed=11)
    system = requests[0]["messages"][0]["content"]
    users = [r["messages"][-1]["content"] for r in requests]
    counter = _Passes(lookup)
    try:
        got = [lookup.generate([_request(lookup, "caller", u, system=system, tools=TOOLS,
                                         max_tokens=48)])[0].token_ids for u in users]
    finally:
        counter.close()
    want = [plain.generate([_request(plain, "caller", u, system=system, tools=TOOLS,
                                     max_tokens=48)])[0].token_ids for u in users]
    assert got == want
    assert counter.calls < sum(len(w) for w in want) / 2
