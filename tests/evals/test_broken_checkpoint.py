"""A checkpoint saved with the wrong chat template, materialized as ``checkpoint_evals`` through
Dagster: the blocking ``train_serve_equivalence`` check fails and says why, the step fails, an
asset downstream of ``checkpoint_evals`` in the same run is not materialized, and the
checkpoint's answers are never scored, so ``best_checkpoint`` in a later run cannot pick it.

The template is broken the way ``tests/inference/test_equivalence.py`` breaks it: the
checkpoint's tokenizer gets a different ``chat_template`` (role prefixes ``"user: "`` instead of
the trainer's ``"user\\n"``), so the server renders different tokens than the trainer trained on.

``best_checkpoint`` itself cannot share the run: it is partitioned per experiment, while
``checkpoint_evals`` is partitioned per checkpoint, and Dagster refuses to build one job over two
partitions definitions (``DagsterInvalidDefinitionError: Failed to resolve asset job``). The
downstream asset here is therefore a checkpoint-partitioned stand-in that depends on
``checkpoint_evals`` the way ``best_checkpoint`` does.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.lake import Lake
from tests.evals.conftest import canonical_rows, make_adapter, write_experiment
from tests.evals.test_assets import _resources

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

RUN = "support-run-1"
STEP = 10
NUM_EVAL = 2
# The wrong template of tests/inference/conftest.py::adapter_dirs.
WRONG_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + ': ' }}"
    "{{ m.content if m.content is string else m.content[0].text }}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant: ' }}{%- endif -%}")


def _break_chat_template(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    assert tok.chat_template != WRONG_TEMPLATE  # the trainer's template was installed
    tok.chat_template = WRONG_TEMPLATE
    tok.save_pretrained(str(checkpoint))


@pytest.mark.slow  # one inference-server boot: 12-16 s on a quiet machine
@pytest.mark.timeout(600)
def test_wrong_chat_template_fails_the_blocking_check_and_blocks_downstream(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    from factory.assets.evals import CHECKPOINTS, best_checkpoint, checkpoint_evals
    from factory.assets.rubric import rubric

    @dg.asset(partitions_def=CHECKPOINTS, deps=[checkpoint_evals], group_name="evals",
              kinds={"python"}, description="stand-in for best_checkpoint")
    def after_checkpoint_evals() -> None:
        pass

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n'
                     f"eval: {{rubric: auto, max_samples: {NUM_EVAL}}}\n")
    lake = Lake()
    lake.append("dataset_eval", canonical_rows(NUM_EVAL, seed=3))
    path = make_adapter(tiny_model_dir, tmp_path / f"step-{STEP:08d}", seed=1,
                        loss_history=[[s, 3.0 - 0.1 * s] for s in range(1, STEP + 1)])
    _break_chat_template(path)
    lake.append("checkpoints", [{
        "run_id": RUN, "experiment": "support", "step": STEP, "path": str(path),
        "manifest_sha256": "sha", "verified": True, "received_at": datetime.now(UTC),
        "event_id": "ev"}])

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["support"])
    instance.add_dynamic_partitions("checkpoints", [f"{RUN}:{STEP}"])
    resources = _resources()
    assert dg.materialize([rubric], instance=instance, partition_key="support",
                          resources=resources).success

    result = dg.materialize([checkpoint_evals, after_checkpoint_evals], instance=instance,
                            partition_key=f"{RUN}:{STEP}", resources=resources,
                            raise_on_error=False)

    [check] = [e.asset_check_evaluation_data for e in result.all_events
               if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert (check.asset_key, check.check_name) == (dg.AssetKey("checkpoint_evals"),
                                                   "train_serve_equivalence")
    assert check.passed is False
    meta: dict[str, Any] = {k: v.value for k, v in check.metadata.items()}
    problems = meta["problems"].splitlines()
    assert len(problems) == NUM_EVAL  # every compared sample, each with its reason
    for k, line in enumerate(problems):
        assert line.startswith(f"sample {k}: the server renders different tokens")
        assert line.endswith("chat template or tokenizer mismatch")
    # Tokens never matched, so no log-prob was compared.
    assert meta["num_tokens"] == 0 and meta["max_abs_diff"] is None

    # The failed blocking check fails the step and the run...
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "checkpoint_evals"
    error = failure.step_failure_data.error
    assert error is not None and error.cls_name == "DagsterAssetCheckFailedError"
    assert "checkpoint_evals: train_serve_equivalence" in error.message
    # ...and nothing downstream runs in it.
    assert result.asset_materializations_for_node("after_checkpoint_evals") == []
    assert not [e for e in result.all_events
                if e.step_key == "after_checkpoint_evals" and e.event_type_value in
                ("STEP_START", "STEP_SUCCESS", "ASSET_MATERIALIZATION")]

    # best_checkpoint runs in later runs, out of the check's reach: the broken checkpoint was
    # not scored (base and references were), so there is nothing for it to pick.
    kinds = {r["kind"] for r in lake.read("eval_scores", columns=["kind"]).to_pylist()}
    assert kinds == {"base", "reference"}
    later = dg.materialize([best_checkpoint], instance=instance, partition_key="support",
                           resources=resources, raise_on_error=False)
    assert not later.success
    [failure] = [e for e in later.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "has no evaluated checkpoints" in failure.step_failure_data.error.message
