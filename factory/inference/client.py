"""A small synchronous client for the servers ``InferenceServer`` starts (CPU server or vLLM).

Plain httpx, so it also works against the gateway or any OpenAI-compatible endpoint; the
official ``openai`` SDK works against the same servers (tests/inference checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from factory.errors import FactoryError


class InferenceClientError(FactoryError):
    """The server answered with an error."""


class InferenceClient:
    """OpenAI-compatible calls plus vLLM's adapter endpoints and the CPU server's ``/v1/score``."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
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
        """One non-streaming chat completion (the full response object)."""
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, **extra}
        if tools:
            body["tools"] = tools
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

    def score(self, model: str, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Per-token log-probs of the whole conversation as the server renders it."""
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools
        result: dict[str, Any] = self._post("/score", body).json()
        return result
