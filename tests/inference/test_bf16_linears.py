"""Generation with the linear layers packed in bf16 (``Engine(bf16_linears=True)``, the CPU
server's ``--bf16-linears``): the packs follow the weights through adapter merges and
switches, the log-probs the equivalence check reads stay float32, and an engine refuses the
option where it would not be native."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factory.inference.engine import Engine, GenerationRequest, bf16_linears_available
from tests.inference.conftest import make_adapter

PROMPTS = ["Where is order 1042?", "Cancel my order 77 please."]

native = pytest.mark.skipif(not bf16_linears_available()[0],
                            reason=f"packed bf16 linears: {bf16_linears_available()[1]}")


def _request(engine: Engine, model: str, user: str) -> GenerationRequest:
    text = engine.render(model, [{"role": "user", "content": user}])
    return GenerationRequest(model=model, prompt_ids=engine.encode(model, text), max_tokens=12)


def _answers(engine: Engine, model: str) -> list[list[int]]:
    return [engine.generate([_request(engine, model, p)])[0].token_ids for p in PROMPTS]


def _engine(base: Path, adapters: dict[str, Path], *, bf16: bool) -> Engine:
    engine = Engine(base, served_model_name="base", prefix_cache_entries=0, bf16_linears=bf16)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    return {"a": make_adapter(tiny_model_dir, root / "a", seed=21),
            "b": make_adapter(tiny_model_dir, root / "b", seed=22)}


@native
def test_packs_follow_merges_and_switches(tiny_model_dir: Path,
                                          adapters: dict[str, Path]) -> None:
    # Fresh engines answer each model first, with its weights packed once: the reference.
    fresh = {model: _answers(_engine(tiny_model_dir, adapters, bf16=True), model)
             for model in ("base", "a", "b")}
    engine = _engine(tiny_model_dir, adapters, bf16=True)
    assert engine.bf16_linears is not None
    for model in ("a", "base", "b", "a", "base"):  # merges, unmerges, a merge over another
        # A pack left from the model before would answer with that model's weights.
        assert _answers(engine, model) == fresh[model], model
    assert fresh["a"] != fresh["base"] and fresh["b"] != fresh["base"]
    assert not engine.bf16_linears.active  # only while generating


@native
def test_generation_computes_in_bf16_and_logprobs_stay_float32(
        tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    plain = _engine(tiny_model_dir, adapters, bf16=False)
    packed = _engine(tiny_model_dir, adapters, bf16=True)
    ids = _request(plain, "a", PROMPTS[0]).prompt_ids
    exact = [lp.logprob for lp in plain.prompt_logprobs("a", ids)[1:] if lp]
    assert [lp.logprob for lp in packed.prompt_logprobs("a", ids)[1:] if lp] == exact
    req = GenerationRequest(model="a", prompt_ids=ids, max_tokens=4, top_logprobs=0)
    want = plain.generate([req])[0].logprobs
    got = packed.generate([GenerationRequest(model="a", prompt_ids=ids, max_tokens=4,
                                             top_logprobs=0)])[0].logprobs
    assert want is not None and got is not None
    first = abs(got[0].logprob - want[0].logprob)
    # bf16 products: close to float32's, and not float32's (else nothing was packed)
    assert 0 < first < 0.05, first


@native
def test_a_sure_answer_is_the_same_in_bf16(tiny_model_dir: Path) -> None:
    # The tiny model trained until greedy decoding writes its reply (each token's probability
    # over 0.95 in float32): bf16's rounding must not change what the model is sure of.
    from tests.inference.test_tool_calls import (
        CALLER_NAME,
        QUESTION,
        REPLY,
        TOOLS,
        _models_cache,
        _train_caller,
    )

    model = _train_caller(tiny_model_dir, _models_cache() / CALLER_NAME)
    engine = Engine(model, served_model_name="caller", bf16_linears=True)
    ids = engine.encode("caller", engine.render("caller", QUESTION, TOOLS))
    out = engine.generate([GenerationRequest(model="caller", prompt_ids=ids, max_tokens=100)])
    assert out[0].text == REPLY


def test_refused_where_bf16_is_not_native(tiny_model_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_CPU_BF16", "emulated")
    with pytest.raises(ValueError, match="bf16 is not native on this CPU"):
        Engine(tiny_model_dir, bf16_linears=True)
    monkeypatch.delenv("FACTORY_CPU_BF16")
    with pytest.raises(ValueError, match="needs dtype float32"):
        Engine(tiny_model_dir, dtype="bfloat16", bf16_linears=True)
    plain = Engine(tiny_model_dir)  # off unless asked: no layer's forward replaced
    assert plain.bf16_linears is None
    assert not any("forward" in vars(m) for m in plain.base.modules()
                   if isinstance(m, torch.nn.Linear))


def test_the_server_refuses_the_option_with_a_clear_error(tiny_model_dir: Path) -> None:
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "factory.inference", str(tiny_model_dir),
                          "--port", "0", "--bf16-linears", "on"],
                         env={**os.environ, "FACTORY_CPU_BF16": "emulated"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "bf16_linears: needs dtype float32 and native bf16" in run.stderr
    assert "Traceback" not in run.stderr
