"""The control plane's assets and sensors compose into Definitions with the resources the lead
adds (``lake``, ``provider``) and an evals asset on the shared ``checkpoints`` partitions."""

from __future__ import annotations

import dagster as dg

import factory.assets.training as training_assets
import factory.sensors.training as training_sensors
from factory.control import CHECKPOINT_PARTITIONS
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource


def test_definitions_resolve(factory_home) -> None:
    # Stands in for the evals issue's asset: only its key and partitions matter here.
    evals = dg.AssetsDefinition(specs=[dg.AssetSpec(
        "checkpoint_evals", group_name="evals", kinds={"python"}, description="stand-in",
        partitions_def=dg.DynamicPartitionsDefinition(name=CHECKPOINT_PARTITIONS))])
    defs = dg.Definitions(
        assets=[*dg.load_assets_from_modules([training_assets]), evals],
        sensors=training_sensors.SENSORS, jobs=training_sensors.JOBS,
        resources={"lake": LakeResource(), "provider": ProviderResource()})
    repo = defs.get_repository_def()
    assert {s.name for s in repo.sensor_defs} == {"checkpoint_sensor", "rollover_sensor",
                                                  "recovery_sensor", "traffic_sensor"}
    graph = repo.asset_graph
    for key in ("training_run", "checkpoints"):
        spec = graph.get(dg.AssetKey(key))
        assert spec.group_name == "training" and spec.description and spec.kinds
    assert graph.get(dg.AssetKey("checkpoints")).partitions_def == \
        graph.get(dg.AssetKey("checkpoint_evals")).partitions_def
