"""This host's time constants (calibrated once per host, cached) and the pace correction."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from factory.planner import HARDWARE, host, make_plan
from factory.planner.host import HostKey, cache_path, host_constants, host_key, size_class
from factory.planner.pace import (
    MIN_STEPS,
    PaceWatch,
    corrected,
    observed_step_seconds,
    pace_line,
    record_run_pace,
)
from factory.planner.timing import MEASURED, step_seconds, time_constants
from factory.recipes import Architecture, Recipe, load_recipe
from tests.planner.conftest import experiment, profile

# A Llama of 0.6M parameters: a calibration of it runs in well under a second.
TINY = Architecture(family="llama", num_parameters=616_768, num_layers=2, hidden_size=64,
                    intermediate_size=176, num_heads=4, num_kv_heads=2, head_dim=16,
                    vocab_size=8192, max_context=2048, tie_word_embeddings=True,
                    linear_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"))
HOST_A = HostKey(cpu="Test CPU A", flags="avx2,fma", flags_sha="00000000", cores=2)
HOST_B = replace(HOST_A, flags="avx2,fma,avx512f,avx512_bf16,amx_bf16", flags_sha="11111111")


def tiny_recipe() -> Recipe:
    return replace(load_recipe("smollm2-135m-lora"), name="tiny-llama-lora", architecture=TINY)


@pytest.fixture(autouse=True)
def uncontended(monkeypatch: pytest.MonkeyPatch) -> None:
    """These calibrations run beside other tests: each counts as having had its cores unless a
    test says otherwise."""
    monkeypatch.setattr(host, "MIN_CPU_SHARE", 0.0)


def test_the_cache_is_written_once_per_host_key_and_reused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe, cpu = tiny_recipe(), HARDWARE["CPU"]
    first = host_constants(recipe, cpu, cache=tmp_path, key=HOST_A)
    assert first.fresh and first.cache == cache_path(tmp_path, HOST_A) and first.cache.exists()
    # The pause is announced, with where its result goes.
    said = capsys.readouterr().err
    assert "planner: timing Test CPU A" in said and str(first.cache) in said
    written = first.cache.read_bytes()
    stamp = first.cache.stat().st_mtime_ns
    again = host_constants(recipe, cpu, cache=tmp_path, key=HOST_A)
    assert not again.fresh and again.constants == first.constants
    assert capsys.readouterr().err == ""  # a cached plan says nothing
    assert first.cache.read_bytes() == written and first.cache.stat().st_mtime_ns == stamp
    # Another host calibrates again, into its own file; the first host's is left alone.
    other = host_constants(recipe, cpu, cache=tmp_path, key=HOST_B)
    assert other.fresh and other.cache is not None and other.cache != first.cache
    assert first.cache.read_bytes() == written
    assert HOST_B.label in other.constants.provenance
    # Another model size on the same host is another entry of the same file.
    bigger = replace(recipe, architecture=replace(TINY, num_layers=3, num_parameters=660_000))
    grown = host_constants(bigger, cpu, cache=tmp_path, key=HOST_A)
    assert grown.fresh and grown.cache == first.cache
    assert size_class(TINY) in first.cache.read_text()
    assert not host_constants(bigger, cpu, cache=tmp_path, key=HOST_A).fresh


def test_a_calibration_that_did_not_get_its_cores_serves_its_plan_uncached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured while something else held the cores (here: a CPU share no run reaches), the
    rates serve the plan that asked and are not cached: the next plan measures again."""
    monkeypatch.setattr(host, "MIN_CPU_SHARE", 2.0)
    first = host_constants(tiny_recipe(), HARDWARE["CPU"], cache=tmp_path, key=HOST_A)
    assert first.fresh and first.constants.calibrated and first.cache is not None
    assert not first.cache.exists()
    assert "< 2.0: another process held the cores, so it is not cached" \
        in first.constants.provenance
    assert host_constants(tiny_recipe(), HARDWARE["CPU"], cache=tmp_path, key=HOST_A).fresh
    monkeypatch.setattr(host, "MIN_CPU_SHARE", 0.0)
    assert host_constants(tiny_recipe(), HARDWARE["CPU"], cache=tmp_path, key=HOST_A).cache \
        .exists()  # type: ignore[union-attr]


