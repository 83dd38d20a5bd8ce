"""Canonical samples to model text, the same way for training and for inference.

One rendering of the canonical sample (docs/canonical-sample.md) per chat format, shipped twice:
as Python (``render``, ``encode``: training, with the label mask) and as a Jinja chat template
(``chat_template(fmt)``) saved with every checkpoint's tokenizer, so ``apply_chat_template`` in
transformers or vLLM produces the identical string (tests/trainer/test_chat.py checks that).

The format belongs to the base model's tokenizer (``chat_format``): the one whose turn tokens
are single tokens of its vocabulary. Two exist:

- ``CHATML`` (SmolLM2, Qwen3, Qwen2.5-VL: ``<|im_start|>`` / ``<|im_end|>``). SmolLM2's shipped
  template only handles string content and knows nothing of tools; Qwen's render tools in the
  same Hermes style as this one. The factory's own template is used for every ChatML model.
- ``GEMMA`` (Gemma 3: ``<start_of_turn>`` / ``<end_of_turn>``, conversations open with
  ``<bos>``, the assistant's role is ``model``). Gemma 3 270M is a base model whose GGUF ships
  no chat template; Gemma 3's instruction-tuned template folds the system prompt into the first
  user turn and has no tools, so the factory keeps Gemma's turn tokens (single special tokens of
  its vocabulary; ``<end_of_turn>`` is what Gemma's instruction-tuned models stop on) with a
  system turn of its own and the same tool blocks as ChatML (vLLM's ``hermes`` parser reads
  them for both).

Format (``\\n`` is a newline; ``S``/``E`` the turn tokens, ``B`` the opening text)::

    B S system\\n{system text}[\\n\\n]{tools block}E\\n   (first system msg and/or tools)
    S user\\n{parts}E\\n
    S assistant\\n{parts}[\\n]<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>E\\n
    S tool\\n<tool_response>\\n{parts}\\n</tool_response>E\\n

Parts are joined with ``\\n``: text as is, reasoning as ``<think>\\n...\\n</think>``, images as
``[image]`` for text-only models; a vision-language model's image is its placeholder
(``trainer.vision``: Qwen's ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch +
``<|vision_end|>``), passed in as ``image`` because its length depends on the image. The Jinja
twin of a vision model (``chat_template(fmt, vision=True)``) writes one ``<|image_pad|>`` per
image, as Qwen's own template and vLLM expect; the server expands it (``vision.expand_pads``).
Tool calls carry no ids: tool results follow the calls in order, and ``parse_assistant``
renumbers ``call_0, call_1, ...`` exactly like the canonical form does.
Loss is on assistant turns only: everything after ``S assistant\\n`` up to and including ``E``
(so the model learns to stop), tool calls included; never system, user or tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n"
              "<tools>\n")
TOOLS_TAIL = ("</tools>\n\nFor each function call, return a json object with function name and "
              "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True, kw_only=True)
class ChatFormat:
    """The tokens one family's rendering is made of."""

    name: str
    """``chatml`` or ``gemma``."""
    begin: str
    """Text opening every rendered conversation (Gemma's ``<bos>``; empty for ChatML)."""
    turn_start: str
    """Opens a turn, followed by the role and a newline."""
    turn_end: str
    """Ends a turn (trained at the end of assistant turns: the model's stop token)."""
    assistant_role: str
    """The assistant's role name in the text."""


CHATML = ChatFormat(name="chatml", begin="", turn_start=IM_START, turn_end=IM_END,
                    assistant_role="assistant")
GEMMA = ChatFormat(name="gemma", begin="<bos>", turn_start="<start_of_turn>",
                   turn_end="<end_of_turn>", assistant_role="model")
FORMATS = (GEMMA, CHATML)
"""Every format, in the order ``chat_format`` tries them."""


def _has_token(tokenizer: Any, token: str) -> bool:
    if _is_backend(tokenizer):
        return tokenizer.token_to_id(token) is not None
    tid = tokenizer.convert_tokens_to_ids(token)
    return isinstance(tid, int) and tid != tokenizer.unk_token_id


def chat_format(tokenizer: Any) -> ChatFormat:
    """The format of the base model behind ``tokenizer`` (a transformers tokenizer or a
    ``tokenizers.Tokenizer``): the first of ``FORMATS`` whose turn tokens are single tokens of its
    vocabulary (``CHATML`` for None). ``ValueError`` when none is."""
    if tokenizer is None:
        return CHATML
    for fmt in FORMATS:
        if _has_token(tokenizer, fmt.turn_start) and _has_token(tokenizer, fmt.turn_end):
            return fmt
    raise ValueError("tokenizer: its vocabulary has the turn tokens of no chat format ("
                     + "; ".join(f"{f.name}: {f.turn_start} {f.turn_end}" for f in FORMATS)
                     + ")")


def _lit(text: str) -> str:
    """A Jinja string literal for ``text``."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""An image in the Jinja twin of a vision model: one pad, expanded to the image's tokens."""


