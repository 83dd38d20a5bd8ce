"""Train/serve equivalence: the server sees the checkpoint exactly as the trainer trained it.

For a few eval samples, the trainer's view (``factory.trainer.chat.encode`` with the checkpoint's
tokenizer, the trainer's ``CausalLMLoss.token_losses`` on base + adapter) is compared with the
server's, asked only what a stock ``vllm serve`` answers (docs/serving-protocol.md):

1. the token ids of the conversation as the server renders it with the chat template it uses
   for that model (a chat completion with ``add_generation_prompt: false`` and
   ``return_token_ids``) must be the trainer's ids; a checkpoint whose chat template, tokenizer
   or special tokens differ from training fails here with the first point of difference;
2. the log-probabilities the server gives the trainer's own token ids (a text completion whose
   prompt is those ids, with ``echo`` and ``logprobs``) must agree with the trainer's within
   ``atol`` on the trained (assistant) tokens. A sample with images, sent to a vision model's
   server (the client sends images as ``image_url`` data URLs), is scored by the chat
   completion of step 1 with vLLM's ``prompt_logprobs`` instead: token ids carry no pixels.

Default tolerance: both sides run fp32 on CPU here, where the only differences are summation
order (measured ~1e-5); 1e-3 leaves room without hiding a real mismatch, which moves log-probs
by whole nats. Against a bf16 vLLM pass ``atol`` around 0.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from factory.blobs import BlobStore
from factory.errors import FactoryError
from factory.evals.answers import to_openai_messages, to_openai_tools
from factory.normalize.request import holds_image
from factory.trainer.chat import IGNORE_INDEX, encode, load_tokenizer
from factory.trainer.progress import quiet_progress_bars


class EquivalenceError(FactoryError):
    """The server does not see the checkpoint the way the trainer does."""


@dataclass(frozen=True, kw_only=True)
class EquivalenceResult:
    """Outcome of the check over some samples."""

    passed: bool
    """All samples had identical tokens and log-probs within ``atol``."""
    num_samples: int
    """Samples compared."""
    num_tokens: int
    """Trained tokens compared."""
    max_abs_diff: float | None
    """Largest log-prob difference over compared tokens (None if tokens never matched)."""
    atol: float
    """Tolerance used."""
    problems: list[str] = field(default_factory=list)
    """One line per failing sample."""

    def raise_if_failed(self) -> None:
        if not self.passed:
            raise EquivalenceError("train/serve mismatch: " + " | ".join(self.problems))


def trainer_view(checkpoint_dir: str, samples: Sequence[dict[str, Any]], *,
                 base_model: str | None = None, blob_dir: str | None = None
                 ) -> list[tuple[list[int], list[int], list[float]]]:
    """(token ids, labels, log-prob of token i+1 at i) per sample, as the trainer computes them.

    ``samples``: canonical ``{"messages", "tools"}`` (lists or JSON strings). A vision model's
    images are read from the blob store (``blob_dir``, default the factory's) and fed as the
    trainer feeds them.
    """
    import json
    import warnings
    from pathlib import Path

    import torch
    from peft import PeftModel

    # torch (~2 s) loads here: factory.evals's __init__ imports this module, the CLI factory.evals
    from factory.trainer import vision as trainer_vision
    from factory.trainer.model import (  # torch, as above
        CausalLMLoss,
        auto_model_class,
        fast_token_rows,
    )

    if base_model is None:
        cfg = json.loads((Path(checkpoint_dir) / "adapter_config.json").read_text())
        base_model = cfg["base_model_name_or_path"]
    tok = load_tokenizer(checkpoint_dir)
    quiet_progress_bars()
    base = auto_model_class(base_model).from_pretrained(base_model, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        model = PeftModel.from_pretrained(base, checkpoint_dir, is_trainable=False)
    fast_token_rows(model)  # trained token rows (a base model's turn tokens): no matrix copies
    model.eval()
    loss = CausalLMLoss(model)
    vision = None
    if trainer_vision.has_vision(base_model):
        if blob_dir is None:
            blob_dir = str(BlobStore().root)
        vision = trainer_vision.load_vision(base_model, blob_dir)
    out = []
    for s in samples:
        pixels = grids = None
        if vision is not None:
            ids, labels, images = trainer_vision.encode(s["messages"], s.get("tools"), tok, vision)
            pixels, grids = trainer_vision.stack(images)
        else:
            ids, labels = encode(s["messages"], s.get("tools"), tok)
        t_ids = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        losses = loss.token_losses(t_ids, pos, None, torch.tensor([labels]),
                                   pixel_values=pixels, image_grid_thw=grids)[0]
        out.append((ids, labels, (-losses).tolist()))
    return out


def check_equivalence(client: Any, model: str, checkpoint_dir: str,
                      samples: Sequence[dict[str, Any]], *, base_model: str | None = None,
                      atol: float = 1e-3, blob_dir: str | None = None,
                      views: Sequence[tuple[list[int], list[int], list[float]]] | None = None
                      ) -> EquivalenceResult:
    """Compare the server behind ``client`` (an ``InferenceClient``) serving ``model`` with the
    trainer's view of ``checkpoint_dir`` on ``samples`` (canonical, reference answer last);
    ``blob_dir``: where the trainer's view reads images (default the factory's blob store);
    ``views``: that view already computed (``trainer_view`` of the same arguments), say while
    the server started."""
    if not samples:
        raise ValueError("check_equivalence: needs at least one sample")
    if views is None:
        views = trainer_view(checkpoint_dir, samples, base_model=base_model, blob_dir=blob_dir)
    problems: list[str] = []
    max_diff: float | None = None
    num_tokens = 0
    tok: Any = None  # the checkpoint's tokenizer, loaded to spell out a mismatch
    for k, (s, (ids, labels, lps)) in enumerate(zip(samples, views, strict=True)):
        messages = to_openai_messages(s["messages"])
        tools = to_openai_tools(s.get("tools")) or None
        # A prompt with images is scored through the chat completion that carries them (its
        # prompt_logprobs); token ids alone would carry no pixels.
        with_images = getattr(client, "image_url", None) is not None \
            and any(holds_image(m.get("content")) for m in messages)
        served: list[float] | None = None
        if with_images:
            got, served = client.chat_prompt_logprobs(model, messages, tools)
        else:
            got = client.rendered_ids(model, messages, tools)
        if got != ids:
            i = next((j for j, (a, b) in enumerate(zip(got, ids, strict=False)) if a != b),
                     min(len(got), len(ids)))
            tok = tok or load_tokenizer(checkpoint_dir)
            problems.append(
                f"sample {k}: the server renders different tokens than the trainer "
                f"(first difference at token {i} of {len(ids)}: server "
                f"{_token(tok, got, i)} vs trainer {_token(tok, ids, i)}; the server's text "
                f"from there {tok.decode(got[i:i + 16])!r}) -- chat template or tokenizer "
                "mismatch")
            continue
        if served is None:
            served = client.prompt_logprobs(model, ids)
        diffs = []
        for i in range(len(ids) - 1):
            if labels[i + 1] == IGNORE_INDEX:
                continue
            diffs.append(abs(served[i] - lps[i]))
        num_tokens += len(diffs)
        worst = max(diffs) if diffs else 0.0
        max_diff = worst if max_diff is None else max(max_diff, worst)
        if worst > atol:
            problems.append(f"sample {k}: log-probs differ by up to {worst:.4g} nats "
                            f"(> {atol}) over {len(diffs)} trained tokens -- the server's "
                            "weights or adapter differ from the trainer's")
    return EquivalenceResult(passed=not problems, num_samples=len(samples),
                             num_tokens=num_tokens, max_abs_diff=max_diff, atol=atol,
                             problems=problems)


def _token(tok: Any, ids: list[int], i: int) -> str:
    """Token ``i`` of ``ids`` as ``id (text)``, or ``<end>`` past the last."""
    if i >= len(ids):
        return "<end>"
    return f"{ids[i]} ({tok.convert_ids_to_tokens(ids[i])!r})"
