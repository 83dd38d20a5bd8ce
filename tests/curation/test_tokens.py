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


def test_skeleton_render_equals_jinja_and_falls_back_when_content_is_transformed(
        smollm2_dir: Path, planted_data: Planted, tmp_path: Path) -> None:
    import json
    import shutil

    from factory.curation.tokens import ChatTemplateCounter

    fast = ChatTemplateCounter(smollm2_dir)
    rows = [template_messages(orjson.loads(r["messages"])) for r in planted_data.rows]
    for tm in rows:
        for gen in (False, True):
            assert fast.render(tm, add_generation_prompt=gen) == \
                fast._jinja(tm, add_generation_prompt=gen)
    assert any(v is not None for v in fast._skeletons.values())  # the fast path was taken
    # a template that trims content: splicing would keep the spaces, so Jinja must render
    trimmed = tmp_path / "trim"
    shutil.copytree(smollm2_dir, trimmed, ignore=shutil.ignore_patterns("*.safetensors"))
    (trimmed / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((trimmed / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                               "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}")
    (trimmed / "tokenizer_config.json").write_text(json.dumps(config))
    slow = ChatTemplateCounter(trimmed)
    msgs = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": " yo "}]
    assert slow.render(msgs, add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert set(slow._skeletons.values()) == {None}