def test_the_cache_folder_is_per_user_and_host_not_per_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FACTORY_TIME_MODEL")
    monkeypatch.delenv("FACTORY_TIME_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    assert host.time_model_cache() == tmp_path / "xdg" / "factory" / "time-model"
    monkeypatch.setenv("FACTORY_TIME_MODEL_CACHE", str(tmp_path / "mine"))
    assert host.time_model_cache() == tmp_path / "mine"
    monkeypatch.setenv("FACTORY_TIME_MODEL", "reference")
    assert host.time_model_cache() is None


@pytest.mark.parametrize("name", ["smollm2-135m-lora", "tiny-llama-lora"])
def test_calibrated_rates_are_this_hosts_and_the_rest_uncalibrated(tmp_path: Path,
                                                                   name: str) -> None:
    """The measured reference's fixed costs where the recipe has them, else the defaults'."""
    recipe = replace(tiny_recipe(), name=name)
    got = host_constants(recipe, HARDWARE["CPU"], cache=tmp_path, key=HOST_A).constants
    ref = time_constants(name, TINY, HARDWARE["CPU"])
    assert ref.measured == (name in {r for r, _ in MEASURED})
    assert ("as measured on dev-cpu" in got.provenance) == ref.measured
    assert got.calibrated and got.measured and got.source == "calibrated"
    assert all(getattr(got, r) > 0 for r in ("train_tflops", "attention_tflops", "forward_tflops",
                                             "prefill_tflops"))
    for fixed in ("train_fixed_s", "eval_fixed_s", "judge_s", "overlap_factor",
                  "shared_prefix_rate"):
        assert getattr(got, fixed) == getattr(ref, fixed), fixed
    # The reference's per-sample calls stood for attention this host prices at its own rate.
    assert got.shared_prefix_sample_s == 0.0
    # Decode scales with the prefill rate measured (both fp32 on one thread).
    assert got.decode_step_s / ref.decode_step_s == pytest.approx(
        ref.prefill_tflops / got.prefill_tflops)


def test_a_cpu_plan_names_its_constants_source(tmp_path: Path) -> None:
    recipe = replace(tiny_recipe(), name="smollm2-135m-lora")  # the measured pair's name
    plan = make_plan(experiment(), profile(), recipe=recipe, time_cache=tmp_path)
    model = plan.decisions["time_model"]
    assert (model.value, model.rule) == ("calibrated", "time.calibrated")
    key = host_key()
    assert model.reason.startswith(f"calibrated on this host ({key.label}) at 20")
    assert "by a model step in " in model.reason and "TFLOP/s" in model.reason
    assert cache_path(tmp_path, key).exists()
    # The step is the calibrated rate's: the same model, fed the cached constants.
    c = host_constants(recipe, HARDWARE["CPU"], cache=tmp_path).constants
    tokens = plan.estimates["tokens_per_step"]
    assert plan.estimates["step_seconds"] == pytest.approx(step_seconds(
        c, TINY, tokens_per_step=tokens, targets_per_step=plan.estimates["targets_per_step"],
        pairs=plan.estimates["attention_pairs"], recompute=plan["gradient_checkpointing"],
        num_devices=1,
        precision=plan["precision"]), rel=0.01)
    # Without a home the plan is the reference's, the same whatever machine renders it.
    reference = make_plan(experiment(), profile(), recipe=recipe).decisions["time_model"]
    assert (reference.value, reference.rule) == ("measured", "time.measured")
    assert reference.reason.startswith("smollm2-135m-lora on CPU: reference constants "
                                       "measured on dev-cpu")


def test_a_gpu_plan_is_not_calibrated_on_the_planning_host(tmp_path: Path) -> None:
    plan = make_plan(experiment(overrides={"gpu": "L4"}), profile(num_samples=100_000),
                     time_cache=tmp_path)
    assert plan["time_model"] == "defaults" and "L4" in plan.decisions["time_model"].reason
    assert not list(tmp_path.iterdir())


def test_a_broken_cache_says_how_to_fix_it(tmp_path: Path) -> None:
    path = cache_path(tmp_path, HOST_A)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="delete it and the next plan calibrates again"):
        host_constants(tiny_recipe(), HARDWARE["CPU"], cache=tmp_path, key=HOST_A)


