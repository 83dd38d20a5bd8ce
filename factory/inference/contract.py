"""The serving protocol as data: the requests the factory sends to an inference server and the
responses it reads, each a JSON Schema of vLLM's OpenAI-compatible server's own shapes.

``docs/serving-protocol.md`` says where each shape comes from in vLLM's documentation and
source, and what the factory uses it for. The factory's CPU server answers these requests with
these shapes (tests/inference/test_contract.py); the factory's clients send only these requests
and read only these fields (tests/inference/test_client_contract.py, against a stand-in server
that serves exactly these shapes), so either side can be swapped for ``vllm serve``.

Request schemas are closed (``additionalProperties: false``): a field the factory starts to send
must be written here first, after checking that vLLM accepts it. Response schemas are open: vLLM
adds fields of its own (``stop_reason``, ``kv_transfer_params``, ...) and readers ignore them.
"""

from __future__ import annotations

from typing import Any

from factory.errors import FactoryError

_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_NUM = {"type": "number"}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP = {"anyOf": [_STR, {"type": "array", "items": _STR}]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT,
                         "total_tokens": _INT}}

_PROMPT_LOGPROBS: dict[str, Any] = {
    "type": "array",
    "items": {"anyOf": [{"type": "null"}, {
        "type": "object", "minProperties": 1,
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {
            "type": "object", "required": ["logprob", "rank"],
            "properties": {"logprob": _NUM, "rank": {"type": ["integer", "null"]},
                           "decoded_token": {"type": ["string", "null"]}}}}]},
}
"""vLLM's ``prompt_logprobs``: per prompt token, null for the first, else a map from token id
(a JSON string) to ``{logprob, rank, decoded_token}`` holding the prompt's own token first and
then the ``prompt_logprobs`` most likely ones."""

_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"],
              "properties": {"id": _STR, "type": {"const": "function"},
                             "function": {"type": "object", "required": ["name", "arguments"],
                                          "properties": {"name": _STR, "arguments": _STR}}}}

_CHAT_LOGPROB: dict[str, Any] = {"type": "object", "required": ["token", "logprob"],
                 "properties": {"token": _STR, "logprob": _NUM,
                                "bytes": {"type": ["array", "null"], "items": _INT}}}

_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": _STR}}
_MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [_STR, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
        "tool_calls": {"type": "array", "items": {
            "type": "object", "required": ["id", "type", "function"],
            "properties": {"id": _STR, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "properties": {"name": _STR, "arguments": _STR}}}}},
        "tool_call_id": _STR}}
"""A message as the factory sends it: text only (``factory.normalize.request.wire_messages``
writes canonical reasoning and image parts as the text the trainer renders for them)."""

