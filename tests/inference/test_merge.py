"""The CPU engine adds a served adapter's weights into the base's (``Engine(merge_adapters=...)``):
the same greedy tokens and logits as computing through the LoRA layers, the base and every other
adapter as before whatever order requests come in, and loading or unloading adapters while one
is merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factory.inference.engine import Engine, GenerationRequest
from tests.inference.conftest import make_adapter

PROMPTS = ["Where is order 1042?", "Cancel my order 77 please.", "hi there, how are you today?"]


def _request(engine: Engine, model: str, user: str) -> GenerationRequest:
    text = engine.render(model, [{"role": "user", "content": user}])
    return GenerationRequest(model=model, prompt_ids=engine.encode(model, text), max_tokens=12)


def _answers(engine: Engine, model: str) -> list[list[int]]:
    return [engine.generate([_request(engine, model, p)])[0].token_ids for p in PROMPTS]


def _logprobs(engine: Engine, model: str) -> torch.Tensor:
    ids = _request(engine, model, PROMPTS[0]).prompt_ids
    return torch.tensor([lp.logprob for lp in engine.prompt_logprobs(model, ids)[1:] if lp])


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merge")
    return {"a": make_adapter(tiny_model_dir, root / "a", seed=11),
            "b": make_adapter(tiny_model_dir, root / "b", seed=12)}


def _engine(base: Path, adapters: dict[str, Path], *, merge: bool) -> Engine:
    engine = Engine(base, served_model_name="base", merge_adapters=merge,
                    prefix_cache_entries=0)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def test_a_merged_adapter_answers_as_through_its_lora_layers(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    plain = _engine(tiny_model_dir, adapters, merge=False)
    merged = _engine(tiny_model_dir, adapters, merge=True)
    for model in ("a", "b", "base"):
        assert _answers(merged, model) == _answers(plain, model), model
        torch.testing.assert_close(_logprobs(merged, model), _logprobs(plain, model),
                                   atol=1e-4, rtol=1e-4)
    assert merged._merged is None  # the base's request took the last adapter out
    _answers(merged, "b")
    assert merged._merged == "b" and plain._merged is None


def test_the_base_and_the_other_adapter_are_unchanged_by_many_switches(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(tiny_model_dir, adapters, merge=True)
    before = {n: p.detach().clone() for n, p in engine.base.named_parameters()}
    base_answers, base_lp = _answers(engine, "base"), _logprobs(engine, "base")
    a_answers = _answers(engine, "a")
    for _ in range(200):  # a merge and an unmerge each
        for model in ("a", "b"):
            engine.generate([GenerationRequest(model=model, prompt_ids=[1, 2, 3],
                                               max_tokens=1)])
    assert _answers(engine, "base") == base_answers
    torch.testing.assert_close(_logprobs(engine, "base"), base_lp, atol=1e-5, rtol=1e-5)
    assert _answers(engine, "a") == a_answers
    _answers(engine, "base")
    drift = max(float((p.detach() - before[n]).abs().max())
                for n, p in engine.base.named_parameters())
    assert drift < 1e-5  # the rounding of 400 merges and unmerges, not an adapter left in


def test_adapters_load_and_unload_while_one_is_merged(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    plain = _engine(tiny_model_dir, {"a": adapters["a"]}, merge=False)
    engine = _engine(tiny_model_dir, {"a": adapters["a"]}, merge=True)
    base_answers = _answers(plain, "base")
    _answers(engine, "a")
    assert engine._merged == "a"
    engine.load_adapter("b", adapters["b"])  # loaded into the base's own weights
    assert engine._merged is None
    plain.load_adapter("b", adapters["b"])
    assert _answers(engine, "b") == _answers(plain, "b")
    engine.unload_adapter("b")  # the merged one
    assert _answers(engine, "a") == _answers(plain, "a")
    engine.unload_adapter("a")
    assert engine.adapters == {} and engine.model is engine.base
    assert _answers(engine, "base") == base_answers


def test_bfloat16_engines_do_not_merge(tiny_model_dir: Path,
                                       adapters: dict[str, Path]) -> None:
    engine = Engine(tiny_model_dir, served_model_name="base", dtype="bfloat16")
    engine.load_adapter("a", adapters["a"])
    _answers(engine, "a")
    assert not engine.merge_adapters and engine._merged is None