def test_fp32_measured_rates_are_not_slowed_again() -> None:
    """A host without bf16 calibrates in fp32: an fp32 plan keeps its rate; the reference's
    bf16 rate is slowed for an fp32 plan."""
    ref = MEASURED[("smollm2-135m-lora", "CPU")]
    arch = load_recipe("smollm2-135m-lora").architecture

    def step(c: object, precision: str) -> float:
        return step_seconds(c, arch, tokens_per_step=1000,  # type: ignore[arg-type]
                            targets_per_step=100, pairs=40_000, recompute=False, num_devices=1,
                            precision=precision)

    fp32_host = replace(ref, calibrated=True, train_precision="fp32")
    assert step(fp32_host, "fp32") == step(fp32_host, "bf16-autocast")
    assert step(ref, "fp32") > step(ref, "bf16-autocast") * 1.8


def test_host_key_reads_this_cpu() -> None:
    key = host_key()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    assert key.cores == len(os.sched_getaffinity(0))
    for flag in ("avx512_bf16", "amx_bf16", "avx2"):
        assert (flag in key.flags.split(",")) == (flag in flags), flag
    assert key.slug == host_key().slug and key.slug != HOST_A.slug


def progress(step: int, t: float, **extra: float) -> dict[str, object]:
    return {"type": "progress", "step": step, "time": t, "loss": 1.0, **extra}


# A run whose first step took 9 s (kernel creation), then 2 s a step, with a 5 s held-out pass
# before the event of step 4.
EVENTS = [{"type": "started", "step": 0, "time": 100.0}, progress(1, 109.0),
          progress(2, 111.0), progress(3, 113.0), progress(4, 120.0, eval_loss=2.0),
          {"type": "progress", "step": 4, "time": 120.5, "eval_loss": 2.0},
          progress(5, 122.0), progress(6, 124.0)]


@pytest.mark.parametrize(("upto", "expected"), [
    (2, None),  # one step: no interval yet
    (3, (1, 2.0)),  # step 1 -> 2 (the load and first step before step 1 are left out)
    (5, (2, 2.0)),  # the interval ending at the held-out pass is left out
    (8, (4, 2.0)),
])
def test_observed_pace_leaves_out_the_first_step_and_held_out_passes(
        upto: int, expected: tuple[int, float] | None) -> None:
    assert observed_step_seconds(EVENTS[:upto]) == expected


def test_a_held_out_pass_that_reports_its_seconds_counts_its_step_without_them() -> None:
    # The trainer's events since eval_loss_s: step 4's interval is 7 s, 5 of them the pass.
    timed = [{**e, "eval_loss_s": 5.0} if e.get("eval_loss") and e["time"] == 120.0 else e
             for e in EVENTS if not (e.get("eval_loss") and e["time"] == 120.5)]
    assert observed_step_seconds(timed[:5]) == (3, 2.0)
    assert observed_step_seconds(timed) == (5, 2.0)
    # The same pass counted as a step would read 3.67 s for step 4's interval.
    untimed = [{**e, "eval_loss_s": 0.0} if "eval_loss" in e else e for e in timed]
    assert observed_step_seconds(untimed[:5]) == (3, 11.0 / 3)


def test_the_prediction_is_corrected_after_min_steps() -> None:
    estimates = {"step_seconds": 1.0, "steps": 100.0, "train_seconds": 116.0,
                 "evals_seconds": 30.0, "wall_seconds": 146.0}
    assert corrected(estimates, EVENTS[:5], evals_share_devices=True) is None  # 2 < MIN_STEPS
    pace = corrected(estimates, EVENTS, evals_share_devices=True)
    assert pace is not None and pace.steps >= MIN_STEPS
    assert pace.ratio == 2.0 and pace.train_s == 216.0
    assert pace.wall_s == 216.0 + 60.0  # evals on the same cores slow by the same ratio
    gpu = corrected(estimates, EVENTS, evals_share_devices=False)
    assert gpu is not None and gpu.wall_s == 216.0 + 30.0
    line = pace_line(pace)
    assert line.startswith("observed over 4 steps: 2 s a step (plan 1 s, x2.00): wall ~4.6 min "
                           "(plan 2.4 min)")