def chat_template(fmt: ChatFormat, *, vision: bool = False) -> str:
    """The Jinja twin of ``render`` in format ``fmt``; ``vision``: images as
    ``VISION_PLACEHOLDER`` (a vision-language base model), else as ``[image]``."""
    begin = "{{ " + _lit(fmt.begin) + " }}" if fmt.begin else ""
    template = _TEMPLATE.replace("{{ '[image]' }}", "{{ " + _lit(VISION_PLACEHOLDER) + " }}") \
        if vision else _TEMPLATE
    return (template.replace(_BEGIN, begin).replace("<|im_start|>", fmt.turn_start)
            .replace("<|im_end|>", fmt.turn_end)
            .replace("<|assistant|>", fmt.assistant_role))


_BEGIN = "{#- begin -#}"
_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- elif part.type == 'reasoning' -%}{{ '<think>\\n' + part.text + '\\n</think>' }}"
    "{%- elif part.type == 'image' or part.type == 'image_url' -%}{{ '[image]' }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_call(call) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{ '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string -%}{{ fn.arguments }}"
    "{%- else -%}{{ fn.arguments | tojson(separators=(',', ':'), sort_keys=True) }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set sys = render_content(messages[0].content) -%}{%- set first = 1 -%}"
    "{%- else -%}{%- set sys = '' -%}{%- set first = 0 -%}{%- endif -%}"
    "{%- if tools -%}"
    "{%- set toolblock -%}" + "{{ " + _lit(TOOLS_HEAD) + " }}"
    "{%- for t in tools -%}"
    "{{ (t.function if t.function is defined else t) | tojson(sort_keys=True) }}{{ '\\n' }}"
    "{%- endfor -%}" + "{{ " + _lit(TOOLS_TAIL) + " }}" + "{%- endset -%}"
    "{%- if sys -%}{%- set sys = sys + '\\n\\n' + toolblock -%}"
    "{%- else -%}{%- set sys = toolblock -%}{%- endif -%}"
    "{%- endif -%}"
    + _BEGIN +
    "{%- if first == 1 or tools -%}{{ '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages[first:] -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|><|assistant|>\\n' }}{%- set body = render_content(m.content) -%}{{ body }}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{%- if body or not loop.first %}{{ '\\n' }}{% endif -%}{{ render_call(c) }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + render_content(m.content)"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + render_content(m.content) + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|><|assistant|>\\n' }}{%- endif -%}"
)

CHAT_TEMPLATE = chat_template(CHATML)
"""The ChatML template; ``install_chat_template`` puts the tokenizer's format's on it."""


def _loads(value: Any, name: str) -> Any:
    if isinstance(value, str | bytes):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not JSON ({e})") from None
    return value


ImageText = Callable[[dict[str, Any]], str]
"""Renders one image part (``[image]`` for text-only models)."""


def text_only_image(part: dict[str, Any]) -> str:
    return "[image]"


def _content(content: Any, image: ImageText = text_only_image) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"content: must be a list of parts, got {type(content).__name__}")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(part["text"])
        elif kind == "reasoning":
            out.append("<think>\n" + part["text"] + "\n</think>")
        elif kind in ("image", "image_url"):
            out.append(image(part))
        else:
            raise ValueError(f"content: unknown part type {kind!r}")
    return "\n".join(out)


