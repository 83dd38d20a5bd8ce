"""Token counts of canonical samples, by the trainer's own rendering and the base tokenizer.

There is one rendering of a conversation: ``factory.trainer.chat`` (the factory's rendering in the
base model's chat format, with the tools block in the system turn, tool calls and tool results;
its Jinja twin is what the inference server and ``vllm serve`` use). SmolLM2's shipped chat
template ignores tools and content parts, so counting with it undercounted agent traffic 2-3x and plans cut every sample before its
assistant turn. Curation, the profile and the planner therefore count exactly what the trainer
feeds the model: ``factory.trainer.chat.spans`` for the text, the base model's ``tokenizer.json`` for
the ids. tests/curation/test_tokens.py holds the counts equal to ``factory.trainer.chat.encode`` with
the trainer's own tokenizer.

The tokenizer is loaded with the ``tokenizers`` library (0.2 s, against ~10 s for
``AutoTokenizer`` here, which matters in every Spark worker); it is the same Rust backend the
transformers tokenizer wraps, so the ids are the same.

A vision-language base model (``factory.trainer.vision.has_vision``) counts each image as the
trainer renders it: its placeholder of as many ``<|image_pad|>`` tokens as the processor's grid
for that image gives (from the image's size, read from the blob store). A sample whose image is
not in the blob store has no count, and ``failures`` says ``missing_image`` for it.
"""

from __future__ import annotations

import bisect
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from factory.settings import get_settings
from factory.trainer.chat import ImageText, chat_format, common_prefix, spans, text_only_image
from factory.trainer.vision import MissingImage, Vision, blob_reader, has_vision, image_text

Count = tuple[int, int] | None
"""(total tokens, prompt tokens) of one sample; None when it cannot be rendered."""


class TokenCounter(Protocol):
    """Counts (total, prompt) tokens of canonical samples (``messages`` and ``tools`` lists)."""

    name: str

    def count(self, conversations: list[list[dict[str, Any]]],
              tools: list[list[dict[str, Any]]] | None = None) -> list[Count]: ...


class RenderCounter:
    """``TokenCounter`` of the trainer's rendering over a base model's tokenizer folder.

    ``total`` is the length of the sample as the trainer tokenizes it (``factory.trainer.chat.encode``);
    ``prompt`` is the number of those tokens before the last assistant turn's trained text.
    Pickles as its folders, so Spark workers and process pools rebuild it cheaply.
    ``blob_dir``: the blob store a vision model's images are read from (default: the
    settings' ``blobs``).
    """

    def __init__(self, tokenizer_dir: str | Path, blob_dir: str | Path | None = None) -> None:
        self.tokenizer_dir = str(tokenizer_dir)
        self.blob_dir = str(blob_dir) if blob_dir is not None else None
        self.name = Path(self.tokenizer_dir).name
        self.failures: dict[int, str] = {}
        """Why samples of the last ``count`` have no count, by index, where known
        (``missing_image``)."""

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_dir": self.tokenizer_dir, "blob_dir": self.blob_dir,
                "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer_dir"], state.get("blob_dir"))  # type: ignore[misc]

    def image_text(self) -> ImageText:
        """How an image part renders for this model: ``[image]``, or a vision model's
        placeholder of the image's tokens (``MissingImage`` when its bytes are not stored)."""
        if not has_vision(self.tokenizer_dir):
            return text_only_image
        blob_dir = self.blob_dir
        if blob_dir is None:
            blob_dir = str(get_settings().blobs)
        vision = _vision(self.tokenizer_dir, blob_dir)
        if vision is None:
            return text_only_image
        return lambda part: image_text(vision.num_tokens(part))

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` of the base model."""
        return _load(self.tokenizer_dir)

    def count(self, conversations: list[list[dict[str, Any]]],
              tools: list[list[dict[str, Any]]] | None = None) -> list[Count]:
        texts: list[str] = []
        cuts: list[int] = []
        where: list[int] = []
        out: list[Count] = [None] * len(conversations)
        fmt = chat_format(self.tokenizer)
        image = self.image_text()
        self.failures = {}
        for i, messages in enumerate(conversations):
            try:
                text, trained = spans(messages, tools[i] if tools is not None else None, fmt=fmt,
                                      image=image)
            except MissingImage:
                self.failures[i] = "missing_image"
                continue
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a renderable conversation: the caller drops it with the reason
            texts.append(text)
            cuts.append(trained[-1][0] if trained else len(text))
            where.append(i)
        # Offsets are needed for the prompt's length only; one tokenization of the whole text,
        # as the trainer does (tokenizing the prompt apart can merge differently at the cut).
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        for i, cut, enc in zip(where, cuts, encs, strict=True):
            starts = [start for start, _ in enc.offsets]
            out[i] = (len(enc.ids), bisect.bisect_left(starts, cut))
        return out


SHARED_PREFIX_GROUP = 8
"""Samples per group ``shared_prefix_tokens`` measures: a typical micro-batch."""


def shared_prefix_tokens(counter: RenderCounter, conversations: list[list[dict[str, Any]]],
                         tools: list[list[dict[str, Any]]] | None = None, *,
                         max_samples: int = 512, seed: int = 0) -> int:
    """The median, over random groups of ``SHARED_PREFIX_GROUP`` samples (at most
    ``max_samples`` in all), of the tokens every sample of the group begins with, up to its
    first trained token: what the trainer's ``share_prefix`` computes once per micro-batch.
    0 when fewer than two samples render."""
    import random

    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    ids: list[list[int]] = []
    fmt = chat_format(counter.tokenizer)
    image = counter.image_text()
    for i in order[:max_samples]:
        try:
            text, trained = spans(conversations[i], tools[i] if tools is not None else None,
                                  fmt=fmt, image=image)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        enc = counter.tokenizer.encode(text, add_special_tokens=False)
        cut = trained[0][0] if trained else len(text)
        # The first trained token is the first that ends past the cut (``label_ids``), and
        # the prefix ends before the token ahead of it.
        first = bisect.bisect_right([end for _, end in enc.offsets], cut)
        ids.append(enc.ids[:max(first - 1, 0)])
    groups = [ids[k:k + SHARED_PREFIX_GROUP] for k in range(0, len(ids), SHARED_PREFIX_GROUP)]
    lengths = sorted(common_prefix(g) for g in groups if len(g) > 1)
    return lengths[len(lengths) // 2] if lengths else 0


@cache
def _vision(model_dir: str, blob_dir: str) -> Vision | None:
    return Vision(model_dir, blob_reader(blob_dir)) if has_vision(model_dir) else None


@cache
def _load(path: str) -> Any:
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder} has no tokenizer.json (a fast tokenizer is needed)")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # BPE keeps merged words in a cache of 10,000 entries by default; a batch of traffic has
    # far more distinct words, and a larger cache took ~20% off tokenization here (~40 MB).
    # Counts do not depend on it.
    if hasattr(tok.model, "_resize_cache"):
        tok.model._resize_cache(200_000)
    return tok
