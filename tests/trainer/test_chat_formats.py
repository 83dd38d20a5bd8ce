"""Chat formats: each family's tokenizer picks its format, whose Python and Jinja renderings agree
and whose label mask is exactly the assistant turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factory.trainer.chat import (
    CHATML,
    GEMMA,
    IGNORE_INDEX,
    chat_format,
    chat_template,
    encode,
    install_chat_template,
    load_tokenizer,
    parse_assistant,
    render,
)
from tests.trainer.test_chat import CASES


@pytest.fixture(scope="module")
def tok(tiny_family_dir: Path) -> Any:
    return install_chat_template(load_tokenizer(str(tiny_family_dir)))


def _expected(model_dir: Path) -> Any:
    return GEMMA if model_dir.name == "tiny-gemma3" else CHATML


def test_each_family_renders_in_its_own_format(tok: Any, tiny_family_dir: Path) -> None:
    fmt = _expected(tiny_family_dir)
    assert chat_format(tok) is fmt and tok.chat_template == chat_template(fmt)
    for messages, tools in CASES:
        for n in range(1, len(messages) + 1):
            prefix = messages[:n]
            gen = prefix[-1]["role"] != "assistant"
            expected = render(prefix, tools, tok, add_generation_prompt=gen)
            assert expected.startswith(fmt.begin + fmt.turn_start)
            assert tok.apply_chat_template(prefix, tools=tools or None, tokenize=False,
                                           add_generation_prompt=gen) == expected
        assert render(json.dumps(messages), json.dumps(tools), tok) == render(messages, tools, tok)


def test_label_mask_is_the_assistant_turns_and_their_end(tok: Any, tiny_family_dir: Path) -> None:
    fmt = _expected(tiny_family_dir)
    messages, tools = CASES[2]
    ids, labels = encode(messages, tools, tok)
    # The turn tokens are single tokens of the vocabulary: one id each in the rendering.
    end = tok.convert_tokens_to_ids(fmt.turn_end)
    assert ids.count(end) == render(messages, tools, tok).count(fmt.turn_end)
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert trained == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n'
        f"</tool_call>{fmt.turn_end}Paris sunny, Oslo rain.{fmt.turn_end}")
    if fmt.begin:
        assert ids[0] == tok.bos_token_id and labels[0] == IGNORE_INDEX


def test_a_tokenizer_of_no_known_format_is_refused() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    bare = Tokenizer(WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="turn tokens of no chat format"):
        chat_format(bare)


def test_generated_text_stops_at_either_turn_end() -> None:
    for fmt in (CHATML, GEMMA):
        msg = parse_assistant(f"Hi there.{fmt.turn_end}\n{fmt.turn_start}user\n")
        assert msg == {"role": "assistant", "content": [{"type": "text", "text": "Hi there."}]}
