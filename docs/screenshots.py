"""Screenshots of the Dagster UI after the loop ran the git path, for the docs.

What it does, in a fresh temporary factory (its own FACTORY_HOME, models and experiments
folders; nothing of yours is touched):

1. symlinks the tiny test model (``tests.conftest._models_cache()/TINY_NAME``) as the base
   model ``smollm2-135m-instruct``, so the whole chain runs in a few minutes on CPU;
2. starts ``factory ui`` (``dagster dev``: webserver and daemon) on a free port;
3. materializes ``base_model`` and ingests 30 demo support-extract records tagged
   ``project=demo`` as the UI's Materialize buttons do (GraphQL ``launchRun``; the ingest
   run gets the file and the tag in its config);
4. drops ``tiny.yaml`` into the experiments folder (the git path) and follows the chain the
   experiments sensor starts until ``chain_sensor`` records it as ``deployed``;
5. opens the UI in headless Chromium and saves ``docs/asset-graph.png`` (global asset lineage,
   ``/asset-groups``, every group expanded, the graph centered; 1600 px wide) and
   ``docs/score-curve.png`` (``/assets/best_checkpoint?partition=tiny``: the Overview tab,
   whose latest materialization's metadata holds the ``score_curve`` table and the ``curve``
   PNG path); a fresh instance's "Join the Dagster community" dialog is skipped;
6. stops the UI (SIGINT to its process group) and the deployed inference server.

Needs Debian's Chromium and Playwright's Python package, without Playwright's own browser
download (the screenshots are a docs artifact: playwright is not a project dependency)::

    apt-get install -y chromium chromium-driver
    PIP_CONSTRAINT=constraints.txt .venv/bin/pip install playwright

Run from the repository root (3 to 7 minutes on 2 cores, most of it the chain)::

    PYTHONPATH=. .venv/bin/python docs/screenshots.py            # writes docs/*.png
    PYTHONPATH=. .venv/bin/python docs/screenshots.py --keep     # and keeps the temp factory
    PYTHONPATH=. .venv/bin/python docs/screenshots.py --reuse DIR  # shoot a kept factory again
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
EXPERIMENT = "tiny"
TINY = """name: tiny
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 4, checkpoint_every_steps: 2}
eval: {judge: embedded, rubric: auto, max_samples: 4}
"""
CHAIN_S = 1200.0

LAUNCH = """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } ... on InvalidSubsetError { message } } }"""
STATUS = """query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }"""
LOCATIONS = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories { name } }
  ... on PythonError { message } } } } } }"""


