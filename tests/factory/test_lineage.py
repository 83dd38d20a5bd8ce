"""A write made by a materialization records its upstream snapshots; ``factory lineage`` shows them."""


import json
from pathlib import Path

import dagster as dg
import pytest

from factory.app.cli import main
from factory.lake import Lake
from factory.resources.lake import LakeResource


@dg.asset(group_name="test", kinds={"iceberg"}, description="raw rows")
def raw_rows(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    session = lake.session(context)
    session.append("raw_traces", [{"raw_trace_id": "r1", "source": "upload"}])
    return dg.MaterializeResult(metadata=session.metadata())


@dg.asset(group_name="test", kinds={"iceberg"}, description="samples from raw rows",
          deps=[raw_rows])
def sample_rows(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    session = lake.session(context)
    raw = session.read("raw_traces")
    session.append("samples", [{"sample_id": "s-" + r, "raw_trace_id": r}
                               for r in raw.column("raw_trace_id").to_pylist()])
    return dg.MaterializeResult(metadata=session.metadata())


def test_materialization_lineage_reaches_cli(factory_home: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    result = dg.materialize([raw_rows, sample_rows], resources={"lake": LakeResource()})
    assert result.success
    lake = Lake()
    raw_snap = lake.snapshot_id("raw_traces")
    [mat] = result.asset_materializations_for_node("sample_rows")
    assert mat.metadata["read_snapshots"].value == {"raw_traces": raw_snap}
    assert mat.metadata["dagster_run_id"].value == result.run_id
    assert mat.metadata["code_version"].value

    assert main(["lineage", "samples", "--format", "json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["asset_key"] == "sample_rows"
    assert tree["run_id"] == result.run_id
    [up] = tree["upstream"]
    assert (up["table"], up["snapshot_id"], up["asset_key"]) == ("raw_traces", raw_snap,
                                                                 "raw_rows")

    samples_snap = lake.snapshot_id("samples")
    assert main(["lineage", f"samples@{samples_snap}"]) == 0
    text = capsys.readouterr().out
    assert f"samples@{samples_snap}" in text
    assert f"raw_traces@{raw_snap}" in text
    assert "by raw_rows" in text
