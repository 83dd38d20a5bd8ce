"""The time model: predictions against measured runs, and the eval budget per hardware type."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from factory.planner import HARDWARE, DatasetProfile, PlanError, make_plan
from factory.planner.render import plan_table
from factory.planner.timing import (
    EVAL_SHARE,
    MEASURED,
    MIN_EVAL_SAMPLES,
    MIN_EVALS,
    EvalShape,
    default_constants,
    final_eval_seconds,
    time_constants,
)
from factory.recipes import list_recipe_names, load_recipe
from tests.planner.conftest import experiment, profile

# The dataset_profile rows of the two runs BENCHMARKS.md measures ("The demo", commit 8a135a8;
# "Agent task", commit 6154c22), read back from their factory homes.
DEMO_PROFILE = {
    "num_train": 162, "num_eval": 27, "prompt_tokens_p50": 143, "prompt_tokens_p95": 156,
    "prompt_tokens_p99": 161, "prompt_tokens_max": 165, "completion_tokens_p50": 33,
    "completion_tokens_p95": 37, "completion_tokens_p99": 39, "completion_tokens_max": 39,
    "total_tokens_p50": 177, "total_tokens_p99": 197, "total_tokens_max": 201,
    "num_train_tokens": 28372}
AGENT_PROFILE = {
    "num_train": 534, "num_eval": 54, "prompt_tokens_p50": 627, "prompt_tokens_p95": 748,
    "prompt_tokens_p99": 759, "prompt_tokens_max": 762, "completion_tokens_p50": 40,
    "completion_tokens_p95": 76, "completion_tokens_p99": 78, "completion_tokens_max": 80,
    "total_tokens_p50": 675, "total_tokens_p99": 800, "total_tokens_max": 805,
    "num_train_tokens": 366515, "share_with_tool_calls": 0.809}
# The triage task's (bench/loop.py, commit 48960a5): one ~55-token system prompt in every sample.
TRIAGE_PROFILE = {
    "num_train": 434, "num_eval": 55, "prompt_tokens_p50": 87, "prompt_tokens_p95": 108,
    "prompt_tokens_p99": 114, "prompt_tokens_max": 121, "completion_tokens_p50": 4,
    "completion_tokens_p95": 5, "completion_tokens_p99": 5, "completion_tokens_max": 5,
    "total_tokens_p50": 92, "total_tokens_p99": 118, "total_tokens_max": 126,
    "num_train_tokens": 40380, "shared_prefix_tokens": 54}
# Their experiment files' settings (experiments/demo-extract.yaml, agent-orders.yaml).
DEMO = dict(data={"max_tokens": 1024}, eval={"every_steps": 4, "max_samples": 12},
            overrides={"num_steps": 8, "learning_rate": 2e-3, "warmup_steps": 1})
AGENT = dict(data={"max_tokens": 1024}, eval={"every_steps": 16, "max_samples": 12},
             overrides={"num_steps": 16, "learning_rate": 2e-3, "warmup_steps": 1})


def _within(predicted: float, measured: float, tolerance: float) -> bool:
    return abs(predicted - measured) <= tolerance * measured


def test_predictions_match_the_measured_runs() -> None:
    """The figures in BENCHMARKS.md "Planner time model": a regression on the constants."""
    demo = make_plan(experiment(**DEMO), DatasetProfile.from_row(DEMO_PROFILE)).estimates
    assert _within(demo["step_seconds"], 4.72, 0.05)  # mean of the 6 steps without an eval
    assert _within(demo["eval_seconds"], 33.3, 0.05)  # the eval at step 8, after training
    # Training run creation to the last eval's end: the first eval ran beside the trainer.
    assert _within(demo["wall_seconds"], 173.7, 0.05)
    agent = make_plan(experiment(**AGENT), DatasetProfile.from_row(AGENT_PROFILE)).estimates
    assert _within(agent["step_seconds"], 21.44, 0.05)
    assert _within(agent["train_seconds"], 397.4, 0.05)
    # Its one eval, base answers included: the model decodes every batch to the 112-token
    # budget, the checkpoint stopped at 74, so the prediction is high by design.
    assert 112.2 <= agent["first_eval_seconds"] <= 112.2 * 1.10
    assert _within(agent["wall_seconds"], 512.5, 0.05)
    # The triage plan with share_prefix: bench/shared_prefix.py measured 1.539 s a step.
    triage = make_plan(experiment(), DatasetProfile.from_row(TRIAGE_PROFILE))
    assert triage["share_prefix"] is True
    assert _within(triage.estimates["step_seconds"], 1.539, 0.05)


# A run long enough that four evals fit 20% of it on each hardware type (short prompts on CPU).
CPU_RUN = profile(num_samples=8000, prompt_tokens_p50=120, prompt_tokens_p95=180,
                  prompt_tokens_p99=200, prompt_tokens_max=220, completion_tokens_p50=30,
                  completion_tokens_p95=40, completion_tokens_p99=40, completion_tokens_max=48)
GPU_RUN = profile(num_samples=100_000)
# SmolLM2 on an L4 trains 100k samples in ~10 min: a million, a step of 32 unpacked rows each.
SMALL_MODEL_GPU_RUN = profile(num_samples=1_000_000, prompt_tokens_p50=600, prompt_tokens_p95=800,
                              prompt_tokens_p99=900, completion_tokens_p50=200)


@pytest.mark.parametrize(("recipe", "gpu", "run", "source"), [
    ("smollm2-135m-lora", "CPU", CPU_RUN, "measured"),
    ("qwen3-8b-lora", "H100", GPU_RUN, "defaults"),
    # Nobody measured SmolLM2 on an L4: conservative defaults, said in the reason.
    ("smollm2-135m-lora", "L4", SMALL_MODEL_GPU_RUN, "defaults"),
])
def test_eval_budget_rule_per_hardware_type(recipe: str, gpu: str, run: DatasetProfile,
                                            source: str) -> None:
    p = make_plan(experiment(recipe, overrides={"gpu": gpu}), run)
    e = p.estimates
    model = p.decisions["time_model"]
    assert model.value == source and model.rule == f"time.{source}"
    if source == "defaults":
        assert "no measured time constants" in model.reason and gpu in model.reason
    # Four evals at least (the plateau stop needs them), within the budget, every one judged.
    assert e["num_evals"] >= MIN_EVALS
    assert p.decisions["eval_every_steps"].rule in ("eval.per_epoch", "eval.budget")
    assert e["num_evals"] == math.ceil(e["steps"] / p["checkpoint_every_steps"])
    assert e["eval_share"] <= EVAL_SHARE and e["eval_wall_share"] <= EVAL_SHARE
    if HARDWARE[gpu].evals_share_devices:
        # Evals share the cores: every second of theirs is a second of the wall.
        assert e["evals_seconds"] <= EVAL_SHARE * e["wall_seconds"]
        assert e["wall_seconds"] == pytest.approx(e["train_seconds"] + e["evals_seconds"],
                                                  abs=0.11)
    else:
        # Their own devices: the run waits only for the last eval.
        assert e["evals_seconds"] == e["eval_seconds"]
        eval_device_s = (e["first_eval_seconds"] + (e["num_evals"] - 1) * e["eval_seconds"]) \
            * p["eval_devices"]
        assert eval_device_s <= EVAL_SHARE * (eval_device_s
                                              + e["train_seconds"] * p["num_devices"]) * 1.001
    # The reasons name the numbers that decided.
    cadence = p.decisions["eval_every_steps"].reason
    assert "one eval ~" in cadence and "20% of the run's" in cadence
    assert f"every {p['eval_every_steps']} of ~{e['steps']:.0f} steps" in cadence
    samples = p.decisions["eval_num_samples"]
    assert f"{p['eval_num_samples']} of the " in samples.reason
    assert "95% interval reaches at most ±" in samples.reason


@pytest.mark.parametrize("num_samples", [1000, 2000, 4000, 8000, 40_000])
def test_evals_take_at_most_a_fifth_of_a_cpu_run(num_samples: int) -> None:
    p = make_plan(experiment(), replace(CPU_RUN, num_samples=num_samples))
    e = p.estimates
    assert e["evals_seconds"] <= EVAL_SHARE * e["wall_seconds"] * 1.001
    assert not any("budget 20%" in n for n in p.notes)


def test_a_short_cpu_run_gives_way_in_order_samples_then_evals() -> None:
    """Over budget: the sample count falls to what four evals afford, then the evals fall to
    one; the final checkpoint is always judged, and the note says the budget is exceeded."""
    # 3 passes, 63 steps, ~5 min (the planner's step floor would make it 8 passes)
    p = make_plan(experiment(overrides={"num_epochs": 3}), DatasetProfile.from_row(DEMO_PROFILE))
    samples, cadence = p.decisions["eval_num_samples"], p.decisions["eval_every_steps"]
    # 27 eval samples are fewer than the budget may cut to: all are kept.
    assert samples.value == 27 < MIN_EVAL_SAMPLES and samples.rule == "eval.budget"
    assert "4 evals of 27 would take ~6.0 min, over 20% of the run's wall (79 s" in samples.reason
    assert cadence.value == 63 and cadence.rule == "eval.final_only"
    assert "even that takes ~1.5 min" in cadence.reason
    assert p.estimates["num_evals"] == 1
    assert any("evals are predicted to take 22% of the run's wall" in n for n in p.notes)
    # Four evals' worth of training: samples are cut, the evals fall below four.
    longer = make_plan(experiment(), DatasetProfile.from_row(AGENT_PROFILE))
    samples, cadence = longer.decisions["eval_num_samples"], longer.decisions["eval_every_steps"]
    assert samples.rule == "eval.budget" and MIN_EVAL_SAMPLES <= samples.value < 54
    assert cadence.rule == "eval.budget_few" and "fewer than the 4" in cadence.reason
    assert longer.estimates["eval_share"] <= EVAL_SHARE


def test_experiment_file_values_win_and_the_note_says_what_they_cost() -> None:
    p = make_plan(experiment(**DEMO), DatasetProfile.from_row(DEMO_PROFILE))
    every, samples = p.decisions["eval_every_steps"], p.decisions["eval_num_samples"]
    assert (every.value, every.rule, every.overridden) == (4, "experiment.eval", True)
    assert "the planner would pick 8:" in every.reason
    assert (samples.value, samples.rule, samples.overridden) == (12, "experiment.eval", True)
    assert "the planner would pick 27:" in samples.reason
    assert any("65% of the run's wall (budget 20%): the experiment file sets "
               "eval.every_steps, eval.max_samples, num_steps" in n for n in p.notes)


def test_reasons_explain_epochs_and_checkpoints_with_times() -> None:
    p = make_plan(experiment(), CPU_RUN)
    epochs = p.decisions["num_epochs"].reason
    assert "a pass is ~" in epochs and "min on CPU" in epochs and "plateau stop ends" in epochs
    short = make_plan(experiment(), DatasetProfile.from_row(DEMO_PROFILE))
    assert "the plateau stop cannot act" in short.decisions["num_epochs"].reason


@pytest.mark.parametrize("recipe", list_recipe_names())
@pytest.mark.parametrize("gpu", sorted(HARDWARE))
def test_default_constants_never_fail(recipe: str, gpu: str) -> None:
    """Every recipe on every hardware type plans with some time constants; a plan refused for
    memory is refused for memory."""
    try:
        p = make_plan(experiment(recipe, overrides={"gpu": gpu}), profile())
    except PlanError as exc:
        assert "GiB" in str(exc) or "does not fit" in str(exc)
        return
    assert p["time_model"] in ("measured", "defaults")
    e = p.estimates
    assert all(math.isfinite(v) and v >= 0 for v in e.values())
    assert e["wall_seconds"] > e["train_seconds"] > 0 and e["num_evals"] >= 1


def test_an_unlisted_device_gets_defaults() -> None:
    arch = load_recipe("smollm2-135m-lora").architecture
    odd = replace(HARDWARE["L4"], name="X9", bf16_tflops=50.0, memory_bandwidth_gbs=100.0)
    c = time_constants("smollm2-135m-lora", arch, odd)
    assert not c.measured and "X9" in c.provenance
    assert c.train_tflops == pytest.approx(50.0 * 0.35 * 0.4)


def test_defaults_are_slower_than_what_was_measured() -> None:
    """The defaults are conservative: on the pair that was measured, each is slower."""
    recipe = load_recipe("smollm2-135m-lora")
    measured = MEASURED[(recipe.name, "CPU")]
    default = default_constants(recipe.architecture, HARDWARE["CPU"])
    for rate in ("train_tflops", "forward_tflops", "prefill_tflops", "shared_prefix_rate"):
        assert getattr(default, rate) < getattr(measured, rate), rate
    for cost in ("decode_step_s", "decode_seq_s", "train_fixed_s", "eval_fixed_s"):
        assert getattr(default, cost) >= getattr(measured, cost), cost


def test_the_equivalence_check_size_is_the_evals() -> None:
    from factory.evals.judging import NUM_EQUIVALENCE_SAMPLES
    from factory.planner.timing import EQUIVALENCE_SAMPLES

    assert EQUIVALENCE_SAMPLES == NUM_EQUIVALENCE_SAMPLES


def test_the_leaders_are_judged_on_the_whole_set_where_the_budget_affords_it() -> None:
    """24,000 samples on CPU: four evals of 385 are over budget, four of fewer plus the three
    leaders on the rest of the 385 fit: the plan says so and its prediction counts them, after
    the last eval, on the wall."""
    p = make_plan(experiment(), replace(CPU_RUN, num_samples=24_000))
    e, n, final = p.estimates, p["eval_num_samples"], p.decisions["eval_final_num_samples"]
    assert MIN_EVAL_SAMPLES <= n < 385 and (final.value, final.rule) == (385, "eval.final")
    assert e["num_evals"] >= MIN_EVALS
    assert f"the 3 leading of the {e['num_evals']:.0f} judged checkpoints" in final.reason
    assert f"on {n} samples" in final.reason and "judged on 385 of the" in final.reason
    assert "3 leading checkpoints are then judged on all 385" in \
        p.decisions["eval_num_samples"].reason
    # One boot, then three leaders each answering and judged on the 385 - n samples left.
    c = MEASURED[("smollm2-135m-lora", "CPU")]
    arch = load_recipe("smollm2-135m-lora").architecture
    rest = EvalShape(num_samples=385 - n, batch=p["eval_batch_size"],
                     prompt_tokens=CPU_RUN.prompt_tokens_p99, new_tokens=p["eval_max_new_tokens"],
                     sample_tokens=CPU_RUN.length_p99)
    assert e["final_evals_seconds"] == pytest.approx(
        final_eval_seconds(c, arch, rest, num_candidates=3), abs=0.1)
    assert e["final_evals_seconds"] > c.eval_fixed_s + 3 * (385 - n) * c.judge_s
    # On the wall after the last eval, at no overlap, within the budget with the other evals.
    during = (e["first_eval_seconds"] + (e["num_evals"] - 2) * e["eval_seconds"]) \
        * c.overlap_factor
    assert e["evals_seconds"] == pytest.approx(
        during + e["eval_seconds"] + e["final_evals_seconds"], abs=0.3)
    assert e["eval_share"] <= EVAL_SHARE
    # Without them the evals of every checkpoint would take the whole budget on fewer samples.
    assert "final evals" in p.decisions["eval_num_samples"].reason


@pytest.mark.parametrize(("num_samples", "why"), [
    # Four evals fit, the leaders on the rest of the 385 beside them do not.
    (8000, "the budget cannot also judge the 3 leading ones on all 385 samples"),
    # Two evals: judging both again costs what judging each on more samples does.
    (2000, "2 judged checkpoints, no more than the 3 leaders the final evals take"),
])
def test_no_final_evals_where_the_budget_or_the_eval_count_leaves_no_choice(
        num_samples: int, why: str) -> None:
    p = make_plan(experiment(), replace(CPU_RUN, num_samples=num_samples))
    final = p.decisions["eval_final_num_samples"]
    assert (final.value, final.rule) == (p["eval_num_samples"], "eval.final_none")
    assert final.reason.startswith(f"no final evals: {why}")
    assert p.estimates["final_evals_seconds"] == 0.0
    # The whole set for every checkpoint, or the experiment file's cap: nothing to add either.
    whole = make_plan(experiment(), DatasetProfile.from_row(DEMO_PROFILE))
    assert whole.decisions["eval_final_num_samples"].rule == "eval.final_whole"
    capped = make_plan(experiment(**DEMO), DatasetProfile.from_row(DEMO_PROFILE))
    assert capped["eval_final_num_samples"] == capped["eval_num_samples"] == 12


def test_plan_shows_the_predicted_wall_time(factory_home: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from factory.app.cli import main

    p = make_plan(experiment(**DEMO), DatasetProfile.from_row(DEMO_PROFILE))
    assert "Predicted wall time: **2.9 min**: training 62 s (~8 steps of ~4.75 s), evals " \
           "1.9 min (2 of ~34 s, the first ~51 s, on the training cores)" in plan_table(p)
    exp = tmp_path / "e.yaml"
    exp.write_text("recipe: smollm2-135m-lora\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(AGENT_PROFILE))
    assert main(["plan", str(exp), "--profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## e: predicted wall 1.5 h: training 73.3 min + evals 17.7 min")
    assert "Predicted wall time: **1.5 h**" in out


def test_attention_pairs_are_the_trainers_calls() -> None:
    """The pairs the planner prices are those the trainer's attention computes: an unpacked row
    all its pairs (one masked call), a packed row each sample's causal half, a shared-prefix row
    the prefix's causal half and its rests in one call where the trainer makes one."""
    from factory.planner.timing import REST_CALL_WORK, attention_pairs, causal_pairs
    from factory.trainer import model as trainer_model

    assert REST_CALL_WORK == trainer_model.REST_CALL_WORK
    assert attention_pairs(rows=8, row=200, packing=False, sample=150, samples_per_row=1) \
        == 8 * 200 * 200
    assert attention_pairs(rows=2, row=950, packing=True, sample=100, samples_per_row=9.5) \
        == 2 * 9.5 * causal_pairs(100)
    # (prefix, rest): CLINC150's plan, the agent task's, triage's, and long rests.
    for prefix, rest in ((686, 25), (593, 94), (54, 39), (60, 400)):
        lengths, firsts = (prefix, *[rest] * 8), (0, *[prefix] * 8)
        one_call = trainer_model._rests_in_one_call(lengths, firsts)
        assert one_call == ((prefix, rest) != (60, 400))
        got = attention_pairs(rows=1, row=0, packing=False, sample=prefix + rest,
                              samples_per_row=8, shared=prefix)
        rests = 8 * rest
        assert got == causal_pairs(prefix) + (rests * (prefix + rests) if one_call
                                              else rests * (prefix + rest))