SCHEMAS: dict[str, dict[str, Any]] = {
    # GET /v1/models
    "models.response": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object"],
            "properties": {"id": _STR, "object": {"const": "model"},
                           "root": {"type": ["string", "null"]},
                           "parent": {"type": ["string", "null"]}}}}}},
    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (success: 200, a plain-text line)
    "load_lora_adapter.request": {
        "type": "object", "required": ["lora_name", "lora_path"], "additionalProperties": False,
        "properties": {"lora_name": _STR, "lora_path": _STR}},
    "unload_lora_adapter.request": {
        "type": "object", "required": ["lora_name"], "additionalProperties": False,
        "properties": {"lora_name": _STR}},
    # POST /v1/chat/completions
    "chat.request": {
        "type": "object", "required": ["model", "messages"], "additionalProperties": False,
        "properties": {
            "model": _STR, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "tools": {"type": "array", "items": {
                "type": "object", "required": ["type", "function"],
                "properties": {"type": {"const": "function"}, "function": {
                    "type": "object", "required": ["name"], "properties": {"name": _STR}}}}},
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                      {"type": "object"}]},
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "temperature": _NUM, "top_p": _NUM, "seed": _INT, "stop": _STOP,
            "n": {"const": 1},
            "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0},
            "stream": _BOOL,
            "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
            # vLLM's extra parameters for the Chat API
            "add_generation_prompt": _BOOL,
            "return_token_ids": _BOOL,
            "prompt_logprobs": {"type": "integer", "minimum": 0}}},
    "chat.response": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": _INT,
                    "message": {
                        "type": "object", "required": ["role", "content"],
                        "properties": {"role": {"const": "assistant"},
                                       "content": {"type": ["string", "null"]},
                                       "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
                    "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                    "logprobs": {"anyOf": [{"type": "null"}, {
                        "type": "object", "required": ["content"],
                        "properties": {"content": {"type": "array", "items": {
                            **_CHAT_LOGPROB, "required": ["token", "logprob", "top_logprobs"],
                            "properties": {**_CHAT_LOGPROB["properties"],
                                           "top_logprobs": {"type": "array",
                                                            "items": _CHAT_LOGPROB}}}}}}]},
                    "token_ids": {"anyOf": [{"type": "null"}, _TOKEN_IDS]}}}},
            "usage": _USAGE,
            "prompt_token_ids": {"anyOf": [{"type": "null"}, _TOKEN_IDS]},
            "prompt_logprobs": {"anyOf": [{"type": "null"}, _PROMPT_LOGPROBS]}}},
    "chat.chunk": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "object": {"const": "chat.completion.chunk"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "delta"],
                "properties": {"delta": {"type": "object"},
                               "finish_reason": {"enum": [None, "stop", "length",
                                                          "tool_calls"]}}}},
            "usage": {"anyOf": [{"type": "null"}, _USAGE]},
            "prompt_token_ids": {"anyOf": [{"type": "null"}, _TOKEN_IDS]}}},
    # POST /v1/completions
    "completion.request": {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
        "properties": {
            "model": _STR,
            # One prompt per request: text, or token ids (tokenization decided by the caller).
            "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                 {**_TOKEN_IDS, "minItems": 1}]},
            "max_tokens": {"type": "integer", "minimum": 0},
            "echo": _BOOL, "logprobs": {"type": "integer", "minimum": 0},
            "temperature": _NUM, "top_p": _NUM, "seed": _INT, "stop": _STOP,
            "n": {"const": 1},
            # vLLM's extra parameters for the Completions API
            "prompt_logprobs": {"type": "integer", "minimum": 0},
            "return_token_ids": _BOOL, "return_tokens_as_token_ids": _BOOL}},
    "completion.response": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {
                    "index": _INT, "text": _STR,
                    "finish_reason": {"enum": ["stop", "length", None]},
                    "logprobs": {"anyOf": [{"type": "null"}, {
                        "type": "object",
                        "required": ["text_offset", "token_logprobs", "tokens", "top_logprobs"],
                        "properties": {
                            "text_offset": {"type": "array", "items": _INT},
                            "token_logprobs": {"type": "array",
                                               "items": {"type": ["number", "null"]}},
                            "tokens": {"type": "array", "items": _STR},
                            "top_logprobs": {"type": "array", "items": {
                                "anyOf": [{"type": "null"}, {
                                    "type": "object", "additionalProperties": _NUM}]}}}}]},
                    "prompt_logprobs": {"anyOf": [{"type": "null"}, _PROMPT_LOGPROBS]},
                    "prompt_token_ids": {"anyOf": [{"type": "null"}, _TOKEN_IDS]},
                    "token_ids": {"anyOf": [{"type": "null"}, _TOKEN_IDS]}}}},
            "usage": _USAGE}},
    # Any 4xx/5xx JSON body
    "error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type", "code"],
                                 "properties": {"message": _STR, "type": _STR, "code": _INT}}}},
}
"""Every shape of the protocol by name (``<endpoint>.request`` / ``<endpoint>.response``)."""

TOKEN_ID_PREFIX = "token_id:"
"""How ``return_tokens_as_token_ids`` writes a token in ``logprobs.tokens``: ``token_id:123``."""


class ContractError(FactoryError):
    """A request or response outside the serving protocol."""


def check(name: str, obj: Any) -> Any:
    """``obj`` if it has the shape ``SCHEMAS[name]``, else ``ContractError`` naming the first
    field that does not (as a JSON path)."""
    import jsonschema

    try:
        jsonschema.validate(obj, SCHEMAS[name])
    except jsonschema.ValidationError as e:
        raise ContractError(f"{name}: {e.json_path}: {e.message}") from None
    return obj
