"""The comparison page (``factory compare``) in Debian's Chromium: what a person sees of a seeded
lake's shadow pairs (agreement, latency and cost figures, the worst pair side by side), the vibe
check against two stand-in models, the promote flow with its confirmation, the price table and
the error pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from factory.app.compare import Compare, Prices, buckets, percentile
from factory.deploy import DeployConfig, Deployer
from factory.gateway import Gateway, ServerThread, load_routes
from factory.gateway.shadow import ShadowRule, register_shadow
from factory.gateway.standin import StandIn
from factory.lake import Lake
from tests.gateway.conftest import make_config
from tests.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
EXP = "triage"
ROUTE = "gpt-4o-mini"
T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
WORST_FRONTIER = "The invoice total is $1,240."
WORST_CANDIDATE = "I cannot help with that."
WORST_ASSESSMENT = "The candidate refused a plain extraction the reference answered."

# Candidate v2's pairs: (minutes after T0, frontier ms, candidate ms, score, passed). Agreement
# 3/5 = 60.0%, mean score 3.25/5 = 0.650; frontier latency p50 300, p95 400 + 0.8 * 100 = 480;
# candidate p50 70, p95 80 + 0.8 * 920 = 816. Every frontier call has 1,000 prompt and 200
# completion tokens: (1000 * 0.15 + 200 * 0.60) / 1e6 * 1000 = $0.27 per 1,000 requests at
# gpt-4o-mini's default price; the candidate's mean 0.252 s * $2/h / 3600 * 1000 = $0.14.
V2 = [(0, 100.0, 50.0, 1.0, True), (30, 200.0, 60.0, 0.9, True), (70, 300.0, 70.0, 0.85, True),
      (100, 400.0, 80.0, 0.4, False), (150, 500.0, 1000.0, 0.1, False)]

def _message(text: str) -> str:
    return '{"role": "assistant", "content": [{"type": "text", "text": ' + \
        f'"{text}"' + "}]}"


def seed(lake: Lake) -> None:
    """Five scored pairs of candidate v2 (numbers above) and one older pair of v1."""
    pairs, scores = [], []
    rows = [("v1", -600, 900.0, 900.0, 1.0, True)] + [("v2", *r) for r in V2]
    for i, (version, minutes, f_ms, c_ms, score, passed) in enumerate(rows):
        worst = score == 0.1
        question = "What is the invoice total?" if worst else f"Ticket {i}: is it urgent?"
        pairs.append({
            "pair_id": f"pair-{i}", "raw_trace_id": f"trace-{i}", "experiment": EXP,
            "version": version, "route": ROUTE, "candidate_model": f"{EXP}-{version}",
            "project": "support",
            "request": '{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "'
                       + question + '"}]}',
            "frontier_message": _message(WORST_FRONTIER if worst else f"urgent {i}"),
            "candidate_message": _message(WORST_CANDIDATE if worst else f"urgent {i}"),
            "frontier_status": 200, "candidate_status": 200, "candidate_error": None,
            "frontier_latency_ms": f_ms, "candidate_latency_ms": c_ms,
            "frontier_prompt_tokens": 1000, "frontier_completion_tokens": 200,
            "candidate_prompt_tokens": 1000, "candidate_completion_tokens": 200,
            "created_at": T0 + timedelta(minutes=minutes)})
        scores.append({"pair_id": f"pair-{i}", "experiment": EXP, "version": version,
                       "rubric_version": "r1", "judge": "stand-in-judge", "score": score,
                       "passed": passed,
                       "assessment": WORST_ASSESSMENT if worst else "same label",
                       "scored_at": T0 + timedelta(hours=6)})
    lake.append("shadow_pairs", pairs)
    lake.append("shadow_scores", scores)


def deployment(version: str, status: str, *, endpoint: str, pid: int | None = None,
               port: int | None = None) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {"name": EXP, "version": version, "checkpoint": f"/ckpt/{version}",
            "base_model": "tiny", "adapter": f"{EXP}-{version}", "route_model": f"factory/{EXP}",
            "endpoint": endpoint, "backend": "transformers", "status": status, "pid": pid,
            "port": port, "log_path": "/dev/null", "started_at": now, "updated_at": now}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.skip("no Debian chromium (`make sysdeps` installs it)")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM,
                                      args=["--no-sandbox", "--headless=new", "--disable-gpu"])
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    from playwright.sync_api import expect

    # Generous bounds for a loaded 2-core machine: actions and assertions wait for the page,
    # the timeout only bounds a failure.
    expect.set_options(timeout=30_000)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    yield context.new_page()
    context.close()


@pytest.fixture()
def lake(factory_home: Path) -> Lake:
    lake = Lake()
    lake.existing_tables()  # the catalog exists before the server's threads open it
    return lake


def serve(lake: Lake, gateway_url: str = "http://127.0.0.1:9") -> ServerThread:
    return ServerThread(Compare(lake, gateway_url=gateway_url,
                                deploy_config=DeployConfig(drain_s=0)))


def test_experiment_page_shows_the_figures_and_the_worst_pair(lake: Lake, page: Any) -> None:
    from playwright.sync_api import expect

    seed(lake)
    with serve(lake) as srv:
        page.goto(srv.url + "/")
        row = page.locator("#experiments tr", has_text=EXP)
        expect(row).to_contain_text("v2")
        expect(row).to_contain_text("60.0%")
        row.get_by_role("link", name=EXP).click()

        expect(page.locator("#version")).to_have_text("v2")
        expect(page.locator("#agreement")).to_contain_text("60.0%")
        expect(page.locator("#agreement")).to_contain_text("3 of 5 scored pairs passed")
        expect(page.locator("#mean-score")).to_contain_text("0.650")
        expect(page.locator("#pairs b")).to_have_text("5")
        expect(page.locator("#frontier-row td")).to_have_text(["300 ms", "480 ms", "$0.2700"])
        expect(page.locator("#candidate-row td")).to_have_text(["70 ms", "816 ms", "$0.1400"])
        # 150 minutes in 5-minute windows: one point per pair on each of the two lines.
        expect(page.locator("#over-time circle")).to_have_count(10)

        worst = page.locator(".pair").first
        expect(worst.locator(".score")).to_have_text("0.10")
        expect(worst.locator(".prompt")).to_contain_text("user: What is the invoice total?")
        expect(worst.locator(".frontier")).to_contain_text(WORST_FRONTIER)
        expect(worst.locator(".candidate")).to_contain_text(WORST_CANDIDATE)
        expect(worst.locator(".assessment")).to_contain_text(WORST_ASSESSMENT)
        expect(page.locator(".pair .score")).to_have_text(["0.10", "0.40", "0.85", "0.90",
                                                           "1.00"])

        page.get_by_role("link", name="v1").click()
        expect(page.locator("#version")).to_have_text("v1")
        expect(page.locator("#agreement")).to_contain_text("100.0%")
        expect(page.locator("#frontier-row td").first).to_have_text("900 ms")


class Captures(list[Any]):
    """The gateway's ingest, keeping the captured records instead of writing the lake."""

    def __call__(self, lake: Any, records: list[Any], *, new_ids: bool = False) -> None:
        self.extend(records)


