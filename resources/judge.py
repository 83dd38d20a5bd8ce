"""``JudgeResource`` (key ``judge``): the embedded judge by default, an LLM judge when configured."""

import os
from typing import Any

import dagster as dg

from factory.evals.judges import EmbeddedJudge, LLMJudge


class JudgeResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Which judge scores answers. ``kind="llm"`` needs ``base_url`` (any OpenAI-compatible
    endpoint: the gateway, a vLLM) and ``model``; the API key is read from the environment
    variable named by ``api_key_env`` (never stored in config)."""

    kind: str = "embedded"
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    max_retries: int = 2
    timeout_s: float = 120.0
    concurrency: int = 4

    def judge(self) -> Any:
        if self.kind == "embedded":
            return EmbeddedJudge()
        if self.kind != "llm":
            raise ValueError(f"judge.kind: must be 'embedded' or 'llm', got {self.kind!r}")
        if not self.base_url or not self.model:
            raise ValueError("judge: kind 'llm' needs base_url and model")
        key = None
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"judge.api_key_env: environment variable "
                                 f"{self.api_key_env} is not set")
        return LLMJudge(base_url=self.base_url, model=self.model, api_key=key,
                        max_retries=self.max_retries, timeout_s=self.timeout_s,
                        concurrency=self.concurrency)
