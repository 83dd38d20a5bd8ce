"""The HTML pages of the comparison app (``factory compare``), rendered from the Jinja2 templates
in ``factory/app/templates/compare_*.html``.

Autoescaping is on for every template: prompts, answers, judges' assessments, experiment and
model names reach the page as text, escaped by the template engine. There is no script and
nothing is fetched from elsewhere.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from factory.app.charts import chart
from factory.app.comparison import NUM_WORST, Comparison
from factory.app.costs import Prices
from factory.app.vibe import VIBE_TAGS, Reply, Target
from factory.deploy import Deployment, route_model
from factory.evals.shadow import ShadowSummary


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


def usd(value: float | None) -> str:
    if value is None:
        return "–"
    return f"${value:,.2f}" if value >= 10 else f"${value:,.4f}"


def score(value: float | None) -> str:
    """A mean judge score (0..1)."""
    return "–" if value is None else f"{value:.3f}"


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


# trim_blocks and lstrip_blocks: a line holding only a {% tag %} writes nothing, so the
# templates indent and break lines as HTML reads best without adding text to the page.
ENV = Environment(loader=PackageLoader("factory.app", "templates"),
                  autoescape=select_autoescape(["html"]), undefined=StrictUndefined,
                  trim_blocks=True, lstrip_blocks=True)
ENV.filters.update(pct=pct, ms=ms, usd=usd, score=score, message_text=message_text,
                   request_text=request_text)
ENV.globals.update(VIBE_TAGS=VIBE_TAGS)


def render(template: str, **context: Any) -> str:
    return ENV.get_template(template).render(**context)


def index_page(rows: list[dict[str, Any]]) -> str:
    """Every experiment: ``rows`` as :func:`factory.app.comparison.experiments` gives them."""
    return render("compare_index.html", rows=rows)


def not_found_page(experiment: str, version: str | None = None) -> str:
    """An unknown experiment, or (with ``version``) a version without pairs."""
    return render("compare_not_found.html", experiment=experiment, version=version)


def experiment_page(c: Comparison, candidate: Deployment | None, live: Deployment | None, *,
                    notice: str = "") -> str:
    """One experiment's figures; ``notice``: why the costs use the default prices."""
    return render("compare_experiment.html", c=c, candidate=candidate, live=live, notice=notice,
                  route=route_model(c.experiment), chart=chart(c.buckets, c.bucket_label),
                  num_worst=NUM_WORST)


Side = tuple[Target | str, Reply | str]
"""Where one side of the vibe check was asked (or why it could not be) and its reply (or that
reason again)."""


def vibe_page(experiment: str, *, prompt: str = "", error: str = "",
              asked: tuple[Side, Side] | None = None) -> str:
    """The vibe check's form, with ``error`` above it, and once asked the frontier's and the
    candidate's answers to ``prompt``."""
    replies = [("frontier", *asked[0]), ("candidate", *asked[1])] if asked else []
    return render("compare_vibe.html", experiment=experiment, prompt=prompt, error=error,
                  replies=replies)


def confirm_page(experiment: str, version: str | None, summary: ShadowSummary | None) -> str:
    """The question before promoting candidate ``version`` (None: there is none to promote)."""
    return render("compare_confirm.html", experiment=experiment, version=version,
                  summary=summary, route=route_model(experiment))


def promoted_page(experiment: str, deployment: Deployment | None, error: str | None = None
                  ) -> str:
    """What the promotion did: ``deployment`` serves the route, or ``error`` says why not."""
    return render("compare_promoted.html", experiment=experiment, deployment=deployment,
                  error=error, route=route_model(experiment))


def refused_page() -> str:
    return render("compare_refused.html")


def prices_page(prices: Prices, *, saved: bool, error: str) -> str:
    rows = [(m, i, o) for m, (i, o) in sorted(prices.models.items())] + [("", "", "")] * 3
    return render("compare_prices.html", rows=rows, machine_per_hour=prices.machine_per_hour,
                  saved=saved, error=error)
