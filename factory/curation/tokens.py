"""Token counts of canonical samples, by the trainer's own rendering and the base tokenizer.

There is one rendering of a conversation: ``factory.trainer.chat`` (the factory's ChatML with the tools
block in the system turn, tool calls and tool results; its Jinja twin is what the inference
server and ``vllm serve`` use). SmolLM2's shipped chat template ignores tools and content parts,
so counting with it undercounted agent traffic 2-3x and plans cut every sample before its
assistant turn. Curation, the profile and the planner therefore count exactly what the trainer
feeds the model: ``factory.trainer.chat.spans`` for the text, the base model's ``tokenizer.json`` for
the ids. tests/curation/test_tokens.py holds the counts equal to ``factory.trainer.chat.encode`` with
the trainer's own tokenizer.

The tokenizer is loaded with the ``tokenizers`` library (0.2 s, against ~10 s for
``AutoTokenizer`` here, which matters in every Spark worker); it is the same Rust backend the
transformers tokenizer wraps, so the ids are the same.
"""

from __future__ import annotations

import bisect
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from factory.trainer.chat import spans

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
    Pickles as its folder, so Spark workers and process pools rebuild it cheaply.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer_dir = str(tokenizer_dir)
        self.name = Path(self.tokenizer_dir).name

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_dir": self.tokenizer_dir, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tokenizer_dir"])  # type: ignore[misc]

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
        for i, messages in enumerate(conversations):
            try:
                text, trained = spans(messages, tools[i] if tools is not None else None)
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


@cache
def _load(path: str) -> Any:
    from tokenizers import Tokenizer

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