def test_a_long_system_prompt_prices_its_attention_at_attentions_rate() -> None:
    """CLINC150 at 10 an intent (a 686-token system prompt, answers of ~5 tokens): where
    attention runs at an eighth of the linear layers' rate, as SDPA's CPU backward does on the
    bf16 host, its share of the step is priced at that rate; the reference (attention at the
    training rate) prices it at the training rate."""
    from factory.planner.timing import attention_flops, training_flops

    arch = load_recipe("smollm2-135m-lora").architecture
    ref = MEASURED[("smollm2-135m-lora", "CPU")]
    slow = replace(ref, attention_tflops=ref.train_tflops / 8)
    clinc = DatasetProfile.from_row({
        "num_train": 1349, "num_eval": 150, "prompt_tokens_p50": 701, "prompt_tokens_p95": 708,
        "prompt_tokens_p99": 715, "prompt_tokens_max": 729, "completion_tokens_p50": 5,
        "completion_tokens_p95": 9, "completion_tokens_p99": 11, "completion_tokens_max": 11,
        "total_tokens_p50": 706, "total_tokens_p99": 720, "total_tokens_max": 734,
        "num_train_tokens": 953380, "shared_prefix_tokens": 686})
    plans = {}
    for name, c in (("ref", ref), ("slow", slow)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(MEASURED, ("smollm2-135m-lora", "CPU"), c)
            plans[name] = make_plan(experiment(), clinc)
    est = plans["slow"].estimates
    assert plans["slow"]["share_prefix"] and est["attention_pairs"] > 300_000
    attention = attention_flops(arch, pairs=est["attention_pairs"], recompute=False)
    linear = training_flops(arch, tokens=est["tokens_per_step"],
                            targets=est["targets_per_step"], recompute=False)
    calls = 8 * ref.shared_prefix_sample_s
    assert est["step_seconds"] == pytest.approx(
        (linear + 8 * attention) / (ref.train_tflops * 1e12) + calls, rel=0.01)
    assert plans["ref"].estimates["step_seconds"] == pytest.approx(
        (linear + attention) / (ref.train_tflops * 1e12) + calls, rel=0.01)
    # A tenth of the FLOPs, nearly half the step's arithmetic seconds at an eighth of the rate.
    assert attention / (linear + attention) == pytest.approx(0.1, abs=0.02)
    assert 8 * attention / (linear + 8 * attention) > 0.4