def log(msg: str, t0: float = time.monotonic()) -> None:
    print(f"{time.monotonic() - t0:7.1f}s {msg}", flush=True)


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} in {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gql(url: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    r = httpx.post(url, json={"query": query, "variables": variables or {}}, timeout=60)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    if "errors" in body:
        raise RuntimeError(body["errors"])
    return body["data"]


def setup_env(work: Path) -> None:
    """The temp factory's folders and environment (set before anything reads settings)."""
    home, models, exps = work / "home", work / "models", work / "experiments"
    (home / "dagster").mkdir(parents=True, exist_ok=True)
    models.mkdir(exist_ok=True)
    exps.mkdir(exist_ok=True)
    os.environ.update(FACTORY_HOME=str(home), FACTORY_MODELS_DIR=str(models),
                      FACTORY_EXPERIMENTS_DIR=str(exps), DAGSTER_HOME=str(home / "dagster"))
    link = models / "smollm2-135m-instruct"
    if not link.exists():
        from factory.trainer.base_models import TINY_NAME
        from tests.conftest import _models_cache

        link.symlink_to(_models_cache() / TINY_NAME)


class FactoryUI:
    """``factory ui`` on ``port`` in its own session, SIGINT reset to the default (a process
    started in the background inherits it ignored), stopped by SIGINT to its group."""

    def __init__(self, port: int, logfile: Path) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.graphql = self.base + "/graphql"
        with open(logfile, "ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "factory"), "ui", "--port", str(port)],
                cwd=ROOT, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.location, self.repo = wait_until(self._loaded, 300, "code location in the UI", 2)

    def _loaded(self) -> tuple[str, str] | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"factory ui exited with {self.proc.returncode}")
        try:
            entries = gql(self.graphql, LOCATIONS)["workspaceOrError"]["locationEntries"]
        except Exception:  # not up yet
            return None
        for entry in entries:
            loc = entry["locationOrLoadError"]
            if loc and loc["__typename"] == "RepositoryLocation":
                return entry["name"], loc["repositories"][0]["name"]
            if loc and loc["__typename"] == "PythonError":
                raise RuntimeError(loc["message"])
        return None

    def launch(self, job: str, *, assets: list[str] | None = None,
               run_config: dict[str, Any] | None = None) -> str:
        selector: dict[str, Any] = {"repositoryLocationName": self.location,
                                    "repositoryName": self.repo, "jobName": job}
        if assets is not None:
            selector["assetSelection"] = [{"path": [a]} for a in assets]
        res = gql(self.graphql, LAUNCH, {"p": {"selector": selector,
                                               "runConfigData": run_config or {}}})["launchRun"]
        if res["__typename"] != "LaunchRunSuccess":
            raise RuntimeError(f"launch of {job} refused: {res}")
        return str(res["run"]["runId"])

    def wait_run(self, run_id: str, timeout_s: float = 600) -> str:
        def ended() -> str | None:
            status = gql(self.graphql, STATUS, {"id": run_id})["runOrError"]["status"]
            return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None
        return str(wait_until(ended, timeout_s, f"end of run {run_id}", 2))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # nothing of its session may outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_git_path(ui: FactoryUI, work: Path) -> str:
    """Base model and demo data through the UI's launches, then the experiment file."""
    import dagster as dg

    from factory.app.client import follow
    from factory.app.instance import instance
    from factory.tasks import generate_records

    status = ui.wait_run(ui.launch("__ASSET_JOB", assets=["base_model"]))
    log(f"base_model: {status.lower()}")
    upload = work / "demo-records.jsonl"  # outside $FACTORY_HOME/uploads: no sensor run too
    upload.write_text("".join(json.dumps(r) + "\n" for r in generate_records(30, 0)))
    status = ui.wait_run(ui.launch("ingest_uploads_job", run_config={"ops": {"traces": {
        "config": {"paths": [str(upload)], "tags": {"project": "demo"}}}}}))
    log(f"ingest (raw_traces, samples, rejected_traces): {status.lower()}")

    (Path(os.environ["FACTORY_EXPERIMENTS_DIR"]) / f"{EXPERIMENT}.yaml").write_text(TINY)
    log(f"dropped {EXPERIMENT}.yaml into the experiments folder")
    inst = instance()
    start = wait_until(lambda: inst.get_runs(filters=dg.RunsFilter(
        job_name="start_experiment_job", tags={"dagster/partition": EXPERIMENT}), limit=1),
        300, "start of the chain by the experiments sensor", 2)[0]
    log(f"chain started: {start.run_id}")
    outcome = follow(inst, start.run_id, log, poll_s=2.0)
    log(f"chain outcome: {outcome}")
    return outcome


GRAPH_BOX = """() => {
  // The graph: the union of its groups and nodes on screen; the canvas: the panel that pans
  // it (the transformed layer's parent), less the search bar floating over its top.
  const svg = document.querySelector("svg[class*='svgContainer']");
  const rects = [...svg.querySelectorAll("foreignObject")].map(e => e.getBoundingClientRect());
  const gx = Math.min(...rects.map(r => r.left)), gy = Math.min(...rects.map(r => r.top));
  const gw = Math.max(...rects.map(r => r.right)) - gx;
  const gh = Math.max(...rects.map(r => r.bottom)) - gy;
  const c = svg.parentElement.parentElement.getBoundingClientRect();
  return {gx, gy, gw, gh, cx: c.x, cy: c.y + 50, cw: c.width, ch: c.height - 50};
}"""


def screenshots(base: str, out: Path) -> list[Path]:
    """The global asset lineage with every group expanded, then best_checkpoint's page."""
    import re

    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    shots = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        # A 2000x1250 CSS viewport at scale 0.8: a 1600x1000 PNG, and room enough that the
        # graph keeps its detailed nodes (status, partitions, checks) instead of bare names.
        page = browser.new_page(viewport={"width": 2000, "height": 1250},
                                device_scale_factor=0.8)

        # The "Join the Dagster community" dialog of a fresh instance opens a few seconds
        # after the page: dismiss it whenever it is in the way of an action, and before a shot.
        skip = page.get_by_role("button", name="Skip")
        page.add_locator_handler(skip, lambda loc: loc.click())

        def goto(path: str, ready: Callable[[], Any]) -> None:
            page.goto(base + path, wait_until="domcontentloaded")
            ready()

        def dismiss() -> None:  # for what is not a locator action (mouse, screenshot)
            if skip.count():
                skip.first.click()
                page.wait_for_timeout(1000)

        def shoot(name: str) -> None:
            dismiss()
            shots.append(out / name)
            page.screenshot(path=str(shots[-1]))

        def graph_ready() -> None:
            page.get_by_text("training", exact=True).last.wait_for(timeout=120_000)

        goto("/asset-groups", graph_ready)
        try:  # a fresh instance's dialog: wait for it before opening menus it would close
            skip.wait_for(timeout=15_000)
            dismiss()
        except PlaywrightTimeout:
            pass
        page.get_by_text("Hide navigation").click()
        # Expand all groups (remembered in local storage), then load again so the graph is
        # laid out expanded from the start.
        page.locator("[aria-label='settings']").last.click()
        page.get_by_role("menuitem", name=re.compile("Expand all groups")).click()
        page.keyboard.press("Escape")
        page.wait_for_timeout(1000)
        goto("/asset-groups", graph_ready)
        page.locator("button:has([aria-label='panel_show_right'])").first.click()  # asset tree
        page.get_by_text("best_checkpoint", exact=True).first.wait_for(timeout=60_000)
        page.wait_for_timeout(6000)  # statuses and edges arrive after the nodes
        dismiss()
        box = page.evaluate(GRAPH_BOX)
        extra = box["gh"] + 40 - box["ch"]
        if extra > 0:  # taller than the canvas: a taller page, not a smaller graph
            page.set_viewport_size({"width": 2000, "height": 1250 + int(extra)})
            page.wait_for_timeout(1500)
            box = page.evaluate(GRAPH_BOX)
        # Drag the background so the graph is centered in the canvas.
        dx = box["cx"] + (box["cw"] - box["gw"]) / 2 - box["gx"]
        dy = box["cy"] + (box["ch"] - box["gh"]) / 2 - box["gy"]
        x0, y0 = box["cx"] + box["cw"] - 60, box["cy"] + 10
        page.mouse.move(x0, y0)
        page.mouse.down()
        page.mouse.move(x0 + dx, y0 + dy, steps=20)
        page.mouse.up()
        page.wait_for_timeout(2000)
        shoot("asset-graph.png")

        page.set_viewport_size({"width": 2000, "height": 1250})
        goto(f"/assets/best_checkpoint?partition={EXPERIMENT}",
             lambda: page.get_by_text("score_curve").first.wait_for(timeout=120_000))
        page.wait_for_timeout(4000)
        shoot("score-curve.png")
        browser.close()
    return shots


def stop_deployments() -> None:
    from factory.deploy import DeployConfig, Deployer
    from factory.process import stop_group

    try:
        if Deployer().live(EXPERIMENT) is not None:
            Deployer(config=DeployConfig(drain_s=0)).undeploy(EXPERIMENT)
        for dep in Deployer().versions():
            if dep.alive:
                stop_group(int(dep.pid or 0), timeout_s=10)
    except Exception as exc:  # the lake was never made: nothing was deployed
        log(f"(stopping deployments: {exc!r})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    ap.add_argument("--keep", action="store_true", help="keep the temporary factory")
    ap.add_argument("--reuse", type=Path, help="a kept factory: only start the UI and shoot")
    args = ap.parse_args()
    work = args.reuse or Path(tempfile.mkdtemp(prefix="factory-screens-"))
    setup_env(work)
    log(f"factory in {work}")
    ui = FactoryUI(free_port(), work / "ui.log")
    log(f"factory ui on {ui.base} (log {work / 'ui.log'})")
    try:
        if not args.reuse and run_git_path(ui, work) != "deployed":
            return 1
        for path in screenshots(ui.base, args.out):
            log(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    finally:
        ui.stop()
        stop_deployments()
        if not (args.keep or args.reuse):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
