"""The comparison page behind ``factory compare``: a candidate deployment against the frontier
model on the live traffic shadow mode paired them on (``shadow_pairs``, ``shadow_scores``).

Per experiment it shows agreement and mean judge score over time (inline SVG), latency p50/p95
and an estimated cost per 1,000 requests for both sides, the worst-scored pairs side by side,
a vibe check (one prompt sent to both models at once; the frontier through the gateway with the
factory key of the settings, ``$FACTORY_GATEWAY_KEY``) and a promote action that moves
``factory/<experiment>`` to the candidate after a confirmation. Pages are rendered on the
server with ``html.escape``; there is no script and nothing is fetched from elsewhere.

Costs are estimates from an editable price table kept in ``$FACTORY_HOME/compare-prices.json``:
the frontier's from the pair's token counts and its model's price per million tokens, the
candidate's from its measured seconds per request and a price per machine hour.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from factory.deploy import DeployConfig, Deployer, Deployment, DeploymentError, route_model
from factory.deploy.deployer import CANDIDATE
from factory.evals.shadow import LATEST_SCORES, ShadowSummary, summarize
from factory.gateway.keys import client_headers
from factory.gateway.shadow import ShadowRule, load_shadows
from factory.lake import Lake

PRICES_FILE = "compare-prices.json"
NUM_WORST = 10
VIBE_TAGS = "source=compare-vibe-check"
"""``X-Factory-Tags`` of the vibe check's frontier call: the gateway captures it like any call,
and this tag lets an experiment's data filter leave it out."""
VIBE_TIMEOUT_S = 120.0
VIBE_MAX_TOKENS = 512

DEFAULT_MODEL_PRICES: dict[str, tuple[float, float]] = {
    # USD per 1M input / output tokens, list prices as published by the providers in 2025.
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1": (2.00, 8.00),
    "claude-3-5-haiku": (0.80, 4.00),
    "claude-sonnet-4": (3.00, 15.00),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.5-pro": (1.25, 10.00),
}
DEFAULT_MACHINE_PER_HOUR = 2.00
"""USD per hour of the machine serving the candidate: about one rented data-center GPU."""


# -- prices ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Prices:
    """The price table the cost estimates use (editable on ``/prices``)."""

    models: dict[str, tuple[float, float]] = field(
        default_factory=lambda: dict(DEFAULT_MODEL_PRICES))
    """Frontier model name -> (USD per 1M input tokens, USD per 1M output tokens)."""
    machine_per_hour: float = DEFAULT_MACHINE_PER_HOUR
    """USD per hour of the machine serving the candidate."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.machine_per_hour) and self.machine_per_hour >= 0):
            raise ValueError(f"machine_per_hour: must be a number >= 0, "
                             f"got {self.machine_per_hour!r}")
        for model, pair in self.models.items():
            if not model.strip():
                raise ValueError("models: a price row needs a model name")
            if not all(math.isfinite(p) and p >= 0 for p in pair):
                raise ValueError(f"models[{model!r}]: prices must be numbers >= 0, got {pair!r}")

    def of(self, model: str) -> tuple[str, tuple[float, float]] | None:
        """The price row for ``model``: its own, else the longest name it starts with (a dated
        release such as ``gpt-4o-mini-2024-07-18`` costs what ``gpt-4o-mini`` does)."""
        if model in self.models:
            return model, self.models[model]
        prefixes = [m for m in self.models if model.startswith(m)]
        if not prefixes:
            return None
        best = max(prefixes, key=len)
        return best, self.models[best]


def prices_path(lake: Lake) -> Path:
    return lake.settings.home / PRICES_FILE


def load_prices(path: Path) -> Prices:
    """The saved table, or the defaults before one was saved."""
    if not path.is_file():
        return Prices()
    try:
        data = json.loads(path.read_text())
        return Prices(models={str(m): (float(p["input"]), float(p["output"]))
                              for m, p in data["models"].items()},
                      machine_per_hour=float(data["machine_per_hour"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a price table ({exc}); fix or delete it") from None


def save_prices(path: Path, prices: Prices) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"machine_per_hour": prices.machine_per_hour, "models": {
        m: {"input": i, "output": o} for m, (i, o) in sorted(prices.models.items())}}, indent=2))
    tmp.replace(path)


# -- figures --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Scored pairs created in one time window."""

    start: datetime
    num_scored: int
    agreement: float
    mean_score: float


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Estimated USD per 1,000 requests and how each was computed."""

    frontier: float | None
    frontier_how: str
    candidate: float | None
    candidate_how: str


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Everything the experiment page shows about one candidate version."""

    experiment: str
    version: str | None
    versions: list[tuple[str, int]]
    """Every candidate version with pairs, newest first, and its number of pairs."""
    summary: ShadowSummary
    routes: list[str]
    buckets: list[Bucket]
    bucket_label: str
    latency: dict[str, tuple[float | None, float | None]]
    """``frontier`` / ``candidate`` -> (p50 ms, p95 ms)."""
    num_latency: dict[str, int]
    costs: Costs
    worst: list[dict[str, Any]]


