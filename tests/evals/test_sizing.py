"""The eval serving size comes from the run's plan: ``checkpoint_evals`` sizes its inference server
(the exact ``vllm serve`` argv on a GPU, the generation batch on CPU) from the ``eval_serving``
the planner stored with the run in ``training_plans``; resource fields are explicit overrides.

vLLM cannot run here, so the vLLM path is followed to the process boundary: a stand-in ``vllm``
executable on ``PATH`` records the argv and environment it was started with, then exits.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.control.jobs import planned_run_id
from factory.evals.answers import build_rubric, items_from_samples
from factory.experiments import load_experiment
from factory.inference.sizing import serving_size_for
from factory.lake import Lake
from factory.planner.plan import Plan, make_plan
from factory.planner.service import plan_row
from tests.evals.conftest import canonical_rows, write_experiment
from tests.planner.conftest import profile

# An 8B model planned for L4 cards, the eval serving size on two of them (forced: the planner fits
# the 8B on one L4, and tensor parallelism is what the argv must carry).
EXPERIMENT = """name: support
data: {where: "true"}
recipe: llama-3.1-8b-lora
overrides: {gpu: L4, eval_devices: 2}
eval: {rubric: auto, max_samples: 5}
"""
FAKE_VLLM = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_VLLM_ARGV"
printf '%s' "$VLLM_ALLOW_RUNTIME_LORA_UPDATING" > "$FAKE_VLLM_ARGV.env"
echo "no GPU here" >&2
exit 3
"""


def _plan(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, str]:
    """The experiment planned for real, its training_plans row stored; the run id its
    trainer job gets."""
    write_experiment(factory_home, monkeypatch, EXPERIMENT)
    experiment = load_experiment("support")
    plan = make_plan(experiment, profile(num_eval_samples=40))
    row = plan_row(plan, experiment, "v1")
    Lake().append("training_plans", [row])
    return plan, planned_run_id(plan.run_key, row["created_at"])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture()
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``vllm`` on PATH that records its argv (in the returned file) and exits 3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(FAKE_VLLM)
    vllm.chmod(vllm.stat().st_mode | stat.S_IXUSR)
    argv_file = tmp_path / "argv.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_ARGV", str(argv_file))
    return argv_file


def _checkpoint(tmp_path: Path, run_id: str) -> Path:
    """A verified ``checkpoints`` row of ``run_id`` at step 2 (an adapter config is all the
    stand-in server gets to see)."""
    adapter = tmp_path / "step-00000002"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": "/models/llama-3.1-8b"}))
    Lake().append("checkpoints", [{"run_id": run_id, "experiment": "support", "step": 2,
                                   "path": str(adapter), "manifest_sha256": "x",
                                   "verified": True, "received_at": datetime.now(UTC),
                                   "event_id": "e2"}])
    return adapter


