"""A small synchronous client for the servers ``InferenceServer`` starts (CPU server or vLLM).

Plain httpx, so it also works against the gateway or any OpenAI-compatible endpoint; the
official ``openai`` SDK works against the same servers (tests/inference checks it). It sends only
the requests of the serving protocol (``factory.inference.contract``, docs/serving-protocol.md)
and reads only the fields written there, so what works against the CPU server works against
``vllm serve`` (tests/inference/test_client_contract.py runs it against a stand-in that serves
exactly those shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from factory.errors import FactoryError
from factory.inference.contract import TOKEN_ID_PREFIX
from factory.normalize.request import ImageURL, wire_messages, wire_tools


class InferenceClientError(FactoryError):
    """The server answered with an error."""


class InferenceClient:
    """OpenAI-compatible calls plus vLLM's adapter endpoints and extra parameters."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0, image_url: ImageURL | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.image_url = image_url
        """How canonical image parts are sent (a vision-language model's server:
        ``protocol.image_data_urls``); None: as the ``[image]`` text of text-only models."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self.http.close()

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        r = self.http.post(self.base_url + path, json=body)
        if r.status_code >= 400:
            raise InferenceClientError(f"POST {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r

    def models(self) -> list[str]:
        r = self.http.get(self.base_url + "/models")
        r.raise_for_status()
        return [m["id"] for m in r.json()["data"]]

    def load_adapter(self, name: str, path: str) -> None:
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self._post("/unload_lora_adapter", {"lora_name": name})

    def chat(self, model: str, messages: list[dict[str, Any]], *,
             tools: list[dict[str, Any]] | None = None, max_tokens: int = 256,
             **extra: Any) -> dict[str, Any]:
        """One non-streaming chat completion (the full response object). ``messages`` and
        ``tools`` may be canonical: they are sent as the protocol carries them
        (``factory.inference.protocol.wire_messages``, images as ``image_url`` parts when the
        client has ``image_url``)."""
        body: dict[str, Any] = {"model": model,
                                "messages": wire_messages(messages, self.image_url),
                                "max_tokens": max_tokens, "temperature": 0, **extra}
        if tools:
            body["tools"] = wire_tools(tools)
        result: dict[str, Any] = self._post("/chat/completions", body).json()
        return result

    def chat_many(self, model: str, conversations: Sequence[dict[str, Any]], *,
                  max_tokens: int = 256, concurrency: int = 8) -> list[dict[str, Any]]:
        """Completions for many ``{"messages", "tools"?}`` prompts, in order; sent concurrently
        so the server can batch them."""
        def one(conv: dict[str, Any]) -> dict[str, Any]:
            return self.chat(model, conv["messages"], tools=conv.get("tools") or None,
                             max_tokens=max_tokens)

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, conversations))

    def complete(self, model: str, prompt: str | Sequence[int], *, max_tokens: int = 16,
                 **extra: Any) -> dict[str, Any]:
        """One text completion of ``prompt`` (text, or token ids used as they are) (the full
        response object)."""
        body: dict[str, Any] = {"model": model, "prompt": prompt if isinstance(prompt, str)
                                else list(prompt), "max_tokens": max_tokens, "temperature": 0,
                                **extra}
        result: dict[str, Any] = self._post("/completions", body).json()
        return result

    def rendered_ids(self, model: str, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of the whole conversation as the server renders it for ``model``: a
        chat completion with vLLM's ``add_generation_prompt: false`` (the conversation ends
        with its last message, as in training) and ``return_token_ids`` (the response's
        ``prompt_token_ids``); the one generated token is not read."""
        body: dict[str, Any] = {"add_generation_prompt": False, "return_token_ids": True}
        out = self.chat(model, messages, tools=tools, max_tokens=1, **body)
        ids = out.get("prompt_token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InferenceClientError(
                "POST /chat/completions: no prompt_token_ids in the response to "
                "return_token_ids (vLLM returns them since 0.10.2)")
        return ids

    def chat_prompt_logprobs(self, model: str, messages: list[dict[str, Any]],
                             tools: list[dict[str, Any]] | None = None
                             ) -> tuple[list[int], list[float]]:
        """(the token ids of the whole conversation as the server renders it, ``out[i]``: the
        log-probability of id ``i + 1`` given those before it), from one chat completion with
        ``add_generation_prompt: false``, ``return_token_ids`` and vLLM's ``prompt_logprobs``.
        The gate's path for prompts a text completion cannot carry (images: the ids alone
        have no pixels)."""
        body: dict[str, Any] = {"add_generation_prompt": False, "return_token_ids": True,
                                "prompt_logprobs": 0}
        out = self.chat(model, messages, tools=tools, max_tokens=1, **body)
        ids, entries = out.get("prompt_token_ids"), out.get("prompt_logprobs")
        try:
            assert isinstance(ids, list) and isinstance(entries, list)
            assert len(entries) == len(ids)
            values = [float(entries[i][str(ids[i])]["logprob"]) for i in range(1, len(ids))]
        except (AssertionError, KeyError, TypeError, ValueError):
            raise InferenceClientError(
                "POST /chat/completions: the response to return_token_ids and prompt_logprobs "
                "has no prompt_token_ids with one prompt_logprobs entry per token") from None
        return ids, values

    def prompt_logprobs(self, model: str, token_ids: Sequence[int]) -> list[float]:
        """``out[i]``: the log-probability of ``token_ids[i + 1]`` given ``token_ids[:i + 1]``,
        as ``model`` on the server computes it (one fewer than the ids: the first token has
        none). Asked as a text completion of the ids with ``echo``, ``logprobs`` and
        ``max_tokens: 0``: the ids are the prompt, so the server scores exactly these tokens,
        and they are echoed back as ids (``return_tokens_as_token_ids``) to prove it."""
        ids = list(token_ids)
        out = self.complete(model, ids, max_tokens=0, echo=True, logprobs=1,
                            return_tokens_as_token_ids=True)
        lp = (out.get("choices") or [{}])[0].get("logprobs") or {}
        tokens, values = lp.get("tokens"), lp.get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(values, list) \
                or len(tokens) < len(ids) or len(values) < len(ids) \
                or not all(isinstance(v, int | float) for v in values[1:len(ids)]):
            raise InferenceClientError(
                "POST /completions: the response to echo + logprobs has no log-prob for every "
                f"prompt token after the first ({len(ids)} sent)")
        echoed = [t[len(TOKEN_ID_PREFIX):] if isinstance(t, str) else t
                  for t in tokens[:len(ids)]]
        if echoed != [str(t) for t in ids]:
            raise InferenceClientError("POST /completions: the server echoed other tokens than "
                                       "the prompt's ids it was sent")
        return [float(v) for v in values[1:len(ids)]]