def test_vibe_check_asks_both_models_at_once(lake: Lake, page: Any) -> None:
    from playwright.sync_api import expect

    seed(lake)
    captures = Captures()
    with ServerThread(StandIn()) as upstream, ServerThread(StandIn()) as candidate, \
            ServerThread(Gateway(make_config(upstream), lake_factory=lambda: None,
                                 ingest=captures)) as gateway, \
            serve(lake, gateway.url) as srv:
        lake.append("deployments", [deployment("v2", "candidate",
                                               endpoint=candidate.url + "/v1")])
        page.goto(f"{srv.url}/e/{EXP}")
        page.locator("#vibe textarea").fill("Is ticket 7 urgent?")
        page.locator("#vibe button").click()
        answers = page.locator("#vibe-answers")
        expect(answers.locator(".frontier")).to_contain_text(f"Frontier: {ROUTE} via the gateway")
        expect(answers.locator(".frontier .answer")).to_have_text("echo: Is ticket 7 urgent?")
        expect(answers.locator(".candidate")).to_contain_text(f"Candidate: v2 ({EXP}-v2)")
        expect(answers.locator(".candidate .answer")).to_have_text("echo: Is ticket 7 urgent?")
        expect(answers.locator(".latency")).to_have_text([re.compile(r"^\d[\d,]* ms$")] * 2)
        assert upstream.app.num_requests == 1 and candidate.app.num_requests == 1
        # The gateway captured the frontier call, tagged as the vibe check's.
        [capture] = wait_until(lambda: list(captures), 30, "the gateway's capture")
        assert capture.tags == {"source": "compare-vibe-check"}

        candidate.stop()  # a candidate that is down: its side says why, the frontier answers
        page.locator("#vibe button").click()
        expect(answers.locator(".candidate .error")).to_contain_text("ConnectError")
        expect(answers.locator(".frontier .answer")).to_have_text("echo: Is ticket 7 urgent?")