def test_checkpoint_evals_starts_vllm_sized_by_the_plan(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        fake_vllm: Path) -> None:
    from factory.assets.evals import checkpoint_evals
    from factory.resources.inference import VLLMInferenceResource
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    plan, run_id = _plan(factory_home, monkeypatch)
    box = plan.eval_serving()
    assert box["devices"] == 2 and box["gpu_memory_utilization"] == 0.85  # L4: 85%
    lake = Lake()
    rows = canonical_rows(5, seed=3)
    lake.append("dataset_eval", rows)
    rubric = build_rubric(items_from_samples(rows))
    lake.append("rubrics", [{"experiment": "support", "version": rubric.version,
                             "source": rubric.source, "num_examples": 5,
                             "rubric": rubric.to_json(), "created_at": datetime.now(UTC)}])
    adapter = _checkpoint(tmp_path, run_id)
    argv_file = fake_vllm

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("checkpoints", [f"{run_id}:2"])
    # max_tokens is set on the resource: an explicit override of the plan's max_new_tokens.
    inference = VLLMInferenceResource(max_tokens=16, startup_timeout_s=60)
    result = dg.materialize([checkpoint_evals], instance=instance, partition_key=f"{run_id}:2",
                            resources={"lake": LakeResource(), "judge": EmbeddedJudgeResource(),
                                       "inference": inference}, raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "exited with code 3" in str(failure.event_specific_data.error)
    assert "no GPU here" in str(failure.event_specific_data.error)  # the log tail is shown

    argv = argv_file.read_text().splitlines()
    assert argv[:2] == ["serve", "/models/llama-3.1-8b"]
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--gpu-memory-utilization") == "0.85"
    assert _flag(argv, "--max-num-seqs") == str(box["max_num_seqs"])
    assert int(_flag(argv, "--max-model-len")) == plan["max_seq_len"] + box["max_new_tokens"]
    assert _flag(argv, "--max-lora-rank") == "16"  # the plan's lora_rank 16
    assert _flag(argv, "--lora-modules") == f"{run_id}-step-2={adapter}"
    assert "--enable-lora" in argv
    assert Path(f"{argv_file}.env").read_text() == "True"  # runtime adapter loading on

    meta = failure.event_specific_data.user_failure_data.metadata
    size = meta["eval_serving"].value
    assert meta["serve_command"].value[1:] == argv
    assert size["tensor_parallel_size"]["source"] == "plan"
    assert size["tensor_parallel_size"]["value"] == 2
    assert size["batch_size"] == {"value": box["batch_size"], "source": "plan",
                                     "reason": size["batch_size"]["reason"]}
    assert size["batch_size"]["reason"].startswith("plan eval_batch_size: ")
    assert size["max_new_tokens"]["value"] == 16
    assert size["max_new_tokens"]["source"] == "override"
    assert "override" in size["max_new_tokens"]["reason"]


def test_cpu_server_batch_and_overrides(factory_home: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU server's batch and the client's concurrency are the plan's batch_size; a field
    set on the resource wins and says so; a run without a plan gets the defaults, saying why."""
    from factory.inference.sizing import plan_of_run
    from factory.resources.inference import CPUInferenceResource

    write_experiment(factory_home, monkeypatch,
                     'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n'
                     "eval: {max_samples: 3}\n")
    experiment = load_experiment("support")
    plan = make_plan(experiment, profile(num_eval_samples=40))
    row = plan_row(plan, experiment, "v1")
    lake = Lake()
    lake.append("training_plans", [row])
    session = lake.session(run_id="t", asset_key="checkpoint_evals")
    stored = plan_of_run(session, planned_run_id(plan.run_key, row["created_at"]), "support")
    assert stored is not None and session.lineage.reads["training_plans"]
    assert plan_of_run(session, "support-other-run", "support") is None

    box = CPUInferenceResource().serving_size(stored)
    assert box.batch_size == 3 == plan.eval_serving()["batch_size"]  # max_samples caps it
    assert box.max_new_tokens == plan.eval_serving()["max_new_tokens"]
    server = CPUInferenceResource().server("/m", {"a": "/a"}, size=box)
    server.port = 8123  # the argv as start() would run it, without starting it
    argv = server.command()
    assert argv[1:4] == ["-m", "factory.inference", "/m"]
    assert _flag(argv, "--max-num-seqs") == "3"
    assert _flag(argv, "--max-model-len") == str(plan["max_seq_len"]
                                                 + plan.eval_serving()["max_new_tokens"])

    forced = CPUInferenceResource(concurrency=2, max_model_len=1024).serving_size(stored)
    assert (forced.batch_size, forced.sizing.max_model_len) == (2, 1024)
    assert forced.decisions["batch_size"]["source"] == "override"
    assert forced.decisions["max_model_len"]["source"] == "override"
    assert forced.decisions["max_num_seqs"]["source"] == "plan"

    bare = CPUInferenceResource().serving_size(None, no_plan_reason="run r has no plan")
    assert {d["source"] for d in bare.decisions.values()} == {"default"}
    assert bare.decisions["batch_size"]["reason"] == "run r has no plan"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"batch_size": 0}, "batch_size"), ({"max_lora_rank": 12}, "max_lora_rank"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"gpus": 2}, "unknown")])
def test_bad_overrides_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serving_size_for(None, overrides)


def test_deployment_server_is_sized_by_the_plan_but_keeps_its_context(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        fake_vllm: Path) -> None:
    """``factory deploy`` / the deployment asset start vLLM through the same path, sized like
    the checkpoint's evals, except the eval set's max length (clients' prompts are longer)."""
    from factory.deploy import DeployConfig, Deployer, DeploymentError
    from factory.resources.deployer import VLLMDeployerResource

    plan, run_id = _plan(factory_home, monkeypatch)
    box = plan.eval_serving()
    adapter = _checkpoint(tmp_path, run_id)
    deployer = Deployer(config=DeployConfig(backend="vllm", startup_timeout_s=30))
    with pytest.raises(DeploymentError, match="exited before it was healthy"):
        deployer.deploy("support", f"{run_id}:2")
    argv = fake_vllm.read_text().splitlines()
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--gpu-memory-utilization") == "0.85"
    assert _flag(argv, "--max-num-seqs") == str(box["max_num_seqs"])
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--lora-modules") == f"support-v1={adapter}"
    assert deployer.serving_size is not None
    assert deployer.serving_size.decisions["max_model_len"]["source"] == "default"
    assert deployer.serving_size.decisions["tensor_parallel_size"]["source"] == "plan"
    [failed] = [d for d in Deployer().versions("support") if d.status == "failed"]
    assert failed.run_id == run_id and failed.step == 2

    forced = VLLMDeployerResource(tensor_parallel_size=4, max_model_len=8192)
    lake = Lake()
    sized = forced.deployer(lake.session(run_id="t", asset_key="deployment")).serving_size_of(
        "support", deployer.resolve("support", f"{run_id}:2"))
    assert (sized.sizing.tensor_parallel_size, sized.sizing.max_model_len) == (4, 8192)
    assert sized.decisions["tensor_parallel_size"]["source"] == "override"
    assert sized.decisions["max_num_seqs"]["source"] == "plan"
