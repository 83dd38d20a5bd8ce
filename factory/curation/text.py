"""Reading canonical samples: text of turns, the prompt, template-ready messages, words, language.

Everything here is a pure function of one sample's ``messages``/``tools`` JSON, so both engines
(in process and Spark workers) compute exactly the same values.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_WORD_RE = re.compile(r"\w+", re.UNICODE)


def parse_json(text: str | None) -> Any:
    if text is None or text == "":
        return []
    return orjson.loads(text)


def part_text(part: dict[str, Any]) -> str:
    """Text of one content part as the template sees it (images as a placeholder)."""
    kind = part.get("type")
    if kind in ("text", "reasoning"):
        return str(part.get("text") or "")
    if kind == "image":
        return "<image>"
    return ""


def message_text(msg: dict[str, Any], *, with_reasoning: bool = True) -> str:
    parts = msg.get("content") or []
    return "\n".join(part_text(p) for p in parts
                     if isinstance(p, dict) and (with_reasoning or p.get("type") != "reasoning"))


def render_tool_call(call: dict[str, Any]) -> str:
    """A tool call as text: one line of JSON inside ``<tool_call>`` tags (Hermes style)."""
    body = orjson.dumps({"name": call.get("name", ""), "arguments": _args_value(call)},
                        option=orjson.OPT_SORT_KEYS).decode()
    return f"<tool_call>\n{body}\n</tool_call>"


def _args_value(call: dict[str, Any]) -> Any:
    raw = call.get("arguments", "")
    try:
        return orjson.loads(raw) if isinstance(raw, str) and raw else raw
    except orjson.JSONDecodeError:
        return raw


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Canonical messages as ``{"role", "content": str}`` for a chat template.

    Chat templates only know string content: text parts are joined by newlines, images become
    ``<image>``, tool calls are appended as ``<tool_call>`` JSON lines and tool results are
    wrapped in ``<tool_response>`` so the same conversation always renders the same text.
    """
    out = []
    for msg in messages:
        role = str(msg.get("role", ""))
        text = message_text(msg)
        if role == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(render_tool_call(c) for c in msg["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    return out


def last_assistant_index(messages: list[dict[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i
    return -1


def final_output(messages: list[dict[str, Any]]) -> str:
    """Text of the last assistant turn (without reasoning), or ``""``."""
    i = last_assistant_index(messages)
    return message_text(messages[i], with_reasoning=False).strip() if i >= 0 else ""


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [message_text(m) for m in messages if m.get("role") == "user"]


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """What the model was asked: the user turns (system prompts excluded: they are shared)."""
    return "\n".join(user_texts(messages))


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """Every non-system turn's text, tool calls included: the text near-duplicates compare."""
    out = []
    for msg in template_messages([m for m in messages if m.get("role") != "system"]):
        out.append(msg["content"])
    return "\n".join(out)


def system_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(message_text(m) for m in messages if m.get("role") == "system")


def normalize(text: str) -> str:
    """Case- and whitespace-insensitive form used for exact prompt matching."""
    return " ".join(words(text))


def words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


# -- language -------------------------------------------------------------------------------------
# A small stopword vote, enough for the profile's language mix; scripts decide non-Latin text.
_STOP_TEXT: dict[str, str] = {
    "en": "the and is are you to of in it that for with this what how can i my a an on at be "
          "was have has do does not your me we yet any please thanks thank hello hi will would "
          "could should from when where why there here still so no good morning evening",
    "fr": "le la les et est vous de des un une que pour dans je mon pas ce qui ma mes sur avec "
          "au aux du il elle nous votre vos merci bonjour ai suis où mais plus "
          "encore puis pouvez ça très bonsoir salut appelle",
    "es": "el la los las y es usted de un una que para en yo mi por como no se con del al lo "
          "su sus hola gracias favor está estoy puedo pero muy ya todavía mis qué cuándo dónde "
          "me buenos buenas días muchas llamo",
    "de": "der die das und ist sie zu ein eine nicht ich mein mit für wie was den dem des auf "
          "bitte danke hallo noch kann mir meine ihre sich auch habe bin schon wann wo warum "
          "vielen dank können guten tag morgen abend",
    "it": "il lo la gli e è di un una che per con non io mio come sono ho",
    "pt": "o a os as e é de um uma que para com não eu meu como em do da",
    "nl": "de het een en is van ik niet dat voor met mijn hoe wat je zijn",
}
_STOPWORDS = {code: frozenset(text.split()) for code, text in _STOP_TEXT.items()}
_SCRIPTS = (("zh", re.compile(r"[\u4e00-\u9fff]")), ("ja", re.compile(r"[\u3040-\u30ff]")),
            ("ko", re.compile(r"[\uac00-\ud7af]")), ("ru", re.compile(r"[\u0400-\u04ff]")),
            ("ar", re.compile(r"[\u0600-\u06ff]")), ("hi", re.compile(r"[\u0900-\u097f]")))


def language(text: str) -> str:
    """ISO 639-1 guess for ``text`` ("und" when unsure)."""
    sample = text[:2000]
    for code, pattern in _SCRIPTS:
        if code == "zh" and re.search(r"[\u3040-\u30ff]", sample):
            continue  # kana means Japanese even with kanji
        if len(pattern.findall(sample)) >= 3:
            return code
    toks = words(sample)
    votes = {code: sum(1 for t in toks if t in stop) for code, stop in _STOPWORDS.items()}
    if "¿" in sample or "¡" in sample:
        votes["es"] += 2
    ranked = sorted(votes.values(), reverse=True)
    best = max(votes, key=lambda code: votes[code])
    # Two words decide; one decides a short text when no other language has it too.
    return best if ranked[0] >= 2 or (ranked[0] == 1 and ranked[1] == 0) else "und"