def test_vibe_check_sends_the_settings_key_to_a_keyed_gateway(
        lake: Lake, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a factory key exists the gateway refuses calls without one (401): the vibe check
    sends the key of the factory's settings, so its frontier side still answers."""
    from factory.gateway.keys import KeyStore, keys_path

    seed(lake)
    _, key = KeyStore(keys_path(lake.settings)).create("compare")
    monkeypatch.setenv("FACTORY_GATEWAY_KEY", key)
    keyed = Lake()  # the page's lake, its settings read with the key set
    prompt = "Is ticket 7 urgent?"
    with ServerThread(StandIn()) as upstream, ServerThread(StandIn()) as candidate, \
            ServerThread(Gateway(make_config(upstream), lake_factory=lambda: None,
                                 ingest=Captures())) as gateway, \
            serve(keyed, gateway.url) as srv:
        lake.append("deployments", [deployment("v2", "candidate",
                                               endpoint=candidate.url + "/v1")])
        unkeyed = httpx.post(f"{gateway.url}/v1/chat/completions", json={
            "model": ROUTE, "messages": [{"role": "user", "content": prompt}]})
        assert unkeyed.status_code == 401  # the gateway is keyed
        page = httpx.post(f"{srv.url}/e/{EXP}/vibe", data={"prompt": prompt}, timeout=60)
    assert page.status_code == 200
    answers = re.findall(r"<pre class=answer>(.*?)</pre>", page.text)
    assert answers == [f"echo: {prompt}"] * 2, page.text
    assert upstream.app.num_requests == 1


@pytest.fixture()
def candidate_server(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A real server process whose command line holds ``--port N`` (what ``Deployment.alive``
    checks): the stand-in upstream, started again on a fresh port when another process took
    the first; (pid, port)."""
    from factory.inference.launcher import PortInUseError, bind_failed, on_free_port

    log = tmp_path / "candidate.log"

    def start(port: int) -> tuple[subprocess.Popen[bytes], int]:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "factory.gateway.standin",
                                     "--port", str(port)], stdout=out, stderr=out,
                                    env={**os.environ})

        def listening() -> bool:
            if proc.poll() is not None:
                if bind_failed(log.read_text()):
                    raise PortInUseError(f"port {port} was taken first")
                raise RuntimeError(f"stand-in exited with {proc.returncode}: {log.read_text()}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).is_success
            except httpx.HTTPError:
                return False

        try:
            wait_until(listening, 30, "the candidate server")
        except BaseException:
            proc.kill()
            proc.wait(timeout=30)
            raise
        return proc, port

    proc, port = on_free_port(start)
    try:
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_promote_moves_the_route_after_confirmation(lake: Lake, page: Any,
                                                    candidate_server: tuple[int, int]) -> None:
    from playwright.sync_api import expect

    pid, port = candidate_server
    endpoint = f"http://127.0.0.1:{port}/v1"
    seed(lake)
    lake.append("deployments", [deployment("v1", "live", endpoint="http://127.0.0.1:9/v1"),
                                deployment("v2", "candidate", endpoint=endpoint)])
    with serve(lake) as srv:
        page.goto(f"{srv.url}/e/{EXP}")
        page.locator("#promote").click()
        expect(page.locator("#confirm-question")).to_have_text(
            f"Promote {EXP} v2 behind factory/{EXP}?")
        page.locator("#confirm").click()
        # The candidate's row names no running process: the deployer refuses, the page says why.
        expect(page.locator("#promote-error")).to_contain_text(f"candidate {EXP} v2 is not running")
        assert Deployer(lake).live(EXP).version == "v1"  # type: ignore[union-attr]

        lake.append("deployments", [deployment("v2", "candidate", endpoint=endpoint, pid=pid,
                                               port=port)])
        page.goto(f"{srv.url}/e/{EXP}")
        page.locator("#promote").click()
        page.locator("#confirm").click()
        expect(page.locator("#promoted")).to_have_text(
            f"factory/{EXP} is now served by {EXP} v2 ({EXP}-v2 at {endpoint}).")

    deployer = Deployer(lake)
    assert deployer.live(EXP).version == "v2"  # type: ignore[union-attr]
    assert {d.version: d.status for d in deployer.versions(EXP)} == {"v1": "stopped",
                                                                     "v2": "live"}
    route = load_routes(lake)[f"factory/{EXP}"]
    assert (route.base_url, route.deployment, route.version) == (endpoint, f"{EXP}-v2", "v2")


def test_price_table_edits_change_the_cost(lake: Lake, page: Any) -> None:
    from playwright.sync_api import expect

    seed(lake)
    with serve(lake) as srv:
        page.goto(srv.url + "/prices")
        row = page.locator("#prices tr", has=page.locator(f"input[value='{ROUTE}']"))
        row.locator("input").nth(1).fill("abc")
        page.locator("#save").click()
        expect(page.locator("#prices-error")).to_contain_text("'abc' is not a number")

        page.goto(srv.url + "/prices")
        row.locator("input").nth(1).fill("1")
        row.locator("input").nth(2).fill("2")
        page.locator("input[name=machine_per_hour]").fill("4")
        page.locator("#save").click()
        expect(page.locator("#saved")).to_have_text("Saved.")

        page.goto(f"{srv.url}/e/{EXP}")
        # (1000 * 1 + 200 * 2) / 1e6 * 1000 = $1.40; 0.252 s * $4/h / 3600 * 1000 = $0.28.
        expect(page.locator("#frontier-row td").last).to_have_text("$1.4000")
        expect(page.locator("#candidate-row td").last).to_have_text("$0.2800")


def test_unknown_experiment_and_version_are_404_pages(lake: Lake, page: Any) -> None:
    from playwright.sync_api import expect

    seed(lake)
    with serve(lake) as srv:
        response = page.goto(srv.url + "/e/nope")
        assert response.status == 404
        expect(page.locator("#not-found")).to_contain_text("No experiment named nope")
        response = page.goto(f"{srv.url}/e/{EXP}?version=v9")
        assert response.status == 404
        expect(page.locator("#not-found")).to_contain_text("no pairs of version v9")
        assert httpx.post(f"{srv.url}/e/nope/promote", data={"version": "v1"}).status_code == 404


def test_pages_render_with_zero_pairs(lake: Lake, page: Any) -> None:
    from playwright.sync_api import expect

    with serve(lake) as srv:
        page.goto(srv.url + "/")
        expect(page.locator("#no-experiments")).to_be_visible()

        register_shadow(ShadowRule(route=ROUTE, experiment="fresh", version="v1",
                                   base_url="http://127.0.0.1:9/v1", deployment="fresh-v1"),
                        lake=lake)
        page.goto(srv.url + "/")
        page.get_by_role("link", name="fresh").click()
        expect(page.locator("#no-pairs")).to_contain_text("No shadow pairs yet for fresh")
        expect(page.locator("#agreement b")).to_have_text("–")
        expect(page.locator("#frontier-row td")).to_have_text(["–", "–", "–"])
        expect(page.locator("#promote")).to_have_count(0)


def test_foreign_origin_cannot_promote(lake: Lake) -> None:
    seed(lake)
    with serve(lake) as srv:
        r = httpx.post(f"{srv.url}/e/{EXP}/promote", data={"version": "v2"},
                       headers={"Origin": "http://evil.example"})
    assert r.status_code == 403


def test_figures() -> None:
    assert percentile([], 0.5) is None
    assert percentile([500.0, 100.0, 300.0, 200.0, 400.0], 0.95) == pytest.approx(480.0)
    prices = Prices()
    assert prices.of("gpt-4o-mini-2024-07-18") == ("gpt-4o-mini", (0.15, 0.60))
    assert prices.of("gpt-4o-2024-08-06") == ("gpt-4o", (2.50, 10.00))
    assert prices.of("llama-3") is None
    with pytest.raises(ValueError, match="machine_per_hour"):
        Prices(machine_per_hour=-1)
    week = [(T0 + timedelta(days=d), 0.5, d % 2 == 0) for d in range(7)]
    points, label = buckets(week)
    assert label == "6 hours" and [b.agreement for b in points] == [1, 0, 1, 0, 1, 0, 1]


def test_pairs_before_any_score(lake: Lake) -> None:
    pairs = [{"pair_id": "a", "experiment": EXP, "version": "v1", "route": ROUTE,
              "candidate_model": f"{EXP}-v1", "request": "{}", "frontier_message": None,
              "candidate_message": None, "candidate_error": "timed out",
              "frontier_latency_ms": 120.0, "candidate_latency_ms": 60000.0,
              "created_at": T0}]
    lake.append("shadow_pairs", pairs)
    with serve(lake) as srv:
        text = httpx.get(f"{srv.url}/e/{EXP}").text
    assert re.search(r"<tr id=frontier-row><th>Frontier</th><td class=num>120 ms</td>", text)
    # A candidate that gave no answer has no latency to show.
    assert "<tr id=candidate-row><th>Candidate</th><td class=num>–</td>" in text
    assert "1 without a candidate answer" in text and "No scored pairs yet" in text


def test_command_line() -> None:
    from factory.app.cli import build_parser

    args = build_parser().parse_args(["compare", "--gateway", "http://gw:8787"])
    assert (args.host, args.port, args.gateway) == ("127.0.0.1", 8799, "http://gw:8787")


def test_a_broken_price_file_is_named_not_a_crash(lake: Lake, factory_home: Path) -> None:
    seed(lake)
    (factory_home / "compare-prices.json").write_text("{not json")
    with serve(lake) as srv:
        experiment = httpx.get(f"{srv.url}/e/{EXP}")
        prices = httpx.get(f"{srv.url}/prices")
    assert experiment.status_code == 200 and prices.status_code == 200
    assert "compare-prices.json: not a price table" in experiment.text
    assert "Costs use the default prices." in experiment.text
    assert "$0.2700" in experiment.text  # gpt-4o-mini at the default price
    assert "compare-prices.json: not a price table" in prices.text
