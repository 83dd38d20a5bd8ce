"""``dataset`` and ``dataset_profile`` materialized in process on a fresh lake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.lake import Lake
from factory.tasks.planted import Planted

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")


def _setup(home: Path, monkeypatch: pytest.MonkeyPatch, data: Planted, where: str) -> None:
    exps = home / "experiments"
    exps.mkdir()
    (exps / "support.yaml").write_text(
        f'name: support\ndata: {{where: "{where}", max_tokens: 1024}}\n'
        "recipe: smollm2-135m-lora\n")
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exps))
    Lake().append("samples", data.table())


def _run(key: str = "support", engine: str | None = None) -> Any:
    from factory.assets.curation import dataset, dataset_profile
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", [key])
    run_config = {"ops": {"dataset": {"config": {"engine": engine}}}} if engine else None
    return dg.materialize([dataset, dataset_profile], instance=instance, partition_key=key,
                          resources={"lake": LakeResource(), "judge": EmbeddedJudgeResource()},
                          run_config=run_config, raise_on_error=False)


def _checks(result: Any) -> dict[str, bool]:
    return {e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data.passed
            for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


def test_materialize_writes_versions_and_is_repeatable(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, planted_data: Planted) -> None:
    _setup(factory_home, monkeypatch, planted_data, "tags['project'] = 'support'")
    first = _run()
    assert first.success
    assert _checks(first) == {"no_empty_assistant_turns": True, "no_train_eval_overlap": True,
                              "eval_not_empty": True}
    lake = Lake()
    flt = "experiment = 'support'"
    before = [lake.read(t, row_filter=flt).sort_by("sample_id")
              for t in ("dataset_train", "dataset_eval")]
    drops = lake.read("dataset_drops", row_filter=flt)
    assert set(drops.column("reason").to_pylist()) >= {"duplicate", "near_duplicate", "refusal"}
    # the JSON project is outside the selection: no format drops
    assert "format" not in drops.column("reason").to_pylist()
    mat = first.asset_materializations_for_node("dataset")[0]
    assert "Trace-pattern report" in mat.metadata["report"].value
    assert _run().success
    after = [lake.read(t, row_filter=flt).sort_by("sample_id")
             for t in ("dataset_train", "dataset_eval")]
    assert all(a.equals(b) for a, b in zip(before, after, strict=True))
    profile = lake.read("dataset_profile").to_pylist()
    assert len(profile) == 1 and profile[0]["num_train"] == before[0].num_rows
    assert profile[0]["samples_snapshot_id"] == lake.snapshot_id("samples")
    assert profile[0]["prompt_tokens_p50"] > 0
    # how the eval set was held out reaches the profile the planner reads, and the UI
    assert profile[0]["eval_split"] == "phrasing", profile[0]["eval_split_reason"]
    assert profile[0]["eval_split_reason"] == mat.metadata["eval_split_reason"].value
    assert profile[0]["num_phrasing_clusters"] > 20


def test_blocking_check_stops_the_profile(factory_home: Path, monkeypatch: pytest.MonkeyPatch,
                                          planted_data: Planted) -> None:
    # one sample selected: it lands in train, the eval set is empty
    sid = planted_data.rows[0]["sample_id"]
    _setup(factory_home, monkeypatch, planted_data, f"sample_id = '{sid}'")
    result = _run()
    assert not result.success
    assert _checks(result)["eval_not_empty"] is False
    assert not Lake().exists("dataset_profile")


def test_unknown_engine_is_refused_before_anything_is_written(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, planted_data: Planted) -> None:
    _setup(factory_home, monkeypatch, planted_data, "true")
    result = _run(engine="duckdb")
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    error = failure.event_specific_data.error
    assert "engine 'duckdb': choose one of embedded, spark" in error.cause.message
    assert not Lake().exists("dataset_train")


@pytest.mark.slow
def test_cli_materializes_with_the_chosen_engine(factory_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from factory.app.cli import main
    from factory.tasks.planted import planted
    from tests.curation.conftest import CONFIG

    _setup(factory_home, monkeypatch, planted(40, config=CONFIG, seed=2), "true")
    assert main(["dataset", "support", "--engine", "embedded"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["engine"] == "embedded" and line["train"] > 0 and line["eval"] > 0
    assert line["train"] == Lake().read("dataset_train").num_rows
    assert Lake().read("dataset_profile").to_pylist()[0]["engine"] == "embedded"
    with pytest.raises(SystemExit):
        main(["dataset", "support", "--engine", "duckdb"])
    assert "invalid choice: 'duckdb'" in capsys.readouterr().err


def test_profile_counts_are_the_trainers(factory_home: Path, monkeypatch: pytest.MonkeyPatch,
                                         planted_data: Planted, smollm2_dir: Path) -> None:
    """Tool-calling samples included: the profile's lengths are what the trainer tokenizes."""
    import numpy as np
    import orjson

    from factory.trainer.chat import encode, load_tokenizer

    _setup(factory_home, monkeypatch, planted_data, "tags['project'] = 'support'")
    assert _run().success
    lake = Lake()
    train = lake.read("dataset_train", row_filter="experiment = 'support'")
    assert any(train.column("has_tool_calls").to_pylist())
    tok = load_tokenizer(str(smollm2_dir))
    lengths = [len(encode(orjson.loads(m), orjson.loads(t or "[]"), tok)[0])
               for m, t in zip(train.column("messages").to_pylist(),
                               train.column("tools").to_pylist(), strict=True)]
    assert train.column("num_tokens").to_pylist() == lengths
    profile = lake.read("dataset_profile").to_pylist()[0]
    assert profile["total_tokens_max"] == max(lengths)
    assert profile["total_tokens_p99"] == int(np.percentile(lengths, 99, method="higher"))


def test_samples_over_the_recipe_context_are_dropped_as_too_long(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, planted_data: Planted) -> None:
    """data.max_tokens above the model's context: the recipe's limit decides."""
    from factory.recipes import load_recipe
    from factory.tasks.planted import _Gen, chat

    context = load_recipe("smollm2-135m-lora").architecture.max_context
    g = _Gen(7)
    long_row = g.row(chat(g.words(10), g.words(context + 50) + "."))
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(factory_home / "experiments"))
    (factory_home / "experiments").mkdir()
    (factory_home / "experiments" / "support.yaml").write_text(
        'name: support\ndata: {where: "tags[\'project\'] = \'support\'", max_tokens: 100000}\n'
        "recipe: smollm2-135m-lora\n")
    import pyarrow as pa

    table = planted_data.table()
    Lake().append("samples", pa.concat_tables([table, pa.Table.from_pylist(
        [long_row], schema=table.schema)]))
    assert _run().success
    drops = Lake().read("dataset_drops", row_filter="experiment = 'support'").to_pylist()
    mine = [d for d in drops if d["sample_id"] == long_row["sample_id"]]
    assert [d["reason"] for d in mine] == ["too_long"]
    assert mine[0]["detail"].endswith(f"> the {context}-token limit")
