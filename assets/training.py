"""Training assets: ``training_run`` (one job, many segments) and ``checkpoints`` (one partition
per ``<run_id>:<step>``, materialized by the checkpoint sensor from the receiver's rows).

``training_run`` (partitioned like ``training_plan`` by run key) builds the trainer job from the
run's newest plan and the experiment's dataset (or takes a ready job file from its config),
checks that the plan fits its data before any compute (``factory.trainer.data.check_job_data``,
the trainer's own tokenizing: a plan that would drop more than 1% of the samples fails the step
with the numbers, and nothing is launched), submits it to the control plane and follows it to
the end, ticking the control loop itself only while no daemon evaluates the rollover and
recovery sensors (else it watches the run's row); to the team it is one run, and its metadata
shows the segments underneath (provider, sandbox id, first and last step, why each ended), one
loss curve across them (a step redone after a resume keeps the value of its last run, which is
bitwise the same in deterministic mode) and what tokenizing kept and dropped, by reason
(``num_dropped_too_long_for_plan``...). A run that fails (a data error of the trainer's, say)
fails the step with the run's reason.
"""

import dataclasses
import time
from typing import Any

import dagster as dg

from factory.control.jobs import job_from_plan
from factory.control.plane import RUN_ACTIVE, cancel_run, loss_curve, reported
from factory.deploy.process import signals_ignored
from factory.errors import FactoryError
from factory.partitions import CHECKPOINTS, RUNS
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource
from factory.runs import TRAINER_RUN_TAG, sensors_ticking
from factory.trainer.config import Job
from factory.trainer.data import DROP_REASONS, check_job_data
from factory.trainer.pids import owner_token
from factory.trainer.webhooks import read_events

checkpoints = dg.AssetsDefinition(specs=[dg.AssetSpec(
    "checkpoints", partitions_def=CHECKPOINTS, group_name="training", kinds={"iceberg"},
    description="Verified, inference-ready adapter checkpoints (rows of table checkpoints), one "
                "partition per <run_id>:<step>; materialized by checkpoint_sensor from the "
                "trainer's signed checkpoint events.")])

WATCH_S = 2.0
"""Seconds between looks at the run while the sensors drive it: one catalog lookup of
``training_runs``' snapshot (about 1.5 ms CPU), the table re-read only when it changed, so the
run's end shows here within 2 s of the plane recording it."""
STOP_CHECKPOINT_S = 120.0
"""How long a stopped run's step waits for the trainer's last checkpoint to reach the lake (the
trainer's SIGTERM grace, then a sensor tick)."""
DRIVER_CHECK_S = 30.0
"""Seconds between checks of whether the daemon's sensors tick the plane (about 10 ms each)."""


class TrainingRunConfig(dg.Config):
    job_file: str | None = None
    """A ready trainer job JSON (``factory.trainer.config.Job``) instead of the partition's plan."""
    experiment: str = ""
    """Experiment of a ``job_file`` run (a planned run knows its own)."""
    poll_s: float = 5.0
    """Seconds between ticks of the control loop while this run drives it; while it only
    watches, it looks at the run every ``min(poll_s, WATCH_S)`` seconds."""
    timeout_s: float | None = None
    """Give up (and stop the run) after this long; None: wait for the run to end."""
    drive: bool | None = None
    """Tick the control loop while waiting. None: only while no daemon evaluates the
    rollover/recovery sensors (which tick it every 15 s), re-checked every ``DRIVER_CHECK_S``;
    True or False: always, never."""


@dg.asset(group_name="training", kinds={"python", "pytorch"}, partitions_def=RUNS,
          deps=["training_plan",
                dg.AssetDep("base_model", partition_mapping=dg.AllPartitionMapping())],
          description="A training run as one job: its plan checked against its data, submitted "
                      "to the provider ladder, rolled over and recovered by the control plane; "
                      "metadata lists its segments, one loss curve and the samples dropped, by "
                      "reason.")
