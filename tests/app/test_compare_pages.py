"""The comparison app's pages rendered from their templates (factory.app.compare_pages): user
text arrives escaped, numbers formatted, the chart drawn; the browser tests in test_compare.py
drive the same pages through the server."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from factory.app.charts import Bucket
from factory.app.compare_pages import (
    confirm_page,
    experiment_page,
    message_text,
    ms,
    not_found_page,
    pct,
    prices_page,
    request_text,
    usd,
    vibe_page,
)
from factory.app.comparison import Comparison
from factory.app.costs import Costs, Prices
from factory.app.vibe import Reply, Target
from factory.evals.shadow import ShadowSummary

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
HOSTILE = "<script>alert('x')</script> & \"q\""
ESCAPED = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &#34;q&#34;"


def summary(num_scored: int = 0) -> ShadowSummary:
    return ShadowSummary(experiment="triage", version="v2", num_pairs=num_scored,
                         num_scored=num_scored, num_passed=num_scored, num_failed_calls=0,
                         agreement=1.0 if num_scored else None,
                         mean_score=1.0 if num_scored else None)


def comparison(*, worst: list[dict[str, Any]] | None = None, points: list[Bucket] | None = None,
               version: str = "v2") -> Comparison:
    return Comparison(
        experiment="triage", version=version, versions=[(version, 1)], summary=summary(1),
        routes=["gpt-4o-mini"], buckets=points or [], bucket_label="5 minutes",
        latency={"frontier": (300.0, 480.0), "candidate": (None, None)},
        num_latency={"frontier": 1, "candidate": 0},
        costs=Costs(frontier=0.27, frontier_how=HOSTILE, candidate=None, candidate_how="-"),
        worst=worst or [])


def worst_pair(text: str) -> dict[str, Any]:
    message = json.dumps({"role": "assistant", "content": text})
    return {"pair_id": "p1", "score": 0.1, "passed": False, "version": "v2", "created_at": T0,
            "request": json.dumps({"messages": [{"role": "user", "content": text}]}),
            "route": text, "frontier_latency_ms": 1234.0, "frontier_message": message,
            "candidate_model": text, "candidate_latency_ms": None, "candidate_message": None,
            "candidate_error": text, "candidate_status": 500, "judge": text, "assessment": text}


def test_user_text_is_escaped_by_the_templates() -> None:
    page = experiment_page(comparison(worst=[worst_pair(HOSTILE)], version=HOSTILE), None, None,
                           notice=HOSTILE)
    assert "<script>" not in page
    # version, notice, cost note, prompt, frontier answer, route, model, candidate's error,
    # judge, assessment
    assert page.count(ESCAPED) >= 10, page
    assert f"<pre class=prompt>user: {ESCAPED}</pre>" in page
    assert f"<pre>(no answer: {ESCAPED})</pre>" in page

    vibe = vibe_page("triage", prompt=HOSTILE, asked=(
        (Target(label=HOSTILE, base_url="http://x", model="m"),
         Reply(text=HOSTILE, error=None, latency_ms=12.0)),
        (HOSTILE, HOSTILE)))
    assert "<script>" not in vibe
    assert f"<pre id=vibe-prompt>{ESCAPED}</pre>" in vibe
    assert f"<textarea name=prompt rows=3 placeholder='One prompt, sent to both models at " \
           f"once'>{ESCAPED}</textarea>" in vibe
    assert f"<pre class=answer>{ESCAPED}</pre>" in vibe
    assert f"<p class=error>{ESCAPED}</p>" in vibe

    # An attribute value cannot be closed by a name: the quote is escaped.
    prices = prices_page(Prices(models={"m' onfocus='x": (1.0, 2.0)}), saved=False, error="")
    assert "value='m&#39; onfocus=&#39;x'" in prices
    assert "<b>v&lt;9&gt;</b>" in not_found_page("triage", "v<9>")
    assert "value='v&#39;&gt;'" in confirm_page("triage", "v'>", summary())


def test_the_experiment_page_shows_the_figures() -> None:
    page = experiment_page(comparison(), None, None)
    assert ("<tr id=frontier-row><th>Frontier</th><td class=num>300 ms</td>"
            "<td class=num>480 ms</td><td class=num>$0.2700</td></tr>") in page
    assert ("<tr id=candidate-row><th>Candidate</th><td class=num>–</td><td class=num>–</td>"
            "<td class=num>–</td></tr>") in page
    assert "No scored pairs yet: the chart fills" in page and "<svg" not in page
    assert "No scored pairs.</p>" in page
    assert "<button id=promote>" not in page
    assert "<code>factory deploy triage --candidate</code> starts one" in page
    assert "id=prices-error" not in page


def test_the_chart_draws_a_dot_per_window_and_figure() -> None:
    points = [Bucket(start=T0 + timedelta(minutes=5 * i), num_scored=i + 1, agreement=1.0,
                     mean_score=0.5) for i in range(3)]
    page = experiment_page(comparison(points=points), None, None)
    [svg] = re.findall(r"<svg id=over-time .*?</svg>", page, re.S)
    assert svg.count("<circle") == 6 and svg.count("<polyline") == 2
    # 1.0 at the plot's top (y 22), 0.5 halfway down to its bottom (y 216): 119.
    assert "points='48.0,22.0 444.0,22.0 840.0,22.0'" in svg
    assert "points='48.0,119.0 444.0,119.0 840.0,119.0'" in svg
    assert "<title>2026-11-30 09:10 UTC: mean score 50.0% of 3 scored</title>" in svg
    assert ">11-30 09:05</text>" in svg and ">100%</text>" in svg

    single = experiment_page(comparison(points=points[:1]), None, None)
    assert single.count("<circle") == 2 and "<polyline" not in single


@pytest.mark.parametrize(("value", "pct_text", "ms_text", "usd_text"), [
    (None, "–", "–", "–"),
    (0.5, "50.0%", "0 ms", "$0.5000"),
    (1234.5678, "123456.8%", "1,235 ms", "$1,234.57"),
])
def test_numbers(value: float | None, pct_text: str, ms_text: str, usd_text: str) -> None:
    assert (pct(value), ms(value), usd(value)) == (pct_text, ms_text, usd_text)


def test_message_and_request_text() -> None:
    assert message_text(None) == ""
    assert message_text("not json") == "not json"
    assert message_text(json.dumps({"content": [{"type": "text", "text": "a"},
                                                {"type": "image_url"},
                                                {"type": "text", "text": "b"}]})) == "a\nb"
    assert message_text(json.dumps({"content": None, "tool_calls": [{"id": "t"}]})) == \
        'tool calls: [\n {\n  "id": "t"\n }\n]'
    request = json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"text": "hi"}]},
                                       "not a message", {"content": "x" * 5}]})
    assert request_text(request, limit=3) == "system: be …\nuser: hi\n?: xxx…"
    assert request_text("{broken", limit=3) == "{br"