def _stored(events: list[dict[str, object]]) -> list[dict[str, object]]:
    """Events as ``training_events`` rows hold them (the trainer's JSON in ``payload``)."""
    return [{"type": e["type"], "step": e["step"], "payload": json.dumps(e)} for e in events]


def test_a_running_plan_says_its_pace_once_known_and_again_when_it_moves() -> None:
    estimates = {"step_seconds": 1.0, "steps": 100.0, "train_seconds": 116.0,
                 "evals_seconds": 30.0, "wall_seconds": 146.0}
    said: list[str] = []
    watch = PaceWatch(estimates=estimates, evals_share_devices=True, say=said.append)
    assert watch.update(_stored(EVENTS[:5])) is None and said == []  # too few steps yet
    pace = watch.update(_stored(EVENTS))
    assert pace is not None and pace.ratio == 2.0
    assert said == [f"training pace {pace_line(pace)}"]
    watch.update(_stored([*EVENTS, progress(7, 126.1)]))  # 2.02 s a step: not a move
    assert len(said) == 1
    slower = [*EVENTS, progress(7, 130.0), progress(8, 136.0)]  # 6 s steps: 3.33 s on average
    assert watch.update(_stored(slower)) is not None and len(said) == 2
    assert "x3.33" in said[1]
    md = watch.metadata(_stored(slower))
    assert md["predicted_train_s"] == 116.0 and md["predicted_step_s"] == 1.0
    assert md["measured_train_s"] == 36.0  # first event at 100 s, last at 136 s
    assert md["train_s_ratio"] == round(36.0 / 116.0, 3)
    assert md["pace"].startswith("observed over 6 steps: 3.33 s a step")


def _steady(steps: int, step_s: float) -> list[dict[str, object]]:
    """Trainer events of a run of ``steps`` steps of ``step_s`` seconds after a slow first."""
    return [{"type": "started", "step": 0, "time": 0.0}, progress(1, 10.0),
            *(progress(s, 10.0 + (s - 1) * step_s) for s in range(2, steps + 2))]


def test_finished_runs_correct_the_hosts_next_plans(tmp_path: Path) -> None:
    """Each run's pace against the calibrated rates is kept per host and size; the next plans'
    steps take the median of the newest ``PACE_RUNS``, and the plan says so."""
    recipe, cpu = tiny_recipe(), HARDWARE["CPU"]
    first = host_constants(recipe, cpu, cache=tmp_path, key=HOST_A)
    assert first.constants.step_factor == 1.0
    # Too short a run teaches nothing; another host's or size's cache is not touched.
    assert host.record_pace(tmp_path, recipe, "bf16-autocast", ratio=0.5,
                            steps=host.PACE_MIN_STEPS - 1, run_id="r0", key=HOST_A) is None
    assert host.record_pace(tmp_path, recipe, "bf16-autocast", ratio=0.5, steps=50,
                            run_id="r0", key=HOST_B) is None
    for i, ratio in enumerate([0.8, 0.9, 2.0]):
        assert host.record_pace(tmp_path, recipe, "bf16-autocast", ratio=ratio, steps=50,
                                run_id=f"r{i}", key=HOST_A) == first.cache
    got = host_constants(recipe, cpu, cache=tmp_path, key=HOST_A).constants
    assert got.step_factor == 0.9  # the median: one slow run does not move it far
    assert "x0.90: the median pace of this host's last 3 finished runs against these rates " \
           "(0.80, 0.90, 2.00)" in got.provenance
    assert step_seconds(got, TINY, tokens_per_step=1000, targets_per_step=100, pairs=10_000,
                        recompute=False, num_devices=1, precision="bf16-autocast") \
        == pytest.approx(0.9 * step_seconds(first.constants, TINY, tokens_per_step=1000,
                                            targets_per_step=100, pairs=10_000, recompute=False,
                                            num_devices=1, precision="bf16-autocast"))
    # The newest PACE_RUNS are kept; a run recorded again replaces its pace.
    for i in range(3, 3 + host.PACE_RUNS):
        host.record_pace(tmp_path, recipe, "bf16-autocast", ratio=1.0 + i / 100, steps=50,
                         run_id=f"r{i}", key=HOST_A)
    host.record_pace(tmp_path, recipe, "bf16-autocast", ratio=1.5, steps=50,
                     run_id=f"r{2 + host.PACE_RUNS}", key=HOST_A)
    kept = json.loads(first.cache.read_text())["paces"][f"{size_class(TINY)}|"
                                                        f"{got.train_precision}"]
    assert [p["run_id"] for p in kept] == [f"r{i}" for i in range(3, 3 + host.PACE_RUNS)]
    assert kept[-1]["ratio"] == 1.5
    # A new calibration (the cache's entry measured again) starts without the old paces.
    cached = json.loads(first.cache.read_text())
    for entry in cached["entries"].values():
        entry["measured_at"] = "2030-01-01T00:00:00+00:00"
    first.cache.write_text(json.dumps(cached))
    assert host_constants(recipe, cpu, cache=tmp_path, key=HOST_A).constants.step_factor == 1.0


