"""Training assets: ``training_run`` (one job, many segments) and ``checkpoints`` (one partition
per ``<run_id>:<step>``, materialized by the checkpoint sensor from the receiver's rows).

``training_run`` (partitioned like ``training_plan`` by run key) builds the trainer job from the
run's newest plan and the experiment's dataset (or takes a ready job file from its config),
checks that the plan fits its data before any compute (``factory.trainer.data.check_job_data``,
the trainer's own tokenizing: a plan that would drop more than 1% of the samples fails the step
with the numbers, and nothing is launched), submits it to the control plane and follows it to
the end (``factory.control.follow.follow_run``), ticking the control loop itself only while no
daemon evaluates the rollover and recovery sensors (else it watches the run's row); to the team
it is one run, and its metadata shows the segments underneath (provider, sandbox id, first and
last step, why each ended), one loss curve across them (a step redone after a resume keeps the
value of its last run, which is bitwise the same in deterministic mode) and what tokenizing kept
and dropped, by reason (``num_dropped_too_long_for_plan``...), and the plan's predicted training
seconds beside the measured ones. While the run trains, the step's log says the pace it observes
against the plan's (``factory.planner.pace``: the prediction corrected by the run's own steps)
as soon as three steps show it, and again when it moves; a run that ended well on this machine
leaves its pace for the host's next plans (``factory.planner.pace.record_run_pace``). A run
that fails (a data error of the trainer's, say) fails the step with the run's reason; a run the
evals stopped early ends the step once the trainer's stop checkpoint is in the lake.
Interrupted (Ctrl-C, or the Dagster run terminated), the step cancels the trainer run before it
ends.
"""

import dataclasses
import json

import dagster as dg

from factory.control.follow import RunTimedOut, follow_run
from factory.control.jobs import job_from_plan, latest_plan
from factory.control.plane import cancel_run
from factory.control.providers import LocalProvider, SandboxProvider
from factory.dagster_runs import TRAINER_RUN_TAG, sensors_ticking
from factory.errors import FactoryError
from factory.partitions import CHECKPOINTS, RUNS
from factory.planner.pace import PaceWatch, record_run_pace, trainer_events
from factory.process import signals_ignored
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource
from factory.trainer.config import TrainerJob
from factory.trainer.data import check_job_data
from factory.trainer.pids import owner_token

checkpoints = dg.AssetsDefinition(specs=[dg.AssetSpec(
    "checkpoints", partitions_def=CHECKPOINTS, group_name="training", kinds={"iceberg"},
    description="Verified, inference-ready adapter checkpoints (rows of table checkpoints), one "
                "partition per <run_id>:<step>; materialized by checkpoint_sensor from the "
                "trainer's signed checkpoint events.")])


class TrainingRunConfig(dg.Config):
    job_file: str | None = None
    """A ready trainer job JSON (``factory.trainer.config.TrainerJob``) instead of the
    partition's plan."""
    experiment: str = ""
    """Experiment of a ``job_file`` run (a planned run knows its own)."""
    poll_s: float = 5.0
    """Seconds between ticks of the control loop while this run drives it; while it only
    watches, it looks at the run every ``min(poll_s, factory.control.follow.WATCH_S)`` seconds."""
    timeout_s: float | None = None
    """Give up (and stop the run) after this long; None: wait for the run to end."""
    drive: bool | None = None
    """Tick the control loop while waiting. None: only while no daemon evaluates the
    rollover/recovery sensors (which tick it every 15 s), re-checked every
    ``factory.control.follow.DRIVER_CHECK_S``; True or False: always, never."""


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
    watch: PaceWatch | None = None
    try:
        if config.job_file:
            job = TrainerJob.from_json(config.job_file)
        else:
            # The plan and dataset snapshots the job is built from are the run's reads (its
            # submit commit records them for lineage).
            row = latest_plan(session.lake, context.partition_key, lineage=session.lineage)
            job, experiment = job_from_plan(session.lake, context.partition_key,
                                            lineage=session.lineage, plan=row)
            plan = json.loads(row["plan"] or "{}")
            if plan.get("estimates"):
                on_cpu = str(plan["values"].get("gpu", "CPU")).upper() == "CPU"
                watch = PaceWatch(estimates=plan["estimates"], say=context.log.info,
                                  evals_share_devices=on_cpu)
        # Cheap next to any training: SmolLM2's tokenizer loads in ~5 s (transformers' import)
        # and tokenizing takes ~0.7 ms a sample (3000 samples: 2.2 s on one core).
        checked = check_job_data(job)
    except (ValueError, FactoryError) as e:
        raise dg.Failure(f"training_run: {e}", allow_retries=False) from None
    # This step follows the run: should it die (its run worker killed), the trainer stops at
    # its next step with a checkpoint and the plane fails the run instead of resuming it.
    job = dataclasses.replace(job, owner=owner_token())
    plane = provider.plane(session.lake)

    def tag_run() -> None:
        # Who follows this Dagster run (chain_sensor, factory run) finds the trainer run here.
        context.instance.add_run_tags(context.run.run_id, {TRAINER_RUN_TAG: job.run_id})

    try:
        followed = follow_run(plane, job, experiment=experiment, lineage=session.lineage,
                              daemon_ticks=lambda: sensors_ticking(context.instance),
                              poll_s=config.poll_s, timeout_s=config.timeout_s,
                              drive=config.drive, on_submitted=tag_run,
                              on_progress=watch.update if watch else None, log=context.log)
    except RunTimedOut as exc:
        raise dg.Failure(str(exc)) from None
    except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError):
        # Ctrl-C, or the Dagster run terminated (Dagster raises SIGINT and SIGTERM here as
        # DagsterExecutionInterruptedError): the trainer this run launched must not outlive it.
        context.log.warning(f"training run {job.run_id} interrupted: cancelling it")
        with signals_ignored():  # a second Ctrl-C must not cut the cleanup short
            cancel_run(plane, job.run_id, reason="interrupted")
        raise
    on_this_host = all(isinstance(plane.by_name.get(s.provider), LocalProvider | SandboxProvider)
                       for s in followed.segments)
    if watch is not None and followed.failure is None and on_this_host:
        kept = record_run_pace(plan, trainer_events(followed.events), run_id=job.run_id)
        if kept:
            context.log.info(kept)
    metadata = {**followed.metadata(checked),
                **(watch.metadata(followed.events) if watch else {}),
                "segments": dg.MetadataValue.md(followed.segments_table()),
                **session.metadata()}
    if followed.failure is not None:
        raise dg.Failure(followed.failure, metadata=metadata)
    return dg.MaterializeResult(metadata=metadata)