def training_run(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                 lake: LakeResource, provider: ProviderResource) -> dg.MaterializeResult:
    session = lake.session(context)
    experiment = config.experiment
    try:
        if config.job_file:
            job = Job.from_json(config.job_file)
        else:
            # The plan and dataset snapshots the job is built from are the run's reads (its
            # submit commit records them for lineage).
            job, experiment = job_from_plan(session.lake, context.partition_key,
                                            lineage=session.lineage)
        # Cheap next to any training: SmolLM2's tokenizer loads in ~5 s (transformers' import)
        # and tokenizing takes ~0.7 ms a sample (3000 samples: 2.2 s on one core).
        checked = check_job_data(job)
    except (ValueError, FactoryError) as e:
        raise dg.Failure(f"training_run: {e}", allow_retries=False) from None
    # This step follows the run: should it die (its run worker killed), the trainer stops at
    # its next step with a checkpoint and the plane fails the run instead of resuming it.
    job = dataclasses.replace(job, owner=owner_token())
    plane = provider.plane(session.lake)
    plane.submit(job, experiment=experiment, lineage=session.lineage)
    # Who follows this Dagster run (chain_sensor, factory run) finds the trainer run here.
    context.instance.add_run_tags(context.run.run_id, {TRAINER_RUN_TAG: job.run_id})
    start = time.monotonic()
    driving, decided = bool(config.drive), None
    seen: int | None = None  # the training_runs snapshot the run was last read at
    try:
        while True:
            if config.drive is None and (decided is None
                                         or time.monotonic() - decided >= DRIVER_CHECK_S):
                # Two tickers of one plane would do every read and commit twice.
                now_driving = not sensors_ticking(context.instance)
                if decided is None or now_driving != driving:
                    context.log.info(f"training run {job.run_id}: " + (
                        "this step ticks the control loop" if now_driving
                        else "the daemon's rollover and recovery sensors tick the control loop"))
                driving, decided = now_driving, time.monotonic()
            if driving:
                plane.tick()
            snapshot = session.lake.snapshot_id("training_runs")
            if snapshot is None or snapshot != seen:
                seen = snapshot
                run = plane.runs()[job.run_id]
                if run.status not in RUN_ACTIVE:
                    break
            if config.timeout_s is not None and time.monotonic() - start > config.timeout_s:
                plane.stop_run(job.run_id, reason=f"timeout after {config.timeout_s} s")
                raise dg.Failure(f"training run {job.run_id} did not end in "
                                 f"{config.timeout_s} s")
            time.sleep(config.poll_s if driving else min(config.poll_s, WATCH_S))
    except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError):
        # Ctrl-C, or the Dagster run terminated (Dagster raises SIGINT and SIGTERM here as
        # DagsterExecutionInterruptedError): the trainer this run launched must not outlive it.
        context.log.warning(f"training run {job.run_id} interrupted: cancelling it")
        with signals_ignored():  # a second Ctrl-C must not cut the cleanup short
            cancel_run(plane, job.run_id, reason="interrupted")
        raise
    if run.status == "stopped":
        # An early stop marks the run at once, and the trainer then writes a checkpoint of
        # where it stopped: that checkpoint must be in the lake before this step ends, or the
        # best checkpoint is selected before its evaluation is even requested.
        missing = _await_stop_checkpoints(plane, session.lake, job.run_id, drive=driving)
        if missing:
            context.log.warning(f"training run {job.run_id}: {len(missing)} checkpoint event(s) "
                                f"of the stopped trainer not in the lake after "
                                f"{STOP_CHECKPOINT_S:.0f} s")
    segs = plane.segments(job.run_id)
    events = plane.events(job.run_id)
    curve = loss_curve(events)
    rows = "\n".join(
        f"| {s.segment_id} | {s.provider} | {s.handle.handle_id} | {s.first_step} | "
        f"{s.last_step} | {s.end_reason} |" for s in segs)
    metadata: dict[str, Any] = {
        "run_id": job.run_id, "status": run.status, "reason": run.reason,
        "num_segments": len(segs), "num_recoveries": run.num_recoveries,
        "learning_rate": run.learning_rate,
        "segments": dg.MetadataValue.md(
            "| segment | provider | sandbox | first step | last step | ended |\n"
            "|---|---|---|---|---|---|\n" + rows),
        "loss_curve": dg.MetadataValue.json({"step": [s for s, _ in curve],
                                             "loss": [v for _, v in curve]}),
    }
    if curve:
        metadata["final_loss"] = curve[-1][1]
    # What tokenizing keeps and drops of every row of the (primary) training source: the
    # pre-launch check's counts, by the trainer's own rules. The trainer streams and reports
    # only the first window it tokenized (``started``: ``data``, at most 1024 samples).
    metadata.update(_data_metadata(vars(checked)))
    # The trainer's shared_prefix summary: micro-batches of its first window (an epoch when the
    # data fits one) that computed a shared prefix once, and the tokens computed against the
    # samples' own.
    shared = reported(events, "shared_prefix")
    if shared:
        metadata["shared_prefix"] = dg.MetadataValue.json(shared)
    # What the trainer computed in: the plan's precision, or fp32 on a CPU that would emulate
    # bf16 (factory.trainer.precision), with why.
    ran = reported(events, "precision")
    if ran:
        metadata["precision"] = str(ran["ran"]) + (f" ({ran['reason']})" if ran["reason"] else "")
    metadata.update(session.metadata())
    # "stopped" is the evals' early stop (the score fell after its peak): the run ended as it
    # should, and its best checkpoint is selected like a finished run's.
    if run.status not in ("finished", "stopped"):
        raise dg.Failure(f"training run {job.run_id} {run.status}: {run.reason}",
                         metadata=metadata)
    return dg.MaterializeResult(metadata=metadata)


def _await_stop_checkpoints(plane: Any, lake: Any, run_id: str, *, drive: bool) -> list[str]:
    """Wait (up to ``STOP_CHECKPOINT_S``) until the run's stopped trainers have exited and every
    checkpoint event in their events files is a row of ``checkpoints``; sync the events here
    when no sensor does (``drive``). Returns the event ids still missing."""
    deadline = time.monotonic() + STOP_CHECKPOINT_S
    segs = plane.segments(run_id)
    while True:
        running = [s for s in segs if s.provider in plane.by_name
                   and not plane.by_name[s.provider].status(s.handle).done]
        wanted = {ev["event_id"] for s in segs if s.handle.info.get("events_file")
                  for ev in read_events(s.handle.info["events_file"])
                  if ev.get("type") == "checkpoint" and ev.get("event_id")}
        if not running:
            if drive:
                plane.sync_events()
            have = set()
            if wanted and lake.exists("checkpoints"):
                have = {r["event_id"] for r in lake.sql(
                    "SELECT event_id FROM checkpoints WHERE run_id = ?", [run_id]).to_pylist()}
            missing = sorted(wanted - have)
            if not missing:
                return []
        else:
            missing = sorted(wanted)
        if time.monotonic() > deadline:
            return missing
        time.sleep(WATCH_S)


def _data_metadata(stats: dict[str, Any]) -> dict[str, Any]:
    """``factory.trainer.data.DataStats`` (as the trainer reports it) as flat counts, one per drop
    reason."""
    by_reason = stats.get("num_dropped_by_reason") or {}
    out: dict[str, Any] = {k: stats[k] for k in ("num_samples", "num_examples", "num_dropped",
                                                  "max_sample_tokens") if k in stats}
    out.update({f"num_dropped_{r}": int(by_reason.get(r, 0)) for r in DROP_REASONS})
    return out
