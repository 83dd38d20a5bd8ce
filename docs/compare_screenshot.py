"""The screenshot of the comparison page (``factory compare``) for the docs: ``docs/compare.png``.

In a fresh temporary factory (its own FACTORY_HOME; nothing of yours is touched) it writes a
day of made-up shadow pairs and scores of experiment ``support-triage`` (candidate v3 against
``gpt-4o-mini``, a fixed random seed), a live v2 and a candidate v3 in ``deployments``, serves
the page in a thread and saves the experiment page from Debian's Chromium (no Playwright
browser download)::

    PYTHONPATH=. .venv/bin/python docs/compare_screenshot.py     # writes docs/compare.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
EXP = "support-triage"
ROUTE = "gpt-4o-mini"
LABELS = ["billing", "bug", "account", "feature-request", "outage"]
TICKETS = {
    "billing": "I was charged twice for my March invoice, please refund one of them.",
    "bug": "The export button does nothing when the report has more than 500 rows.",
    "account": "I can't log in after changing my email address.",
    "feature-request": "Could you add dark mode to the dashboard?",
    "outage": "Nothing loads for anyone in our Berlin office since 9am.",
}


def _message(text: str) -> str:
    return json.dumps({"role": "assistant", "content": [{"type": "text", "text": text}]})


def seed(lake: Any, rng: random.Random) -> None:
    """200 pairs over 24 hours; the candidate agrees more often as the day goes on (a newer
    adapter warmed up on the afternoon's traffic is what such a curve usually shows)."""
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=24)
    pairs, scores = [], []
    for i in range(200):
        at = start + timedelta(minutes=rng.uniform(0, 24 * 60))
        label = rng.choice(LABELS)
        hit = rng.random() < 0.78 + 0.17 * (at - start).total_seconds() / 86400
        wrong = rng.choice([x for x in LABELS if x != label])
        answer = {"label": label if hit else wrong, "priority": "high" if label == "outage"
                  else "normal"}
        reference = {"label": label, "priority": answer["priority"]}
        pairs.append({
            "pair_id": f"p{i:04d}", "raw_trace_id": f"t{i:04d}", "experiment": EXP,
            "version": "v3", "route": ROUTE, "candidate_model": f"{EXP}-v3", "project": "support",
            "request": json.dumps({"model": ROUTE, "messages": [
                {"role": "system", "content": "Classify the support ticket. Answer JSON: "
                                              "{\"label\": ..., \"priority\": ...}."},
                {"role": "user", "content": TICKETS[label]}]}),
            "frontier_message": _message(json.dumps(reference)),
            "candidate_message": _message(json.dumps(answer)),
            "frontier_status": 200, "candidate_status": 200, "candidate_error": None,
            "frontier_latency_ms": rng.lognormvariate(6.4, 0.35),
            "candidate_latency_ms": rng.lognormvariate(5.0, 0.3),
            "frontier_prompt_tokens": rng.randint(380, 520),
            "frontier_completion_tokens": rng.randint(12, 20),
            "candidate_prompt_tokens": rng.randint(380, 520),
            "candidate_completion_tokens": rng.randint(12, 20), "created_at": at})
        scores.append({
            "pair_id": f"p{i:04d}", "experiment": EXP, "version": "v3", "rubric_version": "r2",
            "judge": "label_match", "score": 1.0 if hit else rng.choice([0.0, 0.5]),
            "passed": hit, "scored_at": at + timedelta(minutes=5),
            "assessment": "label and priority match the reference" if hit else
            f"label {wrong!r} where the reference says {label!r}"})
    lake.append("shadow_pairs", pairs)
    lake.append("shadow_scores", scores)
    now = datetime.now(UTC)
    lake.append("deployments", [
        {"name": EXP, "version": v, "checkpoint": f"/factory/checkpoints/{EXP}/{v}",
         "base_model": "smollm2-135m-instruct", "adapter": f"{EXP}-{v}",
         "route_model": f"factory/{EXP}", "endpoint": f"http://127.0.0.1:{port}/v1",
         "backend": "vllm", "status": status, "pid": None, "port": port,
         "log_path": "/dev/null", "started_at": now, "updated_at": now}
        for v, status, port in (("v2", "live", 41021), ("v3", "candidate", 41187))])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DOCS / "compare.png")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="factory-compare-"))
    os.environ["FACTORY_HOME"] = str(work / "home")
    try:
        from playwright.sync_api import sync_playwright

        from factory.app.compare import Compare
        from factory.gateway import ServerThread
        from factory.lake import Lake

        lake = Lake()
        seed(lake, random.Random(25))
        with ServerThread(Compare(lake)) as srv, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--headless=new", "--disable-gpu"])
            # The summary, chart, figures and the two worst pairs; the rest is more of the same.
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(f"{srv.url}/e/{EXP}")
            page.locator("#over-time").wait_for()
            page.screenshot(path=str(args.out))
            browser.close()
        print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
