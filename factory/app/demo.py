"""The whole loop on the embedded default, on one machine: what ``make demo`` runs.

1. builds the experiment's base model (``demo-extract``: SmolLM2-135M-Instruct from the wheel;
   ``demo-extract-gemma``: Gemma 3 270M, the same task on the other embedded base);
2. generates demo traffic for the embedded extraction task (``factory.tasks``), tagged with the
   project the experiment selects (``demo_project``), sends part of it through the capture
   gateway (its upstream replays the generator's reference answers, the "frontier model") and
   uploads the rest through the ``traces`` asset;
3. runs the experiment through Dagster (``factory.app.loop.run_experiment``): dataset,
   rubric, plan, LoRA training with evals fired by ``checkpoint_sensor`` as checkpoints land,
   best checkpoint, deployment;
4. sends a new request through the gateway to ``factory/<experiment>``, and shows it captured
   (tagged with the deployment version): the data for v2;
5. prints the summary (each score with its 95% interval and sample count), and returns its last
   line's object.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from factory.app.loop import run_experiment, terminal_plot
from factory.app.materialize import materialize
from factory.base_model import embedded_name
from factory.curation.phrasing import RECALL
from factory.deploy.replay import ReplayUpstream
from factory.errors import FactoryError
from factory.evals.selection import CLEAR_MARGIN
from factory.experiments import load_experiment
from factory.gateway import ServerThread, gateway_in_thread
from factory.gateway.keys import client_headers
from factory.lake import Lake
from factory.settings import get_settings
from factory.tasks import generate_records

if TYPE_CHECKING:
    import openai

    from factory.experiments import Experiment

EXPERIMENT = "demo-extract"
NUM_RECORDS = 480
"""Demo traffic: a train split with enough messages of each kind (a missing name is one in ten)
to answer new requests, and a 10% eval split."""
GATEWAY_SHARE = 4
"""One record in this many goes through the gateway; the rest is uploaded."""
_PROJECT = re.compile(r"""^\s*tags\['project'\]\s*=\s*'([A-Za-z0-9_.-]+)'\s*$""")
"""The selection a demo experiment must have: one project tag, which the demo's traffic carries
(``demo-extract``: ``demo``; ``demo-extract-gemma``: ``demo-gemma``, so that neither experiment
finds samples, and starts, in the other's home)."""
SUMMARY_KEYS = ("base_score", "best_score", "best_step", "endpoint", "model", "factory_home",
                "base_score_interval", "best_score_interval", "showcase_right", "fresh_right",
                "fresh_total")
FRESH_REQUESTS = 20
"""New requests the deployed model answers after the showcase, scored against the reference."""
FRESH_SEED_OFFSET = 1_000_003
"""Fresh requests come from ``generate_records`` at the demo's seed plus this: never traffic."""


def _wait(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise FactoryError(f"demo: timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _one_line(text: str | None, limit: int = 160) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _count_samples(lake: Lake, where: str, params: list[Any]) -> int:
    if not lake.exists("samples"):
        return 0
    return int(lake.sql(f"SELECT count(*) AS n FROM samples WHERE {where}", params)
               .column("n")[0].as_py())


def demo_project(experiment: Experiment) -> str:
    """The project tag experiment ``experiment`` selects (``data.where`` of the form
    ``tags['project'] = '<tag>'``); the demo tags its traffic with it."""
    match = _PROJECT.match(experiment.data.where or "")
    if match is None:
        raise FactoryError(f"demo: experiment {experiment.name} must select its samples with "
                           f"data.where: \"tags['project'] = '<tag>'\", not "
                           f"{experiment.data.where!r}")
    return match.group(1)


def _gateway_client(gateway_url: str, tags: str) -> openai.OpenAI:
    """An OpenAI client of the demo's gateway, sending ``tags`` (``X-Factory-Tags``) and the
    factory key of the settings (``$FACTORY_GATEWAY_KEY``): the gateway checks the keys of the
    home it serves, and once one exists refuses calls without one."""
    import openai

    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="demo", max_retries=0,
                         default_headers={"X-Factory-Tags": tags, **client_headers()})


def _send_traffic(gateway_url: str, records: list[dict[str, Any]], project: str) -> None:
    client = _gateway_client(gateway_url, f"project={project}")
    for i, record in enumerate(records):
        request = record["request"]
        if i % 4 == 3:  # some streamed, like real clients
            stream = client.chat.completions.create(
                model=request["model"], messages=request["messages"],
                temperature=request.get("temperature"), stream=True)
            for _ in stream:
                pass
        else:
            client.chat.completions.create(model=request["model"],
                                           messages=request["messages"],
                                           temperature=request.get("temperature"))


def shortfall(summary: dict[str, Any]) -> str | None:
    """Why the best checkpoint of a demo's ``summary`` does not clearly beat the base model
    (None when it does): the embedded task requires a gain of at least ``CLEAR_MARGIN``."""
    base, best = summary["base_score"], summary["best_score"]
    gain = best - base if base is not None and best is not None else None
    if gain is not None and gain >= CLEAR_MARGIN:
        return None
    verdict = "no score" if gain is None else f"a gain of {gain:.3f}"
    return (f"{verdict} of the best checkpoint over the base model; the embedded task "
            f"requires at least {CLEAR_MARGIN}")


def run_demo(*, experiment: str = EXPERIMENT, num_records: int = NUM_RECORDS, seed: int = 0,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the loop; returns ``{base_score, best_score, best_step, endpoint, model,
    factory_home, base_score_interval, best_score_interval}`` (the ``*_interval`` values: the
    score as ``format_score`` prints it, with its 95% interval and sample count)."""
    say = progress or (lambda line: print(line, flush=True))
    settings = get_settings().ensure()
    started = time.monotonic()
    say(f"factory home: {settings.home}")
    spec = load_experiment(experiment)
    project = demo_project(spec)
    built = embedded_name(spec.recipe)
    if built is None:
        raise FactoryError(f"demo: experiment {experiment}'s recipe {spec.recipe} is not one of "
                           "the embedded base models; the demo trains on those only")
    say(f"[demo 1/4] base model: {built} (built once, then cached)")
    materialize(["base_model"], partition_key=built)

    records = generate_records(num_records, seed)
    via_gateway = records[::GATEWAY_SHARE]
    uploaded = [r for i, r in enumerate(records) if i % GATEWAY_SHARE]
    lake = Lake(settings)
    demo_where = "tags['project'] = ?"
    before = _count_samples(lake, demo_where, [project])
    upstream = ServerThread(ReplayUpstream(records)).start()
    gateway = gateway_in_thread(openai_base_url=upstream.url + "/v1")
    try:
        say(f"[demo 2/4] traffic: {len(via_gateway)} calls through the gateway at {gateway.url}"
            f", {len(uploaded)} records uploaded")
        _send_traffic(gateway.url, via_gateway, project)
        upload = settings.uploads / f"demo-traffic-{project}-{seed}.jsonl"
        upload.write_text("".join(json.dumps(r) + "\n" for r in uploaded))
        materialize(["raw_traces", "samples", "rejected_traces"], run_config={"ops": {
            "traces": {"config": {"paths": [str(upload)], "tags": {"project": project}}}}})
        total = _wait(lambda: (n := _count_samples(lake, demo_where, [project])) >= before
                      + num_records and n, 120, "the gateway's captures in samples")
        say(f"  samples tagged project={project}: {total}")

        say(f"[demo 3/4] {experiment}: dataset -> plan -> training -> evals -> deployment")
        out = run_experiment(experiment, progress=say)
        if out["endpoint"] is None:
            raise FactoryError("demo: the deployment is not live")

        model = out["model"]
        say(f"[demo 4/4] a new request through the gateway to {model}")
        _wait(lambda: (r := gateway.app.routes.get(model)) is not None
              and r.version == out["version"], 30, f"the gateway route of {model}")
        showcase, *fresh = generate_records(1 + FRESH_REQUESTS, seed + FRESH_SEED_OFFSET)
        # Tagged like the demo's traffic: the experiment selects it for the next version's
        # dataset.
        client = _gateway_client(gateway.url, f"project={project},source=demo-check")
        answer = _answer(client, model, showcase)
        showcase_right = same_answer(answer, showcase)
        say(f"  user: {_one_line(showcase['request']['messages'][-1]['content'])}")
        say(f"  {model} ({out['version']}): {_one_line(answer)} "
            f"[{'right' if showcase_right else 'wrong: expected ' + _reference(showcase)}]")
        fresh_client = _gateway_client(gateway.url, f"project={project},source=demo-fresh")
        with ThreadPoolExecutor(4) as pool:
            fresh_right = sum(pool.map(lambda r: same_answer(_answer(fresh_client, model, r), r),
                                       fresh))
        say(f"  {fresh_right} of {len(fresh)} fresh requests answered right (every field of the "
            "reference answer)")
        version_where = "tags['route_version'] = ? AND tags['source'] = ?"
        _wait(lambda: _count_samples(lake, version_where, [out["version"], "demo-check"]), 60,
              "the call in samples")
        row = lake.sql(f"SELECT sample_id, model, tags, created_at FROM samples WHERE "
                       f"{version_where} ORDER BY created_at DESC LIMIT 1",
                       [out["version"], "demo-check"]).to_pylist()[0]
        say(f"  captured: samples row {row['sample_id'][:16]}... model={row['model']} "
            f"tags={dict(row['tags'])} - traffic for the next version")
    finally:
        gateway.stop()
        upstream.stop()

    say("")
    say(f"base score  {out['base_score_interval'] or '-'}")
    say(f"best score  {out['best_score_interval']} at step {out['best_step']} "
        f"(run {out['run_id']})" if out["best_score_interval"] else "best score  -")
    if out["eval_split"] == RECALL:
        say(f"  the eval set measures {out['eval_split_reason']}")
    say(terminal_plot(out["curve"], label="mean rubric score by step (step 0 = base model)"))
    if out["curve_png"]:
        say(f"curve: {out['curve_png']}")
    say(f"endpoint: {out['endpoint']} (deployment {out['version']}, running in the "
        f"background until `FACTORY_HOME={settings.home} factory undeploy {experiment}`); "
        f"stable name: run `factory serve`, then model {model} at "
        "http://127.0.0.1:8787/v1 (`factory chat " + model + "`)")
    say(f"see it all with lineage: FACTORY_HOME={settings.home} factory ui  (then "
        "http://127.0.0.1:3000), or `factory lineage deployments`")
    say(f"demo took {time.monotonic() - started:.0f} s")
    out.update(showcase_right=showcase_right, fresh_right=fresh_right, fresh_total=len(fresh))
    return {k: out[k] for k in SUMMARY_KEYS}


def _answer(client: openai.OpenAI, model: str, record: dict[str, Any]) -> str:
    """The deployed model's greedy answer to ``record``'s request."""
    reply = client.chat.completions.create(model=model, messages=record["request"]["messages"],
                                           max_tokens=96, temperature=0)
    return reply.choices[0].message.content or ""


def _reference(record: dict[str, Any]) -> str:
    return str(record["response"]["choices"][0]["message"]["content"])


def same_answer(answer: str, record: dict[str, Any]) -> bool:
    """Whether ``answer`` is the JSON object of ``record``'s reference answer (every key and
    value equal; spacing and key order aside)."""
    try:
        return bool(json.loads(answer.strip()) == json.loads(_reference(record)))
    except ValueError:
        return False
