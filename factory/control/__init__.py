"""The control plane: a ladder of compute providers, a priority scheduler, run/segment state,
the trainer-event receiver, and the loop functions the training sensors call.

To the team a training run is one job; underneath it is a chain of *segments*, each one trainer
process on some provider (our cluster, a serverless sandbox), each resuming from the previous
segment's last verified checkpoint. ``factory.control.plane`` decides when a segment starts,
rolls over, is recovered or ends; ``factory.control.scheduler`` decides where.
"""

CHECKPOINT_PARTITIONS = "checkpoints"
"""Dynamic partitions of ``checkpoints`` and ``checkpoint_evals``: one per ``<run_id>:<step>``."""


def checkpoint_partition_key(run_id: str, step: int) -> str:
    return f"{run_id}:{int(step)}"