def _call(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn["arguments"]
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return ('<tool_call>\n{"name": ' + json.dumps(fn["name"], ensure_ascii=False)
            + ', "arguments": ' + args + "}\n</tool_call>")


def segments(messages: Any, tools: Any = None, *, add_generation_prompt: bool = False,
             fmt: ChatFormat = CHATML, image: ImageText = text_only_image
             ) -> list[tuple[str, bool]]:
    """The rendered text as ``(text, trainable)`` pieces; joined they equal ``render``.
    ``image`` renders each image part, called in the order the parts appear in the text."""
    messages = _loads(messages, "messages")
    tools = _loads(tools, "tools") or []
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    start, end = fmt.turn_start, fmt.turn_end
    out: list[tuple[str, bool]] = [(fmt.begin, False)] if fmt.begin else []
    first = 0
    system = ""
    if messages[0].get("role") == "system":
        system = _content(messages[0].get("content"), image)
        first = 1
    if tools:
        block = TOOLS_HEAD + "".join(
            json.dumps(t.get("function", t), ensure_ascii=False, sort_keys=True) + "\n"
            for t in tools) + TOOLS_TAIL
        system = system + "\n\n" + block if system else block
    if first or tools:
        out.append((f"{start}system\n{system}{end}\n", False))
    for m in messages[first:]:
        role = m.get("role")
        if role == "assistant":
            body = _content(m.get("content"), image)
            calls = m.get("tool_calls") or []
            for i, call in enumerate(calls):
                body += ("\n" if body or i else "") + _call(call)
            out.append((f"{start}{fmt.assistant_role}\n", False))
            out.append((body + end, True))
            out.append(("\n", False))
        elif role == "tool":
            out.append((f"{start}tool\n<tool_response>\n{_content(m.get('content'), image)}"
                        f"\n</tool_response>{end}\n", False))
        elif role in ("system", "user"):
            out.append((f"{start}{role}\n{_content(m.get('content'), image)}{end}\n", False))
        else:
            raise ValueError(f"messages: unknown role {role!r}")
    if add_generation_prompt:
        out.append((f"{start}{fmt.assistant_role}\n", False))
    return out


def render(messages: Any, tools: Any = None, tokenizer: Any = None, *,
           add_generation_prompt: bool = False, image: ImageText = text_only_image) -> str:
    """Canonical ``messages``/``tools`` (lists or their JSON strings) to the model's text, in
    the format of ``tokenizer`` (``chat_format``; ChatML without one)."""
    return "".join(t for t, _ in segments(messages, tools, fmt=chat_format(tokenizer),
                                          add_generation_prompt=add_generation_prompt,
                                          image=image))


def spans(messages: Any, tools: Any = None, *, fmt: ChatFormat = CHATML,
          image: ImageText = text_only_image) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its assistant (trained) pieces."""
    segs = segments(messages, tools, fmt=fmt, image=image)
    out: list[tuple[int, int]] = []
    pos = 0
    for t, trainable in segs:
        if trainable:
            out.append((pos, pos + len(t)))
        pos += len(t)
    return "".join(t for t, _ in segs), out


def common_prefix(rows: Sequence[Sequence[int]], limit: int | None = None) -> int:
    """How many leading tokens all ``rows`` share (at most ``limit``): what ``share_prefix``
    computes once (``trainer.data.shared_prefix_length``, and curation's measure of it)."""
    if not rows:
        return 0
    n = min(len(r) for r in rows)
    if limit is not None:
        n = min(n, max(limit, 0))
    first = rows[0]
    for r in rows[1:]:
        k = 0
        while k < n and r[k] == first[k]:
            k += 1
        n = k
        if not n:
            break
    return n


def label_ids(ids: Sequence[int], offsets: Sequence[tuple[int, int]],
              trained: Sequence[tuple[int, int]]) -> list[int]:
    """``labels`` for tokens ``ids`` at character ``offsets``: a token is trained when its last
    character lies in one of the ``trained`` spans, else ``IGNORE_INDEX``."""
    labels = []
    span_i = 0
    for tok, (start, end) in zip(ids, offsets, strict=True):
        last = end - 1
        while span_i < len(trained) and trained[span_i][1] <= last:
            span_i += 1
        inside = end > start and span_i < len(trained) and trained[span_i][0] <= last
        labels.append(tok if inside else IGNORE_INDEX)
    return labels


def _is_backend(tokenizer: Any) -> bool:
    """True for a ``tokenizers.Tokenizer`` (the Rust backend), False for a transformers one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    return isinstance(tokenizer, Tokenizer)


def encode(messages: Any, tools: Any, tokenizer: Any, *, max_len: int | None = None,
           image: ImageText = text_only_image) -> tuple[list[int], list[int]]:
    """Token ids and labels (``IGNORE_INDEX`` outside assistant turns) of one sample.

    The whole text is tokenized once, exactly as at inference; a token is trained when its last
    character lies in an assistant span. ``labels[i]`` is the target *at* position i (the caller
    shifts). ``tokenizer`` is a transformers tokenizer or a ``tokenizers.Tokenizer`` (what
    curation loads: the same backend, so the same ids; tests/curation/test_tokens.py holds the
    two equal). ``image`` renders image parts (``trainer.vision`` for vision-language models).
    """
    text, trained = spans(messages, tools, fmt=chat_format(tokenizer), image=image)
    if _is_backend(tokenizer):
        enc = tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), enc.offsets
    else:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(out["input_ids"]), out["offset_mapping"]
    labels = label_ids(ids, offsets, trained)
    if max_len is not None:
        ids, labels = ids[:max_len], labels[:max_len]
    return ids, labels


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_THINK = re.compile(r"^<think>\n(.*?)\n</think>\n?", re.S)


def parse_assistant(text: str) -> dict[str, Any]:
    """Generated assistant text back to a canonical assistant message.

    Tool calls get ids ``call_0, call_1, ...`` in order; arguments are re-serialized canonically
    (compact, sorted keys) when they parse as JSON. A call that is not valid JSON stays in the
    text, so nothing the model said is lost.
    """
    for fmt in FORMATS:
        text = text.split(fmt.turn_end, 1)[0]
    parts: list[dict[str, Any]] = []
    think = _THINK.match(text)
    if think:
        parts.append({"type": "reasoning", "text": think.group(1)})
        text = text[think.end():]
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            args = obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        calls.append({"id": f"call_{len(calls)}", "name": name, "arguments": args})
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    body = "".join(kept).strip("\n") if calls else "".join(kept)
    if body:
        parts.append({"type": "text", "text": body})
    msg: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        msg["tool_calls"] = calls
    return msg


def install_chat_template(tokenizer: Any, *, vision: bool = False) -> Any:
    """Put the template of its format on ``tokenizer`` (saved with it as chat_template.jinja);
    ``vision`` for the tokenizer of a vision-language model (``trainer.vision.has_vision``)."""
    tokenizer.chat_template = chat_template(chat_format(tokenizer), vision=vision)
    return tokenizer


def load_tokenizer(base_model: str) -> Any:
    """``base_model``'s tokenizer, its pad token the end-of-sequence token where it has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