def test_a_finished_runs_pace_is_kept_against_the_calibrated_rates(tmp_path: Path) -> None:
    """``record_run_pace`` divides out the factor the plan already used: a plan that predicted
    1.8 s a step with x0.9 and ran at 2.0 s a step was x1.0 of the calibrated rates' 2.0 s."""
    recipe = replace(tiny_recipe(), name="smollm2-135m-lora")
    made = make_plan(experiment(), profile(), recipe=recipe, time_cache=tmp_path)
    assert made.estimates["step_factor"] == 1.0
    plan = made.to_dict()
    plan["estimates"] = {**plan["estimates"], "step_seconds": 1.8, "step_factor": 0.9}
    line = record_run_pace(plan, _steady(30, 2.0), run_id="run-1", cache=tmp_path,
                           recipe=recipe)
    assert line is not None and "2 s a step over 30 steps, x1.00 of the calibrated" in line
    again = make_plan(experiment(), profile(), recipe=recipe, time_cache=tmp_path)
    assert again.estimates["step_factor"] == 1.0
    assert "the median pace of this host's last 1 finished run against these rates (1.00)" \
        in again.decisions["time_model"].reason
    record_run_pace(plan, _steady(30, 1.0), run_id="run-2", cache=tmp_path, recipe=recipe)
    faster = make_plan(experiment(), profile(), recipe=recipe, time_cache=tmp_path)
    assert faster.estimates["step_factor"] == 0.75  # median of 1.0 and 0.5
    assert faster.estimates["step_seconds"] == pytest.approx(
        0.75 * again.estimates["step_seconds"], rel=0.01)
    # A plan on the reference constants, too few steps, or another size (SmolLM2's own shape,
    # never calibrated here) keeps nothing.
    reference = {**plan, "values": {**plan["values"], "time_model": "measured"}}
    assert record_run_pace(reference, _steady(30, 2.0), run_id="run-3", cache=tmp_path,
                           recipe=recipe) is None
    assert record_run_pace(plan, _steady(5, 2.0), run_id="run-4", cache=tmp_path,
                           recipe=recipe) is None
    assert record_run_pace(plan, _steady(30, 2.0), run_id="run-5", cache=tmp_path) is None


def test_a_cache_that_cannot_be_written_leaves_the_run_standing(tmp_path: Path) -> None:
    recipe = replace(tiny_recipe(), name="smollm2-135m-lora")
    plan = make_plan(experiment(), profile(), recipe=recipe, time_cache=tmp_path).to_dict()
    cache_path(tmp_path, host_key()).write_text("{not json")
    line = record_run_pace(plan, _steady(30, 2.0), run_id="run-1", cache=tmp_path,
                           recipe=recipe)
    assert line is not None and line.startswith("this host's pace (x")
    assert "not kept" in line and "delete it" in line