# Window widths tried for the chart, smallest first; the first giving at most MAX_BUCKETS wins.
WIDTHS = [(timedelta(minutes=5), "5 minutes"), (timedelta(minutes=15), "15 minutes"),
          (timedelta(hours=1), "hour"), (timedelta(hours=6), "6 hours"),
          (timedelta(days=1), "day"), (timedelta(days=7), "week")]
MAX_BUCKETS = 48


def buckets(scored: list[tuple[datetime, float, bool]]) -> tuple[list[Bucket], str]:
    """Agreement and mean score per time window of the pairs' creation times."""
    if not scored:
        return [], "hour"
    first = min(t for t, _, _ in scored)
    span = max(t for t, _, _ in scored) - first
    width, label = next(((w, lbl) for w, lbl in WIDTHS if span / w < MAX_BUCKETS), WIDTHS[-1])
    epoch = datetime(2000, 1, 1, tzinfo=UTC)
    groups: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for t, score, passed in scored:
        groups[(t - epoch) // width].append((score, passed))
    out = [Bucket(start=epoch + k * width, num_scored=len(g),
                  agreement=sum(p for _, p in g) / len(g), mean_score=sum(s for s, _ in g) / len(g))
           for k, g in sorted(groups.items())]
    return out, label


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def costs(rows: list[dict[str, Any]], prices: Prices) -> Costs:
    """Cost per 1,000 requests of each side, from the pairs' token counts and latencies."""
    per_request: list[float] = []
    unpriced: set[str] = set()
    matched: set[str] = set()
    for r in rows:
        found = prices.of(r["route"] or "")
        if found is None:
            unpriced.add(r["route"] or "?")
            continue
        pt, ct = r["frontier_prompt_tokens"], r["frontier_completion_tokens"]
        if pt is None or ct is None:
            continue
        name, (inp, out) = found
        matched.add(name)
        per_request.append((pt * inp + ct * out) / 1e6)
    frontier = 1000 * sum(per_request) / len(per_request) if per_request else None
    how = (f"mean over {len(per_request)} pairs of prompt tokens x input price + completion "
           f"tokens x output price ({', '.join(sorted(matched)) or 'no priced model'}), "
           f"x 1,000")
    if unpriced:
        how += f"; no price for {', '.join(sorted(unpriced))}: add it on the price table"
    seconds = [r["candidate_latency_ms"] / 1000 for r in rows
               if r["answered"] and r["candidate_latency_ms"] is not None]
    candidate = (1000 * sum(seconds) / len(seconds) * prices.machine_per_hour / 3600
                 if seconds else None)
    candidate_how = (f"mean measured seconds per answered request ({len(seconds)} pairs) x "
                     f"${prices.machine_per_hour:.2f} per machine hour / 3,600, x 1,000: one "
                     f"request at a time holding the machine, so batching only lowers it")
    return Costs(frontier=frontier, frontier_how=how, candidate=candidate,
                 candidate_how=candidate_how)


def pair_versions(lake: Lake, experiment: str) -> list[tuple[str, int]]:
    if not lake.exists("shadow_pairs"):
        return []
    rows = lake.sql("SELECT version, count(*) AS n, max(created_at) AS newest FROM shadow_pairs "
                    "WHERE experiment = ? GROUP BY version ORDER BY newest DESC",
                    [experiment]).to_pylist()
    return [(r["version"], int(r["n"])) for r in rows]


def compare(lake: Lake, experiment: str, version: str | None, prices: Prices) -> Comparison:
    """The figures of ``experiment``'s pairs of candidate ``version`` (None: every version)."""
    versions = pair_versions(lake, experiment)
    summary = summarize(lake, experiment, version)
    rows: list[dict[str, Any]] = []
    worst: list[dict[str, Any]] = []
    if versions:
        where, params = "p.experiment = ?", [experiment]
        if version is not None:
            where, params = where + " AND p.version = ?", params + [version]
        columns = ("p.pair_id, p.route, p.created_at, p.frontier_latency_ms, "
                   "p.candidate_latency_ms, p.frontier_prompt_tokens, "
                   "p.frontier_completion_tokens, p.candidate_message IS NOT NULL AS answered")
        if lake.exists("shadow_scores"):
            rows = lake.sql(f"SELECT {columns}, s.score, s.passed FROM shadow_pairs p LEFT JOIN "
                            f"{LATEST_SCORES} s USING (pair_id) WHERE {where}",
                            [experiment, *params]).to_pylist()
            worst = lake.sql(
                f"SELECT p.*, s.score, s.passed, s.assessment, s.judge FROM shadow_pairs p JOIN "
                f"{LATEST_SCORES} s USING (pair_id) WHERE {where} "
                f"ORDER BY s.score ASC, p.created_at DESC LIMIT {NUM_WORST}",
                [experiment, *params]).to_pylist()
        else:
            rows = lake.sql(f"SELECT {columns}, NULL AS score, NULL AS passed "
                            f"FROM shadow_pairs p WHERE {where}", params).to_pylist()
    scored = [(_aware(r["created_at"]), float(r["score"]), bool(r["passed"]))
              for r in rows if r["score"] is not None]
    chart, label = buckets(scored)
    frontier_ms = [r["frontier_latency_ms"] for r in rows if r["frontier_latency_ms"] is not None]
    candidate_ms = [r["candidate_latency_ms"] for r in rows
                    if r["answered"] and r["candidate_latency_ms"] is not None]
    return Comparison(
        experiment=experiment, version=version, versions=versions, summary=summary,
        routes=sorted({r["route"] for r in rows if r["route"]}), buckets=chart, bucket_label=label,
        latency={"frontier": (percentile(frontier_ms, 0.5), percentile(frontier_ms, 0.95)),
                 "candidate": (percentile(candidate_ms, 0.5), percentile(candidate_ms, 0.95))},
        num_latency={"frontier": len(frontier_ms), "candidate": len(candidate_ms)},
        costs=costs(rows, prices), worst=worst)


def experiments(lake: Lake) -> list[dict[str, Any]]:
    """Experiments with shadow pairs, a shadow rule or a candidate: name, pairs, summary."""
    names: set[str] = set()
    pairs: dict[str, int] = {}
    if lake.exists("shadow_pairs"):
        for r in lake.sql("SELECT experiment, count(*) AS n FROM shadow_pairs "
                          "GROUP BY experiment").to_pylist():
            pairs[r["experiment"]] = int(r["n"])
    names |= set(pairs)
    names |= {rule.experiment for rule in load_shadows(lake).values()}
    names |= {d.name for d in Deployer(lake).versions() if d.status == CANDIDATE}
    out = []
    for name in sorted(names):
        versions = pair_versions(lake, name)
        newest = versions[0][0] if versions else None
        out.append({"experiment": name, "num_pairs": pairs.get(name, 0), "version": newest,
                    "summary": summarize(lake, name, newest)})
    return out


def known(lake: Lake, experiment: str) -> bool:
    if pair_versions(lake, experiment):
        return True
    if any(rule.experiment == experiment for rule in load_shadows(lake).values()):
        return True
    return bool(Deployer(lake).versions(experiment))


# -- the vibe check -------------------------------------------------------------------------------


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


# -- rendering ------------------------------------------------------------------------------------


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


def usd(value: float | None) -> str:
    if value is None:
        return "–"
    return f"${value:,.2f}" if value >= 10 else f"${value:,.4f}"


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 24px}header a{color:#fff;margin-right:18px}
main{padding:16px 24px;max-width:1400px}h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:22px 0 8px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #d8dce3;padding:5px 10px;text-align:left}
th{background:#eef0f4}.num{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{background:#fff;border:1px solid #d8dce3;border-radius:6px;padding:10px 16px;min-width:150px}
.card b{display:block;font-size:24px}h3{font-size:14px;margin:8px 0 2px}.note{color:#5b6475;font-size:12.5px;max-width:1000px}
.pair{background:#fff;border:1px solid #d8dce3;border-radius:6px;padding:10px 14px;margin:12px 0}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:12px}.cols>div{min-width:0}
pre{white-space:pre-wrap;word-break:break-word;background:#f3f4f7;padding:8px;border-radius:4px;margin:4px 0}
.fail{color:#b42318}.pass{color:#067647}.error{color:#b42318;font-weight:600}
.ok{color:#067647;font-weight:600}button{font-size:14px;padding:6px 14px;cursor:pointer;margin-bottom:10px}
textarea{width:100%;font:inherit}input[type=text]{width:200px}input.n{width:90px}
"""


def page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title>"
        f"<style>{STYLE}</style></head><body><header><a href='/'>Shadow comparisons</a>"
        f"<a href='/prices'>Price table</a></header><main>{body}</main></body></html>",
        status_code=status_code)


def chart_svg(points: list[Bucket], label: str) -> str:
    """Agreement and mean score (both 0..1) per window as two lines."""
    if not points:
        return "<p class=note>No scored pairs yet: the chart fills once the judge scores pairs.</p>"
    w, h, left, right, top, bottom = 860, 250, 48, 20, 22, 34
    first = points[0].start
    span = (points[-1].start - first).total_seconds()

    def x(i: int) -> float:  # by time: a window without scored pairs leaves a gap
        at = (points[i].start - first).total_seconds()
        return left + (w - left - right) * (at / span if span else 0.5)

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - v)

    parts = [f"<svg id=over-time width={w} height={h} viewBox='0 0 {w} {h}' role=img "
             f"aria-label='agreement and mean score per {esc(label)}' "
             "style='background:#fff;border:1px solid #d8dce3'>"]
    for v in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f"<line x1={left} x2={w - right} y1={y(v):.1f} y2={y(v):.1f} "
                     "stroke='#e4e7ec'/>"
                     f"<text x={left - 6} y={y(v) + 4:.1f} font-size=11 text-anchor=end "
                     f"fill='#5b6475'>{100 * v:.0f}%</text>")
    for key, color in (("agreement", "#2e62d9"), ("mean_score", "#d97a2e")):
        coords = [(x(i), y(getattr(b, key))) for i, b in enumerate(points)]
        if len(coords) > 1:
            parts.append("<polyline fill=none stroke-width=2 stroke='" + color + "' points='"
                         + " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy in coords) + "'/>")
        for (cx, cy), b in zip(coords, points, strict=True):
            parts.append(f"<circle cx={cx:.1f} cy={cy:.1f} r=3.5 fill='{color}'><title>"
                         f"{b.start:%Y-%m-%d %H:%M} UTC: {key.replace('_', ' ')} "
                         f"{pct(getattr(b, key))} of {b.num_scored} scored</title></circle>")
    last = len(points) - 1
    for i, anchor in sorted({0: "start", last // 2: "middle", last: "end"}.items()):
        parts.append(f"<text x={x(i):.1f} y={h - 12} font-size=11 text-anchor={anchor} "
                     f"fill='#5b6475'>{points[i].start:%m-%d %H:%M}</text>")
    parts.append(f"<rect x={w - 250} y=2 width=10 height=10 fill='#2e62d9'/>"
                 f"<text x={w - 236} y=11 font-size=12>agreement</text>"
                 f"<rect x={w - 160} y=2 width=10 height=10 fill='#d97a2e'/>"
                 f"<text x={w - 146} y=11 font-size=12>mean judge score</text></svg>")
    return "".join(parts)


def message_text(raw: str | None) -> str:
    """The text (and tool calls) of a canonical assistant message stored as JSON."""
    if raw is None:
        return ""
    try:
        msg = json.loads(raw)
    except ValueError:
        return raw
    content = msg.get("content")
    if isinstance(content, list):
        text = "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    else:
        text = content if isinstance(content, str) else ""
    if msg.get("tool_calls"):
        text += ("\n" if text else "") + "tool calls: " + json.dumps(msg["tool_calls"], indent=1)
    return text


def request_text(raw: str | None, limit: int = 4000) -> str:
    """The request's messages as ``role: text`` lines (each cut at ``limit`` characters)."""
    try:
        request = json.loads(raw or "{}")
    except ValueError:
        return (raw or "")[:limit]
    lines = []
    for m in request.get("messages") or [] if isinstance(request, dict) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        text = str(content or "")
        lines.append(f"{m.get('role', '?')}: {text[:limit]}{'…' if len(text) > limit else ''}")
    return "\n".join(lines)


def pair_html(p: dict[str, Any]) -> str:
    verdict = "<span class=pass>passed</span>" if p["passed"] else "<span class=fail>failed</span>"
    candidate = message_text(p["candidate_message"])
    if p["candidate_message"] is None:
        candidate = f"(no answer: {p['candidate_error'] or 'HTTP ' + str(p['candidate_status'])})"
    return (f"<section class=pair data-pair-id='{esc(p['pair_id'])}'>"
            f"<div>score <b class=score>{p['score']:.2f}</b> {verdict} · {esc(p['version'])} · "
            f"{_aware(p['created_at']):%Y-%m-%d %H:%M:%S} UTC · pair {esc(p['pair_id'])}</div>"
            f"<h3>Prompt</h3><pre class=prompt>{esc(request_text(p['request']))}</pre>"
            "<div class=cols>"
            f"<div class=frontier><h3>Frontier ({esc(p['route'])}) · "
            f"{ms(p['frontier_latency_ms'])}</h3>"
            f"<pre>{esc(message_text(p['frontier_message']))}</pre></div>"
            f"<div class=candidate><h3>Candidate ({esc(p['candidate_model'])}) · "
            f"{ms(p['candidate_latency_ms'])}</h3><pre>{esc(candidate)}</pre></div></div>"
            f"<div class=assessment><b>Judge ({esc(p['judge'])}):</b> {esc(p['assessment'])}"
            "</div></section>")


def experiment_html(c: Comparison, candidate: Deployment | None, live: Deployment | None) -> str:
    e, s = c.experiment, c.summary
    out = [f"<h1>{esc(e)}</h1>"]
    links = [f"<a href='/e/{quote(e)}?version={quote(v)}'>{esc(v)}</a> ({n} pairs)"
             for v, n in c.versions]
    shown = f"candidate version <b id=version>{esc(c.version)}</b>" if c.version \
        else "<b id=version>every candidate version</b>"
    out.append(f"<p>Showing {shown}. Versions: {' · '.join(links) or 'none yet'}"
               + (f" · <a href='/e/{quote(e)}?version=all'>all</a>" if len(c.versions) > 1
                  else "") + f" · routes compared: {esc(', '.join(c.routes) or '–')}</p>")
    live_txt = f"{live.version} ({live.endpoint})" if live else "none"
    if candidate is not None:
        promote = (f"<form method=get action='/e/{quote(e)}/promote'>"
                   f"<input type=hidden name=version value='{esc(candidate.version)}'>"
                   f"<button id=promote>Promote {esc(candidate.version)}…</button></form>")
        cand_txt = f"{candidate.version} ({candidate.adapter} at {candidate.endpoint})"
    else:
        promote = f"<p class=note>No candidate deployment to promote: " \
                  f"<code>factory deploy {esc(e)} --candidate</code> starts one.</p>"
        cand_txt = "none"
    out.append(f"<p>Live behind <code>{esc(route_model(e))}</code>: {esc(live_txt)} · "
               f"candidate: {esc(cand_txt)}</p>{promote}")
    if s.num_pairs == 0:
        out.append(f"<p id=no-pairs>No shadow pairs yet for {esc(e)}"
                   f"{' ' + esc(c.version) if c.version else ''}. Pairs appear once the gateway "
                   "shadows calls to the candidate (a rule in the lake table "
                   "<code>shadows</code>).</p>")
    out.append(
        "<div class=cards>"
        f"<div class=card id=agreement><span>Agreement</span><b>{pct(s.agreement)}</b>"
        f"{s.num_passed} of {s.num_scored} scored pairs passed</div>"
        f"<div class=card id=mean-score><span>Mean judge score</span>"
        f"<b>{'–' if s.mean_score is None else f'{s.mean_score:.3f}'}</b>0 to 1</div>"
        f"<div class=card id=pairs><span>Pairs</span><b>{s.num_pairs}</b>"
        f"{s.num_failed_calls} without a candidate answer</div></div>")
    out.append(f"<h2>Over time (per {esc(c.bucket_label)}, by the pair's time)</h2>"
               + chart_svg(c.buckets, c.bucket_label))
    lat, cost = c.latency, c.costs
    out.append(
        "<h2>Latency and cost</h2><table id=figures><tr><th></th><th>p50 latency</th>"
        "<th>p95 latency</th><th>est. cost per 1,000 requests</th></tr>"
        f"<tr id=frontier-row><th>Frontier</th><td class=num>{ms(lat['frontier'][0])}</td>"
        f"<td class=num>{ms(lat['frontier'][1])}</td><td class=num>{usd(cost.frontier)}</td></tr>"
        f"<tr id=candidate-row><th>Candidate</th><td class=num>{ms(lat['candidate'][0])}</td>"
        f"<td class=num>{ms(lat['candidate'][1])}</td><td class=num>{usd(cost.candidate)}</td>"
        "</tr></table>"
        f"<p class=note>Latency: the frontier's as the gateway measured it for the client "
        f"({c.num_latency['frontier']} pairs); the candidate's from the shadow call's send to its "
        f"complete answer ({c.num_latency['candidate']} answered pairs). "
        f"Frontier cost: {esc(cost.frontier_how)}. Candidate cost: {esc(cost.candidate_how)}. "
        "Prices are editable estimates: <a href='/prices'>price table</a>.</p>")
    out.append(f"<h2>Worst-scored pairs (lowest first, at most {NUM_WORST})</h2>")
    out.extend(pair_html(p) for p in c.worst)
    if not c.worst:
        out.append("<p class=note>No scored pairs.</p>")
    out.append(vibe_form(e, ""))
    return "".join(out)


def vibe_form(experiment: str, prompt: str) -> str:
    return (f"<h2>Vibe check</h2><form id=vibe method=post action='/e/{quote(experiment)}/vibe'>"
            f"<textarea name=prompt rows=3 placeholder='One prompt, sent to both models at once'>"
            f"{esc(prompt)}</textarea><br><button>Ask both</button></form>"
            f"<p class=note>The frontier is asked through the gateway (captured, tagged "
            f"<code>{esc(VIBE_TAGS)}</code>), the candidate on its own server.</p>")


async def ask_or_why(client: httpx.AsyncClient, target: Target | str,
                     messages: list[dict[str, str]]) -> Reply | str:
    return target if isinstance(target, str) else await ask(client, target, messages)


def reply_html(css: str, target: Target | str, reply: Reply | str) -> str:
    if isinstance(target, str) or isinstance(reply, str):
        return f"<div class={css}><h3>{css}</h3><p class=error>{esc(reply)}</p></div>"
    body = f"<pre class=answer>{esc(reply.text)}</pre>" if reply.error is None \
        else f"<p class=error>{esc(reply.error)}</p>"
    return (f"<div class={css}><h3>{esc(target.label)} · <span class=latency>"
            f"{ms(reply.latency_ms)}</span></h3>{body}</div>")


# -- the app --------------------------------------------------------------------------------------


class Compare:
    """The Starlette app and what its pages read: the lake, the gateway's URL (default: the
    lake's settings', ``$FACTORY_GATEWAY_URL``), the deployer's config (``drain_s`` of a
    promotion)."""

    def __init__(self, lake: Lake | None = None, *, gateway_url: str | None = None,
                 deploy_config: DeployConfig | None = None) -> None:
        self.lake = lake or Lake()
        self.gateway_url = gateway_url or self.lake.settings.gateway_url
        self.deploy_config = deploy_config
        self.app = Starlette(routes=[
            Route("/", self.index),
            Route("/e/{experiment}", self.experiment),
            Route("/e/{experiment}/vibe", self.vibe, methods=["GET", "POST"]),
            Route("/e/{experiment}/promote", self.promote, methods=["GET", "POST"]),
            Route("/prices", self.prices, methods=["GET", "POST"]),
        ])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    def _known(self, experiment: str) -> bool:
        return known(self.lake, experiment)

    def index(self, request: Request) -> Response:
        rows = experiments(self.lake)
        body = ["<h1>Candidates against the frontier model on live traffic</h1>"]
        if not rows:
            body.append("<p id=no-experiments>No experiment has shadow pairs, a shadow rule or a "
                        "candidate deployment yet.</p>")
        else:
            body.append("<table id=experiments><tr><th>experiment</th><th>newest version</th>"
                        "<th>pairs</th><th>scored</th><th>agreement</th><th>mean score</th></tr>")
            for r in rows:
                s = r["summary"]
                body.append(
                    f"<tr><td><a href='/e/{quote(r['experiment'])}'>{esc(r['experiment'])}</a>"
                    f"</td><td>{esc(r['version'] or '–')}</td><td class=num>{r['num_pairs']}</td>"
                    f"<td class=num>{s.num_scored}</td><td class=num>{pct(s.agreement)}</td>"
                    f"<td class=num>"
                    f"{'–' if s.mean_score is None else f'{s.mean_score:.3f}'}</td></tr>")
            body.append("</table>")
        return page("Shadow comparisons", "".join(body))

    def _not_found(self, experiment: str) -> Response:
        return page("Not found", f"<h1>Unknown experiment</h1><p id=not-found>No experiment "
                                 f"named <b>{esc(experiment)}</b> has shadow pairs, a shadow "
                                 f"rule or a deployment. <a href='/'>All experiments</a></p>",
                    404)

    def experiment(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not self._known(e):
            return self._not_found(e)
        asked = request.query_params.get("version")
        versions = pair_versions(self.lake, e)
        if asked == "all":
            version = None
        elif asked:
            if asked not in dict(versions):
                return page("Not found", f"<h1>Unknown version</h1><p id=not-found>{esc(e)} has "
                                         f"no pairs of version <b>{esc(asked)}</b>.</p>", 404)
            version = asked
        else:
            version = versions[0][0] if versions else None
        try:
            prices, notice = load_prices(prices_path(self.lake)), ""
        except ValueError as exc:
            prices, notice = Prices(), f"{exc}. Costs use the default prices."
        comparison = compare(self.lake, e, version, prices)
        deployer = Deployer(self.lake)
        return page(f"{e}: candidate vs frontier",
                    (f"<p class=error id=prices-error>{esc(notice)}</p>" if notice else "")
                    + experiment_html(comparison, deployer.candidate(e), deployer.live(e)))

    async def vibe(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not await run_in_threadpool(self._known, e):
            return self._not_found(e)
        if request.method == "GET":
            return page(f"{e}: vibe check", f"<h1>{esc(e)}: vibe check</h1>{vibe_form(e, '')}")
        prompt = (await _form(request)).get("prompt", "").strip()
        if not prompt:
            return page(f"{e}: vibe check", f"<h1>{esc(e)}: vibe check</h1><p class=error>"
                                            f"Write a prompt first.</p>{vibe_form(e, '')}", 400)
        frontier, candidate = await run_in_threadpool(vibe_targets, self.lake, e,
                                                      self.gateway_url)
        messages = [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(timeout=VIBE_TIMEOUT_S) as client:
            f_reply, c_reply = await asyncio.gather(ask_or_why(client, frontier, messages),
                                                    ask_or_why(client, candidate, messages))
        cols = (reply_html("frontier", frontier, f_reply)
                + reply_html("candidate", candidate, c_reply))
        return page(f"{e}: vibe check",
                    f"<h1>{esc(e)}: vibe check</h1><p><a href='/e/{quote(e)}'>back to {esc(e)}"
                    f"</a></p><h2>Prompt</h2><pre id=vibe-prompt>{esc(prompt)}</pre>"
                    f"<div class=cols id=vibe-answers>{cols}</div>{vibe_form(e, prompt)}")

    async def promote(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not await run_in_threadpool(self._known, e):
            return self._not_found(e)
        if request.method == "GET":
            return await run_in_threadpool(self._confirm, e, request.query_params.get("version"))
        if not _same_origin(request):
            return page("Refused", "<p class=error>A promotion must come from this page's own "
                                   "form.</p>", 403)
        version = (await _form(request)).get("version") or None
        try:
            dep = await run_in_threadpool(self._promote, e, version)
        except (DeploymentError, ValueError) as exc:
            return page(f"{e}: promotion failed",
                        f"<h1>Promotion failed</h1><p class=error id=promote-error>{esc(exc)}</p>"
                        f"<p><a href='/e/{quote(e)}'>back to {esc(e)}</a></p>", 409)
        return page(f"{e}: promoted",
                    f"<h1>Promoted</h1><p class=ok id=promoted>{esc(route_model(e))} is now served "
                    f"by {esc(e)} {esc(dep.version)} ({esc(dep.adapter)} at {esc(dep.endpoint)})."
                    f"</p><p><a href='/e/{quote(e)}'>back to {esc(e)}</a></p>")

    def _promote(self, experiment: str, version: str | None) -> Deployment:
        from factory.deploy.kubernetes import host_from_env

        return Deployer(self.lake, self.deploy_config, host=host_from_env()).promote(
            experiment, version)

    def _confirm(self, e: str, version: str | None) -> Response:
        candidate = Deployer(self.lake).candidate(e)
        version = version or (candidate.version if candidate else None)
        if version is None:
            return page(f"{e}: nothing to promote",
                        f"<p class=error id=promote-error>{esc(e)} has no candidate deployment to "
                        f"promote.</p><p><a href='/e/{quote(e)}'>back</a></p>", 409)
        s = summarize(self.lake, e, version)
        return page(
            f"{e}: promote {version}?",
            f"<h1 id=confirm-question>Promote {esc(e)} {esc(version)} behind "
            f"{esc(route_model(e))}?</h1><p>On live traffic: agreement {pct(s.agreement)} over "
            f"{s.num_scored} scored pairs, mean judge score "
            f"{'–' if s.mean_score is None else f'{s.mean_score:.3f}'}. The version live now "
            "drains and stops once the route has moved.</p>"
            f"<form method=post action='/e/{quote(e)}/promote'>"
            f"<input type=hidden name=version value='{esc(version)}'>"
            f"<button id=confirm>Confirm: promote {esc(version)}</button> "
            f"<a href='/e/{quote(e)}'>Cancel</a></form>")

    async def prices(self, request: Request) -> Response:
        path = prices_path(self.lake)
        error = ""
        if request.method == "POST":
            try:
                prices = parse_prices(await _form(request))
            except ValueError as exc:
                error = str(exc)
            else:
                await run_in_threadpool(save_prices, path, prices)
                return RedirectResponse("/prices?saved=1", status_code=303)
        try:
            current = load_prices(path)
        except ValueError as exc:
            current, error = Prices(), error or str(exc)
        saved = request.query_params.get("saved") == "1" and not error
        return page("Price table", prices_html(current, saved=saved, error=error),
                    400 if error and request.method == "POST" else 200)


def parse_prices(form: dict[str, str]) -> Prices:
    """The table of the ``/prices`` form: rows ``model_i``, ``input_i``, ``output_i``; a row
    with an empty model name is dropped."""
    models: dict[str, tuple[float, float]] = {}
    i = 0
    while f"model_{i}" in form:
        name = form[f"model_{i}"].strip()
        if name:
            models[name] = (_number(form.get(f"input_{i}", ""), f"{name} input price"),
                            _number(form.get(f"output_{i}", ""), f"{name} output price"))
        i += 1
    return Prices(models=models,
                  machine_per_hour=_number(form.get("machine_per_hour", ""), "machine hour price"))


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: must be a number >= 0, got {text!r}")
    return value


def prices_html(prices: Prices, *, saved: bool, error: str) -> str:
    rows = sorted(prices.models.items()) + [("", (None, None))] * 3
    out = ["<h1>Price table</h1><p class=note>Editable estimates for the cost figures, in USD. "
           "Defaults are providers' list prices per million tokens; a model name also prices "
           "dated releases that start with it. The machine hour prices the candidate's "
           "measured seconds per request.</p>"]
    if saved:
        out.append("<p class=ok id=saved>Saved.</p>")
    if error:
        out.append(f"<p class=error id=prices-error>{esc(error)}</p>")
    out.append("<form method=post action='/prices' id=prices><table><tr><th>frontier model</th>"
               "<th>$ per 1M input tokens</th><th>$ per 1M output tokens</th></tr>")
    for i, (model, (inp, outp)) in enumerate(rows):
        out.append(f"<tr><td><input type=text name=model_{i} value='{esc(model)}'></td>"
                   f"<td><input class=n name=input_{i} value='{esc(inp)}'></td>"
                   f"<td><input class=n name=output_{i} value='{esc(outp)}'></td></tr>")
    out.append(f"</table><p>Candidate machine: $ <input class=n name=machine_per_hour "
               f"value='{prices.machine_per_hour}'> per hour</p><button id=save>Save</button>"
               "</form>")
    return "".join(out)


async def _form(request: Request) -> dict[str, str]:
    """An url-encoded form body (the last value of a repeated field)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _same_origin(request: Request) -> bool:
    """A browser's POST names its page's origin; one from another site must not promote."""
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host")
