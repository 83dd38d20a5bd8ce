"""The comparison page's vibe check: one prompt sent to both models of an experiment at once,
the frontier through the gateway with the factory key of the settings
(``$FACTORY_GATEWAY_KEY``), the candidate on its own server."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx

from factory.deploy import Deployer
from factory.gateway.keys import client_headers
from factory.gateway.shadow import ShadowRule, load_shadows
from factory.lake import Lake

VIBE_TAGS = "source=compare-vibe-check"
"""``X-Factory-Tags`` of the vibe check's frontier call: the gateway captures it like any call,
and this tag lets an experiment's data filter leave it out."""
VIBE_TIMEOUT_S = 120.0
VIBE_MAX_TOKENS = 512


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where one side of the vibe check is asked."""

    label: str
    base_url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Reply:
    text: str | None
    error: str | None
    latency_ms: float


def _rule(lake: Lake, experiment: str) -> ShadowRule | None:
    return next((r for r in load_shadows(lake).values() if r.experiment == experiment), None)


def vibe_targets(lake: Lake, experiment: str, gateway_url: str
                 ) -> tuple[Target | str, Target | str]:
    """The frontier (through the gateway, by the shadowed model name, with the factory key of
    ``lake``'s settings) and the candidate (its server directly, by its adapter name, with no
    key: a factory key is for the gateway alone); for a side that cannot be asked, why not."""
    rule = _rule(lake, experiment)
    route = rule.route if rule else None
    if route is None and lake.exists("shadow_pairs"):
        newest = lake.sql("SELECT route FROM shadow_pairs WHERE experiment = ? "
                          "ORDER BY created_at DESC LIMIT 1", [experiment]).to_pylist()
        route = newest[0]["route"] if newest else None
    frontier: Target | str = "no frontier model: no shadow rule or pair names the model it shadows"
    if route:
        headers = {"X-Factory-Tags": VIBE_TAGS, **client_headers(lake.settings)}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        frontier = Target(label=f"Frontier: {route} via the gateway",
                          base_url=gateway_url.rstrip("/") + "/v1", model=route, headers=headers)
    cand = Deployer(lake).candidate(experiment)
    candidate: Target | str = (f"no candidate deployment of {experiment} "
                               f"(factory deploy {experiment} --candidate starts one)")
    if cand is not None:
        candidate = Target(label=f"Candidate: {cand.version} ({cand.adapter})",
                           base_url=cand.endpoint, model=cand.adapter)
    elif rule is not None:
        candidate = Target(label=f"Candidate: {rule.version} ({rule.deployment})",
                           base_url=rule.base_url, model=rule.deployment)
    return frontier, candidate


async def ask(client: httpx.AsyncClient, target: Target, messages: list[dict[str, str]]) -> Reply:
    """One non-streamed chat completion; an error is the reply's, never raised."""
    base = target.base_url.rstrip("/")
    url = (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"
    started = time.perf_counter()
    try:
        response = await client.post(url, headers=target.headers, json={
            "model": target.model, "messages": messages, "max_tokens": VIBE_MAX_TOKENS})
    except httpx.HTTPError as exc:
        return Reply(text=None, error=f"{type(exc).__name__}: {exc or 'no answer'} ({url})",
                     latency_ms=(time.perf_counter() - started) * 1000)
    latency_ms = (time.perf_counter() - started) * 1000
    if not response.is_success:
        return Reply(text=None, error=f"HTTP {response.status_code}: {response.text[:500]}",
                     latency_ms=latency_ms)
    try:
        message = response.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Reply(text=None, error=f"not a chat completion: {response.text[:500]}",
                     latency_ms=latency_ms)
    text = message.get("content") or ""
    if message.get("tool_calls"):
        text += ("\n" if text else "") + json.dumps(message["tool_calls"], indent=2)
    return Reply(text=text, error=None, latency_ms=latency_ms)


async def ask_both(frontier: Target | str, candidate: Target | str, prompt: str
                   ) -> tuple[Reply | str, Reply | str]:
    """``prompt`` asked of both sides at once; a side that cannot be asked keeps its reason."""
    messages = [{"role": "user", "content": prompt}]

    async def ask_or_why(client: httpx.AsyncClient, target: Target | str) -> Reply | str:
        return target if isinstance(target, str) else await ask(client, target, messages)

    async with httpx.AsyncClient(timeout=VIBE_TIMEOUT_S) as client:
        f_reply, c_reply = await asyncio.gather(ask_or_why(client, frontier),
                                                ask_or_why(client, candidate))
    return f_reply, c_reply
