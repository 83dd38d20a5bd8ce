"""Rendering: Python and Jinja agree, and the loss mask covers exactly the assistant turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factory.trainer.chat import (
    IGNORE_INDEX,
    encode,
    install_chat_template,
    load_tokenizer,
    parse_assistant,
    render,
)
from tests.trainer.conftest import WEATHER_TOOL, make_samples


def _t(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = [
    ([{"role": "user", "content": _t("hi")}, {"role": "assistant", "content": _t("hello")}], []),
    ([{"role": "system", "content": _t("Be brief.")},
      {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                   {"type": "image", "media_type": "image/png", "sha256": "ab"}]},
      {"role": "assistant", "content": [{"type": "reasoning", "text": "A cat, probably."},
                                        {"type": "text", "text": "A cat. ünïcode ✓"}]},
      {"role": "user", "content": _t("Sure?")},
      {"role": "assistant", "content": _t("Yes.")}], []),
    ([{"role": "user", "content": _t("Weather in Paris and Oslo?")},
      {"role": "assistant", "content": _t("Checking."), "tool_calls": [
          {"id": "call_0", "name": "get_weather", "arguments": '{"city":"Paris"}'},
          {"id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'}]},
      {"role": "tool", "tool_call_id": "call_0", "content": _t('{"sky":"sunny"}')},
      {"role": "tool", "tool_call_id": "call_1", "content": _t('{"sky":"rain"}')},
      {"role": "assistant", "content": _t("Paris sunny, Oslo rain.")}], [WEATHER_TOOL]),
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return install_chat_template(load_tokenizer(str(tiny_model_dir)))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_jinja_template_renders_exactly_like_python(tok: Any, case: int) -> None:
    messages, tools = CASES[case]
    for n in range(1, len(messages) + 1):
        prefix = messages[:n]
        gen = prefix[-1]["role"] != "assistant"
        expected = render(prefix, tools, add_generation_prompt=gen)
        got = tok.apply_chat_template(prefix, tools=tools or None, tokenize=False,
                                      add_generation_prompt=gen)
        assert got == expected
    # JSON strings (as stored in Parquet) render the same as parsed lists.
    assert render(json.dumps(messages), json.dumps(tools)) == render(messages, tools)


def test_label_mask_is_exactly_the_assistant_turns(tok: Any) -> None:
    messages, tools = CASES[2]
    ids, labels = encode(messages, tools, tok)
    assert len(ids) == len(labels)
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert trained == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n'
        "</tool_call><|im_end|>Paris sunny, Oslo rain.<|im_end|>")
    # Trained positions carry their own token as label; everything else is ignored.
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=True))
    # The prompt for the first assistant turn, as served, is an untrained prefix of the sample.
    prompt = tok(render(messages[:1], tools, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert ids[:len(prompt)] == prompt
    assert all(lab == IGNORE_INDEX for lab in labels[:len(prompt)])
    assert labels[len(prompt)] != IGNORE_INDEX
    # No system, user or tool text is ever trained.
    for role in ("system", "user", "tool"):
        assert f"<|im_start|>{role}" not in trained
    assert "sunny" not in trained.replace("Paris sunny", "")


def test_parse_assistant_inverts_rendering() -> None:
    for messages, tools in CASES + [(s["messages"], s["tools"]) for s in make_samples(6)]:
        for m in messages:
            if m["role"] != "assistant" or any(p["type"] == "reasoning" for p in m["content"]):
                continue
            text = render([m], tools).split("<|im_start|>assistant\n", 1)[1]
            parsed = parse_assistant(text)
            assert parsed["content"] == m["content"]
            assert parsed.get("tool_calls", []) == m.get("tool_calls", [])
    broken = parse_assistant("<tool_call>\n{not json}\n</tool_call><|im_end|>")
    assert "tool_calls" not in broken and "{not json}" in broken["content"][0]["text"]
