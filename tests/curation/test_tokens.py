"""Token counts equal transformers' ``apply_chat_template`` + tokenizer on the same messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from factory.curation.synthetic import Planted
from factory.curation.text import last_assistant_index, template_messages


@pytest.mark.slow
def test_counts_match_transformers(smollm2_dir: Path, counter: Any,
                                   planted_data: Planted) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    convs = [orjson.loads(r["messages"]) for r in planted_data.rows[:40] + planted_data.rows[-12:]]
    mine = counter.count(convs)
    for msgs, (total, prompt) in zip(convs, mine, strict=True):
        tm = template_messages(msgs)
        full = tok.apply_chat_template(tm, tokenize=False)
        assert counter.render(tm, add_generation_prompt=False) == full
        assert total == len(tok(full, add_special_tokens=False)["input_ids"])
        cut = last_assistant_index(msgs)
        if cut > 0:
            head = tok.apply_chat_template(tm[:cut], tokenize=False, add_generation_prompt=True)
            assert prompt == len(tok(head, add_special_tokens=False)["input_ids"])
