"""The loss: fused chunked cross-entropy equals the plain one, and packing changes nothing.

Packed rows rely on position-id resets marking the samples: transformers 5 builds block-diagonal
causal masks from them, and on CPU our attention runs causal SDPA per segment instead. These tests
prove both numerically against one-sample-per-row batches (which take transformers' masked SDPA
path), and show that the same rows with continuous positions (naive packing) do differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from factory.trainer import model as model_mod
from factory.trainer.chat import install_chat_template, load_tokenizer
from factory.trainer.config import TrainConfig
from factory.trainer.data import MicroBatchStream, collate, pack, tokenize
from factory.trainer.model import CausalLMLoss, load_model, segment_lengths
from tests.trainer.conftest import make_samples


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    torch.manual_seed(0)
    plan = TrainConfig(base_model=str(tiny_model_dir), max_seq_len=512, learning_rate=1e-3,
                       num_steps=1, lora_rank=4)
    model = load_model(plan, torch.device("cpu"))
    with torch.no_grad():  # non-zero LoRA B, so the adapters take part in the comparison
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    tok = install_chat_template(load_tokenizer(str(tiny_model_dir)))
    examples, _ = tokenize(make_samples(6, seed=3), tok, max_seq_len=512)
    return model, CausalLMLoss(model), examples, tok


def test_fused_loss_matches_plain_cross_entropy(tiny) -> None:
    model, loss_module, examples, tok = tiny
    batch = collate(examples, [[0, 1], [2]], packed=True, pad_id=tok.pad_token_id)
    # Fused path, tiny chunks so several chunks run.
    old = model_mod.LOSS_CHUNK_TOKENS
    model_mod.LOSS_CHUNK_TOKENS = 7
    try:
        fused = loss_module(batch.input_ids, batch.position_ids, None, batch.labels)
        fused.backward()
    finally:
        model_mod.LOSS_CHUNK_TOKENS = old
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                   use_cache=False).logits.float()
    plain = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch.labels[:, 1:],
                            ignore_index=-100, reduction="sum")
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    for n, p in model.named_parameters():
        if p.requires_grad:
            # fp32 sums in a different order: noise ~1e-6 of the gradient's scale over the
            # ~500 summed terms; 1e-4 of the scale still catches a missing or doubled term.
            scale = float(p.grad.abs().max())
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-4 * scale)
    model.zero_grad(set_to_none=True)


def _per_sample(losses: torch.Tensor, sample_index: torch.Tensor) -> dict[int, float]:
    idx = sample_index[:, 1:]
    out: dict[int, float] = {}
    for i in idx.unique().tolist():
        if i >= 0:
            out[i] = float(losses[idx == i].sum())
    return out


def test_packed_and_unpacked_give_the_same_per_sample_loss(tiny) -> None:
    _, loss_module, examples, tok = tiny
    n = len(examples)
    rows = pack([len(e.input_ids) for e in examples], list(range(n)), 512)
    assert any(len(r) > 1 for r in rows), "the test needs rows holding several samples"
    packed = collate(examples, rows, packed=True, pad_id=tok.pad_token_id)
    unpacked = collate(examples, [[i] for i in range(n)], packed=False, pad_id=tok.pad_token_id)
    lp = loss_module.token_losses(packed.input_ids, packed.position_ids, None, packed.labels)
    lu = loss_module.token_losses(unpacked.input_ids, unpacked.position_ids,
                                  unpacked.attention_mask, unpacked.labels)
    per_packed = _per_sample(lp, packed.sample_index)
    per_unpacked = _per_sample(lu, unpacked.sample_index)
    assert per_packed.keys() == per_unpacked.keys() == set(range(n))
    for i in range(n):
        assert per_packed[i] == pytest.approx(per_unpacked[i], rel=1e-4), i
    assert packed.num_label_tokens == unpacked.num_label_tokens

    # Naive packing (positions running on across samples) leaks attention: the loss changes.
    naive_pos = torch.arange(packed.input_ids.shape[1]).expand_as(packed.input_ids)
    ln = loss_module.token_losses(packed.input_ids, naive_pos, None, packed.labels)
    per_naive = _per_sample(ln, packed.sample_index)
    leaked = [i for i in range(n) if abs(per_naive[i] - per_unpacked[i]) > 1e-3 * per_unpacked[i]]
    assert leaked, "continuous positions should change the loss of later samples in a row"


def test_packed_rows_attend_per_sample_on_cpu(tiny) -> None:
    model, loss_module, examples, tok = tiny
    # The per-segment attention is in use, so the two tests above compare it with the masked
    # path (unpacked rows, and the plain forward of the fused-loss test).
    assert loss_module.packed_attention
    assert model.config._attn_implementation == model_mod.PACKED_ATTENTION
    n = len(examples)
    rows = pack([len(e.input_ids) for e in examples], list(range(n)), 512)
    packed = collate(examples, rows, packed=True, pad_id=tok.pad_token_id)
    width = packed.input_ids.shape[1]
    expected = []
    for row in rows:
        lengths = [len(examples[i].input_ids) for i in row]
        pad = width - sum(lengths)
        expected.append(lengths + ([pad] if pad else []))  # padding: a segment of its own
    assert segment_lengths(packed.position_ids) == expected
    # Continuous positions are one segment: exactly what transformers' mask makes of them.
    assert segment_lengths(torch.arange(6).expand(2, 6)) == [[6], [6]]
    assert segment_lengths(torch.tensor([[0, 1, 2, 0, 1, 5, 6]])) == [[3, 2, 2]]

    # Per-segment and masked attention agree on the same packed rows, token by token.
    per_segment = loss_module.token_losses(packed.input_ids, packed.position_ids, None,
                                           packed.labels)
    loss_module.packed_attention = False
    try:
        masked = loss_module.token_losses(packed.input_ids, packed.position_ids, None,
                                          packed.labels)
    finally:
        loss_module.packed_attention = True
    torch.testing.assert_close(per_segment, masked, rtol=1e-4, atol=1e-5)


def test_stream_order_is_deterministic_and_packs_densely(tiny) -> None:
    _, _, examples, tok = tiny
    many = examples * 20
    a = MicroBatchStream(many, max_seq_len=512, packing=True, micro_batch_size=2, seed=5,
                         pad_id=tok.pad_token_id)
    b = MicroBatchStream(many, max_seq_len=512, packing=True, micro_batch_size=2, seed=5,
                         pad_id=tok.pad_token_id)
    assert [a.rows(k) for k in range(a.per_epoch * 2)] == \
        [b.rows(k) for k in range(b.per_epoch * 2)]
    assert a.rows(0) != a.rows(a.per_epoch)  # each epoch reshuffles
    rows = [r for k in range(a.per_epoch) for r in a.rows(k)]
    assert sorted(i for r in rows for i in r) == list(range(len(many)))
    lengths = [len(e.input_ids) for e in many]
    assert all(sum(lengths[i] for i in r) <= 512 for r in rows)
    # Rows of 2048 fit several of the longest (tool) samples: first-fit must fill them >95%.
    dense = pack(lengths, list(range(len(many))), 2048)
    assert sum(lengths) / (len(dense) * 2048) > 0.95


def test_bf16_autocast_frozen_linears_in_bf16_change_nothing(tiny_model_dir: Path, tiny) -> None:
    """bf16-autocast stores frozen linear weights in bf16: bit for bit what autocast computed
    from fp32 weights (the plan's old behaviour), loss and adapter gradients alike."""
    _, _, examples, tok = tiny
    batch = collate(examples, [[0, 1], [2]], packed=True, pad_id=tok.pad_token_id)
    results = []
    for precision in ("fp32", "bf16-autocast"):
        torch.manual_seed(0)  # the same adapter init for both
        plan = TrainConfig(base_model=str(tiny_model_dir), max_seq_len=512, learning_rate=1e-3,
                           num_steps=1, lora_rank=4, precision=precision)
        model = load_model(plan, torch.device("cpu"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.linspace(-0.05, 0.05, p.numel()).view_as(p))
        dtypes = {p.dtype for n, p in model.named_parameters() if "base_layer" in n}
        assert dtypes == ({torch.float32} if precision == "fp32" else {torch.bfloat16})
        head = model.get_base_model().get_output_embeddings()
        assert head.weight.dtype == torch.float32  # tied to the embedding: untouched
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = CausalLMLoss(model)(batch.input_ids, batch.position_ids, None, batch.labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                        if p.requires_grad}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


@pytest.mark.slow
@pytest.mark.parametrize("load, bars", [
    ("AutoModelForCausalLM.from_pretrained(path)", True),  # what the check would see
    ("load_model(TrainConfig(base_model=path, max_seq_len=64, learning_rate=1e-3, "
     "num_steps=1), torch.device('cpu'))", False),
    ("Engine(path)", False),
])
def test_model_loading_draws_no_progress_bars_into_a_log(tiny_model_dir: Path, load: str,
                                                         bars: bool) -> None:
    """A log that is not a terminal gets no "Loading weights" bar from the trainer's or the
    inference server's model loading."""
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            "from factory.trainer.config import TrainConfig; "
            "from factory.trainer.model import load_model; "
            "from factory.inference.engine import Engine; "
            f"path = sys.argv[1]; {load}")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("Loading weights" in out.stderr) is bars, out.stderr[-2000:]


@pytest.mark.slow
# quiet=False shows the bar is there to remove (make test-heavy): ~35 s of make test's budget.
@pytest.mark.parametrize("quiet", [pytest.param(False, marks=pytest.mark.heavy), True])
def test_dequantizing_a_gguf_draws_no_progress_bar_into_a_log(quiet: bool) -> None:
    """The GGUF reader's own bar ("Converting and de-quantizing GGUF tensors...") stays out of
    a log once the factory quiets the bars (the embedded models are built this way)."""
    code = ("from factory.trainer.base_models import gguf_path; "
            "from factory.trainer.progress import quiet_progress_bars; "
            + ("quiet_progress_bars(); " if quiet else "")
            + "from transformers import AutoModelForCausalLM; src = gguf_path(); "
            "AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("de-quantizing GGUF tensors" in out.stderr) is not quiet, out.stderr[-2000:]


SYSTEM = ("You triage support tickets for a desk shop. Route each ticket to one team: billing, "
          "bug, account_access, shipping or feature_request. Answer with the label only.")


def _triage(n: int, *, system: str = SYSTEM) -> list[dict]:
    teams = ["billing", "bug", "shipping"]
    out = []
    for i in range(n):
        ticket = " ".join(["my order", "the app", "a refund", "login"][: 1 + i % 4]) + f" #{i}"
        out.append({"sample_id": f"t{i}", "tools": [], "messages": [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": ticket}]},
            {"role": "assistant", "content": [{"type": "text", "text": teams[i % 3]}]}]})
    return out


@pytest.mark.parametrize("one_call", [True, False], ids=["rests-in-one-call", "a-call-a-rest"])
def test_a_shared_prefix_computed_once_gives_each_sample_its_own_loss_and_gradient(
        tiny, one_call: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.trainer.config import MIN_SHARED_PREFIX
    from factory.trainer.data import collate_shared, shared_prefix_length

    model, loss_module, _, tok = tiny
    examples, _ = tokenize(_triage(5), tok, max_seq_len=512)
    n = len(examples)
    prefix = shared_prefix_length(examples)
    assert prefix >= MIN_SHARED_PREFIX
    first = min(next(t for t in range(1, len(e.labels)) if e.labels[t] != -100) for e in examples)
    assert prefix < first  # the prefix never reaches a trained token
    shared = collate_shared(examples, list(range(n)), prefix)
    unpacked = collate(examples, [[i] for i in range(n)], packed=False, pad_id=tok.pad_token_id)
    assert shared.input_ids.shape[0] == 1
    assert shared.num_row_tokens == shared.num_real_tokens - prefix * (n - 1)
    assert shared.num_real_tokens == unpacked.num_real_tokens
    assert shared.num_label_tokens == unpacked.num_label_tokens
    if not one_call:
        monkeypatch.setattr(model_mod, "REST_CALL_WORK", 0.0)
    segments = segment_lengths(shared.position_ids)
    starts = model_mod.segment_starts(shared.position_ids, segments)
    assert model_mod._rests_in_one_call(tuple(segments[0]), tuple(starts[0])) is one_call

    ls = loss_module.token_losses(shared.input_ids, shared.position_ids, None, shared.labels)
    lu = loss_module.token_losses(unpacked.input_ids, unpacked.position_ids,
                                  unpacked.attention_mask, unpacked.labels)
    per_shared, per_unpacked = _per_sample(ls, shared.sample_index), _per_sample(lu,
                                                                                unpacked.sample_index)
    assert per_shared.keys() == per_unpacked.keys() == set(range(n))
    for i in range(n):
        assert per_shared[i] == pytest.approx(per_unpacked[i], rel=1e-4), i

    def grads(batch) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss_module(batch.input_ids, batch.position_ids, batch.attention_mask,
                    batch.labels).backward()
        out = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return out

    g_shared, g_unpacked = grads(shared), grads(unpacked)
    for k, g in g_unpacked.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(g_shared[k], g, rtol=1e-4, atol=1e-4 * scale)

    # Without the prefix attention the rests would see only themselves: the loss changes.
    no_prefix = shared.position_ids.clone()
    starts = no_prefix[0] == prefix
    no_prefix[0] = torch.where(no_prefix[0] >= prefix, no_prefix[0] - prefix, no_prefix[0])
    assert starts.sum() == n
    lx = loss_module.token_losses(shared.input_ids, no_prefix, None, shared.labels)
    per_x = _per_sample(lx, shared.sample_index)
    assert any(abs(per_x[i] - per_unpacked[i]) > 1e-3 * per_unpacked[i] for i in range(1, n))


def test_share_prefix_makes_one_row_only_where_the_samples_share_one(tiny) -> None:
    from factory.trainer.config import MIN_SHARED_PREFIX

    _, _, _, tok = tiny
    same, _ = tokenize(_triage(8), tok, max_seq_len=512)
    mixed, _ = tokenize(_triage(4) + _triage(4, system="Say which team."), tok, max_seq_len=512)
    for examples, rows in ((same, 1), (mixed, 8)):
        stream = MicroBatchStream(examples, max_seq_len=512, packing=False, micro_batch_size=8,
                                  seed=0, pad_id=tok.pad_token_id, share_prefix=True)
        assert stream.batch(0).input_ids.shape[0] == rows
        summary = stream.shared_prefix_summary()
        assert summary["micro_batches"] == (1 if rows == 1 else 0)
        saved = summary["tokens"] - summary["tokens_computed"]
        assert (saved >= 7 * MIN_SHARED_PREFIX) if rows == 1 else saved == 0
    plain = MicroBatchStream(same, max_seq_len=512, packing=False, micro_batch_size=8, seed=0,
                             pad_id=tok.pad_token_id)
    assert plain.batch(0).input_ids.shape[0] == 8
    assert plain.shared_prefix_summary()["tokens_computed"] == plain.shared_prefix_summary()["tokens"]
