"""``JudgeResource`` (key ``judge``): which judge scores answers.

One class per judge, chosen per deployment in ``factory/definitions.py``:
``EmbeddedJudgeResource`` (no network: code checks and MiniLM similarity, the embedded default)
and ``LLMJudgeResource`` (any OpenAI-compatible endpoint: the gateway, a vLLM). The assets type
against ``JudgeResource``.
"""

import os
from abc import abstractmethod

import dagster as dg

from factory.evals.judges import EmbeddedJudge, LLMJudge
from factory.gateway.keys import headers_for


class JudgeResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The judge of the eval and rejection-sampling assets."""

    @abstractmethod
    def judge(self) -> EmbeddedJudge | LLMJudge:
        """A judge ready to score."""


class EmbeddedJudgeResource(JudgeResource):
    """The embedded judge: code-checkable criteria by code, the rest by MiniLM similarity."""

    def judge(self) -> EmbeddedJudge:
        return EmbeddedJudge()


class LLMJudgeResource(JudgeResource):
    """A judge model behind ``base_url``; the API key is read from the environment variable
    named by ``api_key_env`` (never stored in config). A judge behind the factory's gateway
    (``base_url`` is the settings' ``$FACTORY_GATEWAY_URL`` + ``/v1``) also sends the factory
    key of the settings (``$FACTORY_GATEWAY_KEY``), which a keyed gateway requires; no other
    endpoint is sent it."""

    base_url: str
    """OpenAI base URL of the endpoint (``http://host:port/v1``)."""
    model: str
    """Judge model name at that endpoint."""
    api_key_env: str | None = None
    max_retries: int = 2
    timeout_s: float = 120.0
    concurrency: int = 4

    def judge(self) -> LLMJudge:
        if not self.base_url or not self.model:
            raise ValueError("judge: the LLM judge needs base_url and model")
        key = None
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"judge.api_key_env: environment variable "
                                 f"{self.api_key_env} is not set")
        headers = headers_for(self.base_url)
        return LLMJudge(base_url=self.base_url, model=self.model, api_key=key,
                        max_retries=self.max_retries, timeout_s=self.timeout_s,
                        concurrency=self.concurrency, headers=headers)
