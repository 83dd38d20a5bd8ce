"""Constrained decoding: a request's ``structured_outputs`` enforced token by token.

The request field is vLLM's (``structured_outputs`` in the body of a chat or text completion,
docs: vLLM's "Structured Outputs"), so one request constrains either server:

- ``{"choice": ["billing", "bug", ...]}``: the completion is exactly one of the strings. A
  trie over each choice's tokenization (the tokenizer's own, ``add_special_tokens=False``: the
  tokens the model was trained to write) allows at each step only the tokens that continue a
  choice, and an end-of-turn token once a whole choice is written. A choice that is a prefix
  of another (``bug``, ``bug report``) may end there or go on.
- ``{"json": SCHEMA}``: the completion is JSON that validates against the JSON Schema, built by
  ``llguidance`` (the grammar engine vLLM ships too, no dependency beyond its wheel) from the
  schema and the tokenizer. As in vLLM, any whitespace may stand between JSON tokens, so a
  model writes ``{"a": 1}`` or ``{"a":1}`` as it was trained; with vLLM's
  ``"disable_any_whitespace": true`` none may (``{"a":1}``), which also keeps a model that
  prefers blanks to every allowed token from spending its budget on them. An object's
  ``properties`` come in the schema's order, in llguidance as in vLLM's other engines
  (``factory.evals.rubric.structured_outputs`` lists them as the references write them).

Any other key of ``structured_outputs`` (vLLM's ``regex``, ``grammar``...) is refused with a
400 that names what this server supports.

A chat request's OpenAI ``tool_choice`` constrains too (``tool_choice_constraint``), as vLLM
enforces it: ``"required"`` makes the reply one or more calls of the request's tools, a named
function (``{"type": "function", "function": {"name": ...}}``) one call of that tool, each in
the trainer's call format (``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``,
calls one per line) with arguments valid against the tool's ``parameters``: an ``llguidance``
Lark grammar around the JSON. ``"auto"`` and ``"none"`` constrain nothing. The evals do not ask
for it: a task whose references call tools also holds answers that call none
(``factory.evals.rubric``), which a required call would forbid.

A constraint is one object per request, advanced by the engine after every token it picks
(``Engine.generate``): the server builds it from the request and the model's tokenizer
(``build_constraint``); the batch keeps its rows apart, so constrained and free requests share
a batch. A token budget (``max_tokens``) can still cut a constrained answer: its
``finish_reason`` is then ``length``, as vLLM's is.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from factory.inference.engine import EngineError, TokenConstraint
from factory.trainer.chat import _call as render_call

SUPPORTED: tuple[str, ...] = ("choice", "json")
"""The ``structured_outputs`` keys that say what to constrain to (one per request)."""
OPTIONS: tuple[str, ...] = ("disable_any_whitespace",)
"""The ``structured_outputs`` keys that say how (vLLM's names)."""


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """A validated ``structured_outputs``: exactly one of its fields is set."""

    choice: tuple[str, ...] | None = None
    """The strings the completion must be one of."""
    json_schema: dict[str, Any] | None = None
    """The JSON Schema the completion must validate against."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between its tokens."""

    def to_request(self) -> dict[str, Any]:
        """The request field as vLLM and this server read it."""
        if self.choice is not None:
            return {"choice": list(self.choice)}
        out: dict[str, Any] = {"json": self.json_schema}
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def parse_structured_outputs(value: Any) -> OutputSpec | None:
    """The request's ``structured_outputs`` (None: not constrained); ``EngineError`` naming the
    field when it is not a mapping with one supported key of the right shape."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EngineError("structured_outputs: must be an object such as "
                          '{"choice": ["yes", "no"]} or {"json": {...schema...}}')
    given = [k for k, v in value.items() if v is not None and k not in OPTIONS]
    unknown = [k for k in given if k not in SUPPORTED]
    if unknown:
        raise EngineError(f"structured_outputs.{unknown[0]}: not supported by this server; "
                          f"supported: {', '.join(SUPPORTED + OPTIONS)}")
    compact = value.get("disable_any_whitespace") or False
    if not isinstance(compact, bool):
        raise EngineError("structured_outputs.disable_any_whitespace: must be a boolean, got "
                          f"{compact!r}")
    if len(given) != 1:
        raise EngineError("structured_outputs: give exactly one of "
                          f"{', '.join(SUPPORTED)}, got {len(given)}")
    if given[0] == "choice":
        choices = value["choice"]
        if not isinstance(choices, list) or not choices \
                or not all(isinstance(c, str) and c for c in choices):
            raise EngineError("structured_outputs.choice: must be a non-empty list of "
                              "non-empty strings")
        return OutputSpec(choice=tuple(dict.fromkeys(choices)))
    schema = value["json"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise EngineError(f"structured_outputs.json: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise EngineError("structured_outputs.json: must be a JSON Schema object")
    return OutputSpec(json_schema=schema, disable_any_whitespace=compact)


class ChoiceConstraint:
    """The completion is one of ``choices``: a trie over their token ids."""

    def __init__(self, choices: Sequence[str], tokenizer: Any, stop_ids: Iterable[int]) -> None:
        self.vocab_size = len(tokenizer)
        self.stops = sorted(set(stop_ids))
        self._children: list[dict[int, int]] = [{}]
        self._ends: set[int] = set()
        for text in choices:
            node = 0
            for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
                nxt = self._children[node].get(int(t))
                if nxt is None:
                    nxt = len(self._children)
                    self._children[node][int(t)] = nxt
                    self._children.append({})
                node = nxt
            self._ends.add(node)
        self._node: int | None = 0

    def mask(self) -> torch.Tensor:
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self._node is None:  # left the trie (a token forced past it): only ending is left
            allowed[self.stops] = True
            return allowed
        allowed[list(self._children[self._node])] = True
        if self._node in self._ends:
            allowed[self.stops] = True
        return allowed

    def advance(self, token_id: int) -> None:
        if self._node is not None:
            self._node = self._children[self._node].get(token_id)


class GrammarConstraint:
    """The completion is in an ``llguidance`` grammar (``where``: the request field it came
    from, for errors)."""

    def __init__(self, grammar: str, tokenizer: Any, stop_ids: Iterable[int], *,
                 where: str) -> None:
        import llguidance

        lltok = _ll_tokenizer(tokenizer, sorted(set(stop_ids)))
        problem = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if problem and not problem.startswith("WARNING"):
            raise EngineError(f"{where}: not a schema this server can enforce: {problem}")
        self.vocab_size = lltok.vocab_size
        self.stops = sorted(set(stop_ids))
        self._matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)

    def mask(self) -> torch.Tensor:
        bias = self._matcher.compute_logit_bias()  # one byte per token: 0 or 200 (allowed)
        return torch.frombuffer(bytearray(bias), dtype=torch.uint8) > 0

    def advance(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)


class JSONConstraint(GrammarConstraint):
    """The completion is JSON valid against a schema."""

    def __init__(self, schema: dict[str, Any], tokenizer: Any, stop_ids: Iterable[int], *,
                 compact: bool = False) -> None:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not compact})
        except ValueError as e:
            raise EngineError(f"structured_outputs.json: {e}") from None
        super().__init__(grammar, tokenizer, stop_ids, where="structured_outputs.json")


def _sorted_properties(schema: Any) -> Any:
    """``schema`` with every object's ``properties`` in key order: canonical arguments are JSON
    with sorted keys, and the grammar writes properties in the schema's order."""
    if isinstance(schema, list):
        return [_sorted_properties(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _sorted_properties(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = dict(sorted(out["properties"].items()))
    return out


def tool_call_grammar(tools: Sequence[dict[str, Any]], *, name: str | None = None) -> str:
    """The Lark grammar of a reply made of calls in the trainer's format, byte for byte as it
    renders them (``factory.trainer.chat``: ``{"name": "...", "arguments": ARGS}``, ARGS the
    canonical compact JSON with sorted keys): one or more calls of any of ``tools`` (canonical:
    ``{name, description, parameters}``), one per line, or with ``name`` exactly one call of
    that tool; arguments valid against the tool's ``parameters`` (any object where it has
    none)."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    rules = []
    for k, tool in enumerate(chosen):
        params = _sorted_properties(tool.get("parameters") or {"type": "object"})
        params = {**params, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                           "key_separator": ":"}}
        # The text around the arguments is the trainer's own rendering of a call to this tool.
        head, _, tail = render_call({"name": tool["name"], "arguments": "\0"}).partition("\0")
        rules.append(f"call{k}: {json.dumps(head, ensure_ascii=False)} %json "
                     f"{json.dumps(params, ensure_ascii=False)} "
                     f"{json.dumps(tail, ensure_ascii=False)}")
    call = " | ".join(f"call{k}" for k in range(len(chosen)))
    # The trainer puts a newline between calls.
    start = f"({call})" if name is not None else f'({call}) ("\\n" ({call}))*'
    return "\n".join([f"start: {start}", *rules]) + "\n"


def tool_choice_constraint(tool_choice: Any, tools: Sequence[dict[str, Any]], tokenizer: Any,
                           stop_ids: Iterable[int]) -> TokenConstraint | None:
    """A chat request's ``tool_choice`` over its canonical ``tools`` as a constraint (None for
    ``auto``, ``none`` or none given); ``EngineError`` naming the field when it is not one of
    OpenAI's forms, names no tool of the request, or asks for a call with no tools."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    name: str | None = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise EngineError('tool_choice: a named tool is {"type": "function", "function": '
                              '{"name": "..."}}')
        name = fn["name"]
    elif tool_choice != "required":
        raise EngineError('tool_choice: must be "auto", "none", "required" or {"type": '
                          f'"function", "function": {{"name": "..."}}}}, got {tool_choice!r}')
    if not tools:
        raise EngineError(f"tool_choice: {json.dumps(tool_choice)} needs tools in the request")
    if name is not None and name not in {t["name"] for t in tools}:
        raise EngineError(f"tool_choice.function.name: the request has no tool {name!r} "
                          f"(tools: {', '.join(t['name'] for t in tools)})")
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(tools, name=name))
    except ValueError as e:
        raise EngineError(f"tool_choice: {e}") from None
    return GrammarConstraint(grammar, tokenizer, stop_ids, where="tool_choice")


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = \
    weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Any, stops: list[int]) -> Any:
    """``llguidance``'s view of ``tokenizer`` ending at ``stops``, built once per tokenizer
    (~1 s for SmolLM2's 49k tokens)."""
    import llguidance.hf

    key = tuple(stops)
    with _LL_LOCK:
        per = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(stops))
            except ValueError as e:  # a slow (Python) tokenizer
                raise EngineError(f"structured_outputs.json: {e}") from None
        return per[key]


def build_constraint(spec: OutputSpec, tokenizer: Any, stop_ids: Iterable[int]
                     ) -> TokenConstraint:
    """A fresh constraint of ``spec`` over ``tokenizer``'s tokens, ending at ``stop_ids`` (the
    model's end-of-sequence and end-of-turn tokens)."""
    if spec.choice is not None:
        return ChoiceConstraint(spec.choice, tokenizer, stop_ids)
    assert spec.json_schema is not None
    return JSONConstraint(spec.json_schema, tokenizer, stop_ids,
                          compact=spec.disable_any_whitespace)
