"""Trained token rows (``TrainConfig.trainable_token_ids``): PEFT's values without its copies.

A base model's untrained turn tokens get rows of their own; the trainer computes them with the
frozen matrix plus the rows (``factory.trainer.token_rows``) and its fused loss, and must give
PEFT's own loss and gradients; the adapter it saves must load in PEFT and in the CPU engine and
answer as the trained model does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from factory.trainer.config import TrainConfig
from factory.trainer.model import CausalLMLoss, load_model

IDS = [3, 5]


def _plan(base: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(base_model=str(base), max_seq_len=64, learning_rate=1e-3, num_steps=1,
                       trainable_token_ids=IDS, **kw)


def _batch(vocab_hit: list[int]) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(10, 100, (2, 16))
    ids[0, 10], ids[1, 3], ids[1, 12] = vocab_hit[1], vocab_hit[0], vocab_hit[0]
    labels = ids.clone()
    labels[:, :4] = -100
    return ids, torch.arange(16)[None].repeat(2, 1), None, labels


def _perturb(model: Any) -> None:
    """Move every trainable tensor off its initial value (LoRA's B starts at zero, the rows at
    the base's), so the comparison sees the adapters at work."""
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)


def _loss_and_grads(model: Any, batch: Any, *, peft_path: bool,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients through the trainer's path, or PEFT's (its own forward, the
    loss's checkpointed chunks through the wrapped head)."""
    import factory.trainer.model as trainer_model

    with monkeypatch.context() as m:
        for module in model.modules():
            if peft_path and "forward_adapters" in vars(module):
                m.delitem(vars(module), "forward_adapters")
        if peft_path:
            m.setattr(trainer_model, "head_rows", lambda head: None)
        model.zero_grad()
        loss = CausalLMLoss(model)(*batch)
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_trainer_computes_peft_s_loss_and_gradients(family: str, tiny_model_dir: Path,
                                                        tiny_gemma3_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_model_dir if family == "llama" else tiny_gemma3_dir  # gemma3: scaled embedding
    model = load_model(_plan(base), torch.device("cpu"))
    rows = [n for n, p in model.named_parameters() if p.requires_grad and "lora" not in n]
    assert rows == ["base_model.model.model.embed_tokens.token_adapter."
                    "trainable_tokens_delta.default"]
    _perturb(model)
    batch = _batch(IDS)
    fast, fast_grads = _loss_and_grads(model, batch, peft_path=False, monkeypatch=monkeypatch)
    slow, slow_grads = _loss_and_grads(model, batch, peft_path=True, monkeypatch=monkeypatch)
    assert fast == pytest.approx(slow, rel=1e-5)
    for name, g in slow_grads.items():
        torch.testing.assert_close(fast_grads[name], g, rtol=1e-4, atol=1e-5)
    assert slow_grads[rows[0]].abs().sum() > 0  # the rows learn, through embedding and head


def test_only_the_named_rows_change_and_the_head_follows_them(tiny_model_dir: Path) -> None:
    model = load_model(_plan(tiny_model_dir), torch.device("cpu"))
    base = model.get_base_model()
    frozen = base.get_input_embeddings().token_adapter.base_layer.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        CausalLMLoss(model)(*_batch(IDS)).backward()
        opt.step()
    assert torch.equal(base.get_input_embeddings().token_adapter.base_layer.weight, frozen)
    with torch.no_grad():
        used = base.get_input_embeddings()(torch.arange(120)[None])[0]
        h = torch.randn(4, used.shape[1])
        logits = base.get_output_embeddings()(h)
    changed = (used != frozen[:120]).any(-1).nonzero().flatten().tolist()
    assert changed == IDS
    torch.testing.assert_close(logits[:, IDS], h @ used[IDS].T)
    torch.testing.assert_close(logits[:, 10:20], h @ frozen[10:20].T)


def test_a_model_with_an_untied_head_is_refused(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tied to its input embedding"):
        load_model(_plan(tmp_path), torch.device("cpu"))
    with pytest.raises(ValueError, match="not in the model's embedding"):
        load_model(TrainConfig(base_model=str(tmp_path), max_seq_len=64, learning_rate=1e-3,
                               num_steps=1, trainable_token_ids=[500]), torch.device("cpu"))


def test_the_plan_checks_the_ids() -> None:
    for bad in ([3, 3], [-1], ["3"], [True]):
        with pytest.raises(ValueError, match="trainable_token_ids"):
            TrainConfig(base_model="m", max_seq_len=64, learning_rate=1e-3, num_steps=1,
                        trainable_token_ids=bad).validate()
    with pytest.raises(ValueError, match="one device only"):
        TrainConfig(base_model="m", max_seq_len=64, learning_rate=1e-3, num_steps=1,
                    trainable_token_ids=[3], parallelism="fsdp2", num_devices=2).validate()


def test_the_saved_adapter_loads_in_peft_and_serves_in_the_engine(make_job: Any,
                                                                   tiny_model_dir: Path) -> None:
    """The trainer's checkpoints with trained rows: PEFT loads them with those rows, the CPU
    engine serves two of them side by side and answers each as PEFT's own generation with it
    does (and the base model as the base does), and a run resumed from its middle checkpoint
    ends with the same rows."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from factory.inference.engine import Engine, GenerationRequest
    from factory.trainer.checkpoint import latest_checkpoint
    from factory.trainer.config import TrainerJob
    from factory.trainer.train import ExitCode, run_job

    end = 2  # SmolLM2's <|im_end|>: the turn end of the tiny model's chat format
    plan = {"trainable_token_ids": [1, end], "learning_rate": 3e-2, "num_steps": 4}
    paths = []
    for seed in (7, 8):
        job = make_job(f"rows{seed}", plan={**plan, "seed": seed})
        assert run_job(TrainerJob.from_json(job)) == ExitCode.FINISHED
        info = latest_checkpoint(json.loads(job.read_text())["output_dir"])
        assert info is not None
        paths.append(Path(info.path))
    config = json.loads((paths[0] / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == [1, end]
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    saved = load_file(paths[0] / "adapter_model.safetensors")[key]

    frozen = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32) \
        .get_input_embeddings().weight.detach()
    assert saved.shape == (2, frozen.shape[1])
    assert not torch.equal(saved[1], frozen[end])

    engine = Engine(tiny_model_dir)
    engine.load_adapter("a", paths[0])
    engine.load_adapter("b", paths[1])
    prompt = engine.encode("a", engine.render("a", [{"role": "user", "content": "reverse: a b c"}]))
    for name, path in zip(("a", "b"), paths, strict=True):
        got = engine.generate([GenerationRequest(model=name, prompt_ids=prompt,
                                                 max_tokens=8)])[0].token_ids
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(path)).eval()
        torch.testing.assert_close(peft.get_input_embeddings()(torch.tensor([[1, end]]))[0],
                                   load_file(path / "adapter_model.safetensors")[key])
        with torch.no_grad():
            want = peft.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=sorted(engine.stop_token_ids(name)),
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want[:len(got)] and len(got) == len(want), (name, got, want)
    base_got = engine.generate([GenerationRequest(model=engine.served_model_name,
                                                  prompt_ids=prompt, max_tokens=8)])[0].token_ids
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = plain.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=sorted(engine.stop_token_ids("a")),
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert base_got == want  # the base model, served beside them, without their rows

    resumed = make_job("rows-resumed", plan={**plan, "seed": 7},
                       resume_from=str(Path(paths[0]).parent / "step-00000002"))
    assert run_job(TrainerJob.from_json(resumed)) == ExitCode.FINISHED
    info = latest_checkpoint(json.loads(resumed.read_text())["output_dir"])
    assert info is not None
    torch.testing.assert_close(load_file(Path(info.path) / "adapter_model.safetensors")[key],
                               saved)


def test_the_gemma_recipe_names_its_tokens_by_their_ids(tiny_gemma3_dir: Path) -> None:
    """The recipe gives the untrained tokens' ids without loading a tokenizer; they must be
    those tokens' ids in Gemma 3's tokenizer (the tiny Gemma carries the real one), and the
    tokens must be the chat format's turn tokens."""
    from tokenizers import Tokenizer

    from factory.recipes import load_recipe
    from factory.trainer.chat import GEMMA

    untrained = dict(load_recipe("gemma3-270m-lora").architecture.untrained_tokens)
    assert set(untrained) == {GEMMA.turn_start, GEMMA.turn_end}
    tok = Tokenizer.from_file(str(tiny_gemma3_dir / "tokenizer.json"))
    assert {t: tok.token_to_id(t) for t in untrained} == untrained
