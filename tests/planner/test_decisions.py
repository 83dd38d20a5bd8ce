"""The decision tree: profiles that flip each decision, asserting value and rule/reason."""

from __future__ import annotations

import re

import pytest

from factory.planner import HARDWARE, PlanError, make_plan
from factory.recipes import list_recipe_names
from factory.trainer.config import TrainConfig
from tests.planner.conftest import experiment, profile


def test_short_uniform_lengths_no_packing_small_seq() -> None:
    p = make_plan(experiment(), profile(prompt_tokens_p50=60, prompt_tokens_p99=70,
                                        prompt_tokens_max=80, completion_tokens_p50=30,
                                        completion_tokens_p99=35, completion_tokens_max=40))
    assert p["max_seq_len"] == 128
    assert p.decisions["max_seq_len"].rule == "seq.cover_longest"
    assert "120 tokens" in p.decisions["max_seq_len"].reason
    assert p["packing"] is False
    assert p.decisions["packing"].rule == "packing.uniform_lengths"


def test_long_uniform_lengths() -> None:
    p = make_plan(experiment(data={"max_tokens": 4096}),
                  profile(prompt_tokens_p50=2500, prompt_tokens_p99=2900, prompt_tokens_max=3000,
                          completion_tokens_p50=400, completion_tokens_p99=500,
                          completion_tokens_max=600))
    assert p["max_seq_len"] == 3648  # 3600 rounded up to 64
    assert p.decisions["max_seq_len"].rule == "seq.cover_longest"
    assert "3600 tokens" in p.decisions["max_seq_len"].reason
    assert p["packing"] is False
    assert p.decisions["packing"].rule == "packing.uniform_lengths"
    assert "2900 tokens" in p.decisions["packing"].reason


def test_mixed_lengths_pack() -> None:
    p = make_plan(experiment(), profile())
    # p99 1200 -> 1216; covering the longest (1700 -> 1728) would cost over 1.25x that
    assert p["max_seq_len"] == 1216
    assert p.decisions["max_seq_len"].rule == "seq.cover_p99"
    assert "1200 tokens" in p.decisions["max_seq_len"].reason
    assert "too_long_for_plan" in p.decisions["max_seq_len"].reason
    assert p["packing"] is True
    assert p.decisions["packing"].rule == "packing.mixed_lengths"
    assert "180 tokens" in p.decisions["packing"].reason


def test_longest_beyond_max_tokens_is_capped() -> None:
    p = make_plan(experiment(data={"max_tokens": 1024}), profile())  # p99 1200
    assert p["max_seq_len"] == 1024
    assert p.decisions["max_seq_len"].rule == "seq.cap"


# Samples of uniform length (a median of 1,000 of ~1,100 tokens): rows are not packed, one each.
UNPACKED = dict(prompt_tokens_p50=900, prompt_tokens_p95=950, prompt_tokens_p99=980,
                prompt_tokens_max=1000, completion_tokens_p50=100, completion_tokens_p95=110,
                completion_tokens_p99=120, completion_tokens_max=120)


def test_tiny_dataset() -> None:
    p = make_plan(experiment(), profile(num_samples=60, **UNPACKED))
    assert p["packing"] is False
    assert p["effective_batch_size"] == 4
    assert p.decisions["effective_batch_size"].rule == "batch.tiny_dataset"
    assert "60 samples" in p.decisions["effective_batch_size"].reason
    # 3 passes of 15 steps would be 45 steps: the step floor makes them 11 (165 steps).
    assert p["num_epochs"] == 11.0
    assert p.decisions["num_epochs"].rule == "epochs.step_floor"
    assert "3 pass(es) would be ~45 steps, so 11 passes" in p.decisions["num_epochs"].reason
    # On a CPU no dropout (a third of a step); on a GPU, 0.1 against overfitting.
    assert p["lora_dropout"] == 0.0
    assert p.decisions["lora_dropout"].rule == "lora.no_dropout_cpu"
    assert p["lora_rank"] == 16
    gpu = make_plan(experiment(overrides={"gpu": "L4"}), profile(num_samples=200))
    assert gpu["lora_dropout"] == 0.1
    assert gpu.decisions["lora_dropout"].rule == "lora.dropout_small_dataset"


def test_step_floor_repeats_a_small_dataset_to_160_steps_at_most_20_times() -> None:
    few = make_plan(experiment(), profile(num_samples=20, **UNPACKED))  # 5 steps a pass
    assert few["num_epochs"] == 20.0 and few.decisions["num_epochs"].rule == "epochs.step_floor"
    # 500 samples: 3 passes of 63 steps of 8 pass the floor on their own.
    enough = make_plan(experiment(), profile(num_samples=500, **UNPACKED))
    assert enough["num_epochs"] == 3.0
    assert enough.decisions["num_epochs"].rule == "epochs.tiny_dataset"
    # The experiment's own epochs stand, the floor named as what the planner would pick.
    told = make_plan(experiment(overrides={"num_epochs": 2}), profile(num_samples=60, **UNPACKED))
    assert told["num_epochs"] == 2 and told.decisions["num_epochs"].overridden
    assert "would pick 11" in told.decisions["num_epochs"].reason


def test_few_samples_a_label_get_passes_until_each_label_is_seen_36_times() -> None:
    # CLINC150 at 10 an intent: 1,349 samples over 150 labels, ~9 a label; 2 passes by size
    # would show each label 18 times.
    labels = {f"intent_{i}": 9 for i in range(149)} | {"intent_149": 8}
    few = make_plan(experiment(), profile(num_samples=1_349, label_counts=labels, **UNPACKED))
    assert few["num_epochs"] == 4.0
    assert few.decisions["num_epochs"].rule == "epochs.label_exposures"
    assert "150 labels, ~9 samples each (median): 2 pass(es) show a label ~18 times" in \
        few.decisions["num_epochs"].reason
    # At 30 a label, 2 passes already show each one 60 times; without labels, size decides.
    many = make_plan(experiment(), profile(num_samples=4_500, label_counts={
        f"intent_{i}": 30 for i in range(150)}, **UNPACKED))
    assert many["num_epochs"] == 2.0 and many.decisions["num_epochs"].rule == "epochs.small_dataset"
    free = make_plan(experiment(), profile(num_samples=1_349, **UNPACKED))
    assert free["num_epochs"] == 2.0 and free.decisions["num_epochs"].rule == "epochs.small_dataset"
    # Labels on under half the samples (text replies beside tool calls) are no label set.
    calls = make_plan(experiment(), profile(num_samples=1_349, label_counts={
        f"reply_{i}": 2 for i in range(300)}, **UNPACKED))
    assert calls["num_epochs"] == 2.0
    # Most labels seen once (a long tail): the raise stops at 20 passes.
    tail = {f"rare_{i}": 1 for i in range(400)} | {f"common_{i}": 4 for i in range(200)}
    rare = make_plan(experiment(), profile(num_samples=1_200, label_counts=tail, **UNPACKED))
    assert rare["num_epochs"] == 20.0


def test_large_dataset() -> None:
    p = make_plan(experiment("qwen3-8b-lora"), profile(num_samples=2_000_000, **UNPACKED))
    assert p["effective_batch_size"] == 32
    assert p.decisions["effective_batch_size"].rule == "batch.large_dataset"
    assert p["num_epochs"] == 1.0
    assert p["lora_rank"] == 32 and p.decisions["lora_rank"].rule == "lora.rank_large_dataset"
    assert p["lora_alpha"] == 64.0
    assert p["lora_dropout"] == 0.05
    assert p["num_steps"] == 5000 and p.decisions["num_steps"].rule == "steps.cap"
    assert set(p["lora_target_modules"]) >= {"gate_proj", "down_proj"}
    assert p.decisions["lora_target_modules"].rule == "lora.mlp_large_dataset"


def _steps(p) -> int:  # noqa: ANN001
    steps = re.search(r"~(\d+) steps", p.decisions["num_steps"].reason)
    assert steps is not None
    return int(steps[1])


def test_packing_keeps_the_samples_per_step() -> None:
    # The triage loop's data: 439 samples of median 92 tokens. With the longest at 126 the rows
    # are 128 tokens, unpacked; at 140 they are 192 tokens, two samples a packed row. Either way
    # a step trains ~8 samples, so an epoch gets the same optimizer steps at the same rate.
    triage = dict(num_samples=439, prompt_tokens_p50=88, prompt_tokens_p95=100,
                  prompt_tokens_p99=110, completion_tokens_p50=4, completion_tokens_p95=6,
                  completion_tokens_p99=6, completion_tokens_max=6)
    unpacked = make_plan(experiment(), profile(prompt_tokens_max=120, **triage))
    packed = make_plan(experiment(), profile(prompt_tokens_max=134, **triage))
    assert (unpacked["max_seq_len"], unpacked["packing"]) == (128, False)
    assert (packed["max_seq_len"], packed["packing"]) == (192, True)
    assert unpacked["effective_batch_size"] == 8 and packed["effective_batch_size"] == 4
    assert "2.0 samples a row: 4 rows per step (~8 samples)" in \
        packed.decisions["effective_batch_size"].reason
    assert _steps(packed) == pytest.approx(_steps(unpacked), rel=0.1)
    assert packed["learning_rate"] == pytest.approx(unpacked["learning_rate"], rel=0.05)
    assert "samples in its packed rows" in packed.decisions["learning_rate"].reason
    # Short samples in long rows: a row holds many, and the batch never drops under one row.
    many = make_plan(experiment(), profile(num_samples=300))
    assert many["packing"] is True and many["effective_batch_size"] == 1


def test_learning_rate_scales_with_batch_and_rank() -> None:
    small = make_plan(experiment(), profile(num_samples=60, **UNPACKED))
    assert small["learning_rate"] == pytest.approx(1.4e-3 * (4 / 16) ** 0.5)
    ranked = make_plan(experiment(overrides={"lora_rank": 64}),
                       profile(num_samples=60, **UNPACKED))
    assert ranked["learning_rate"] == pytest.approx(1.4e-3 * (4 / 16) ** 0.5 * (16 / 64) ** 0.5)
    assert "sqrt(16/64)" in ranked.decisions["learning_rate"].reason


def test_tool_calls_add_mlp_targets() -> None:
    plain = make_plan(experiment("qwen3-8b-lora"), profile())
    assert plain["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    tools = make_plan(experiment("qwen3-8b-lora"), profile(share_with_tool_calls=0.4))
    assert tools["lora_target_modules"][-3:] == ["gate_proj", "up_proj", "down_proj"]
    assert tools.decisions["lora_target_modules"].rule == "lora.mlp_for_tool_calls"
    assert "40%" in tools.decisions["lora_target_modules"].reason


def test_images_freeze_vision_tower_and_text_models_refuse_images() -> None:
    text = make_plan(experiment("qwen2.5-vl-7b-lora"), profile())
    assert text["frozen_modules"] == ["model.visual"]
    assert text.decisions["frozen_modules"].rule == "frozen.vision_language_only"
    images = make_plan(experiment("qwen2.5-vl-7b-lora"), profile(share_with_images=0.3))
    assert images["frozen_modules"] == ["model.visual"]
    assert images.decisions["frozen_modules"].rule == "frozen.vision_encoder"
    assert make_plan(experiment(), profile())["frozen_modules"] == []
    with pytest.raises(PlanError, match="reads no images; use recipe qwen2.5-vl-7b-lora"):
        make_plan(experiment(), profile(share_with_images=0.1))


def _on(gpu: str, recipe: str = "llama-3.1-8b-lora", **kw: object):  # noqa: ANN202
    # Long (14k-token) samples, 50k of them: memory, not the batch size, limits the micro-batch.
    # Their median is 12,000 tokens: unpacked rows, 32 a step.
    return make_plan(experiment(recipe, overrides={"gpu": gpu}, data={"max_tokens": 16384}),
                     profile(num_samples=50_000, prompt_tokens_max=14000, prompt_tokens_p50=12000,
                             prompt_tokens_p95=13500, prompt_tokens_p99=14000, **kw))


@pytest.mark.parametrize(("gpu", "devices", "micro", "util"), [
    ("H200", 1, 4, 0.9), ("H100", 1, 2, 0.9), ("A100-80G", 1, 2, 0.9), ("L40S", 1, 1, 0.9),
    ("L4", 8, 1, 0.85),
])
def test_each_gpu_type(gpu: str, devices: int, micro: int, util: float) -> None:
    p = _on(gpu)
    assert p["gpu"] == gpu and p.decisions["gpu"].rule == "override"
    assert p["precision"] == "bf16" and p.decisions["precision"].rule == "precision.gpu_bf16"
    assert gpu in p.decisions["precision"].reason
    assert p["num_devices"] == devices and p["micro_batch_size"] == micro
    assert p.decisions["micro_batch_size"].rule == "memory.largest_micro_batch"
    assert f"fits {gpu} memory" in p.decisions["micro_batch_size"].reason
    # 16k tokens per row never fit without recomputation, on any of them.
    assert p["gradient_checkpointing"] is True
    assert p.decisions["gradient_checkpointing"].rule == "memory.checkpointing"
    assert f"with it {micro}" in p.decisions["gradient_checkpointing"].reason
    assert p["parallelism"] == ("single" if devices == 1 else "fsdp2")
    if devices > 1:
        assert p.decisions["num_devices"].rule == "devices.shard_to_fit"
        assert "FSDP2 over 8" in p.decisions["num_devices"].reason
        assert p.decisions["parallelism"].rule == "parallel.fsdp2"
    else:
        assert p.decisions["num_devices"].rule == "devices.fits_one"
        assert p.decisions["parallelism"].rule == "parallel.single"
    assert p["eval_gpu_memory_utilization"] == util
    assert p.decisions["eval_gpu_memory_utilization"].rule == "eval.memory_utilization"
    assert p.memory is not None and p.memory.total <= HARDWARE[gpu].memory_gib * 2**30 * 0.9
    assert p["micro_batch_size"] * p["num_devices"] * p["grad_accum_steps"] \
        == p["effective_batch_size"]


def test_cpu_plan_and_gradient_checkpointing_flip() -> None:
    # With LoRA dropout (an override on a CPU), whose masks are kept for the backward.
    p = make_plan(experiment(overrides={"lora_dropout": 0.1}),
                  profile(num_samples=60, prompt_tokens_p50=1000, prompt_tokens_p95=1100,
                          prompt_tokens_p99=1200, completion_tokens_p50=300,
                          completion_tokens_p99=500))
    assert p["gpu"] == "CPU" and p["precision"] == "bf16-autocast"
    assert p.decisions["precision"].rule == "precision.cpu_autocast"
    # 1728-token rows: recomputation doubles the micro-batch that fits in 16 GiB.
    assert p["gradient_checkpointing"] is True and p["micro_batch_size"] == 4
    assert p.decisions["gradient_checkpointing"].rule == "memory.checkpointing"
    assert "only micro-batch 2 fits; with it 4" in p.decisions["gradient_checkpointing"].reason
    short = make_plan(experiment(), profile(num_samples=200, prompt_tokens_max=100,
                                            prompt_tokens_p99=90, completion_tokens_max=50,
                                            completion_tokens_p99=40))
    assert short["gradient_checkpointing"] is False
    assert short.decisions["gradient_checkpointing"].rule == "memory.no_recompute"
    with pytest.raises(PlanError, match="does not fit.*lower data.max_tokens"):
        _on("CPU")


def test_checkpoint_cadence_follows_step_time() -> None:
    big = profile(num_samples=200_000)
    fast = make_plan(experiment("qwen3-1.7b-lora", overrides={"gpu": "H200"}), big)
    slow = make_plan(experiment("qwen3-1.7b-lora", overrides={"gpu": "L4"}), big)
    assert fast["checkpoint_every_steps"] > slow["checkpoint_every_steps"]
    # On the fast GPU the 15-minute rule would wait longer than the eval cadence.
    assert fast.decisions["checkpoint_every_steps"].rule == "ckpt.eval"
    # On the slow one it would checkpoint every ~45 steps, and the checkpoint sensor judges each:
    # ~22 evals do not fit the eval budget, so checkpoints come as often as it can judge them,
    # more often than the evals.
    ckpt = slow.decisions["checkpoint_every_steps"]
    rule = re.search(r"the 15-minute rule's (\d+) would take", ckpt.reason)
    assert ckpt.rule == "ckpt.eval_budget" and rule is not None
    assert int(rule[1]) > slow.estimates["num_evals"]
    assert ckpt.value < slow["eval_every_steps"]
    assert slow.estimates["num_evals"] == -(-slow.estimates["steps"] // ckpt.value)
    assert slow.estimates["eval_share"] <= 0.2


def test_overrides_win_and_are_marked() -> None:
    p = make_plan(experiment(overrides={"learning_rate": 5e-4, "packing": False}), profile())
    d = p.decisions["learning_rate"]
    assert p["learning_rate"] == 5e-4 and d.overridden and d.rule == "override"
    assert "the planner would pick" in d.reason
    assert p["packing"] is False and p.decisions["packing"].overridden
    assert not p.decisions["max_seq_len"].overridden


def test_sweep_point_wins() -> None:
    e = experiment(sweep={"lora_rank": [8, 32]})
    p = make_plan(e, profile(), point={"lora_rank": 32})
    assert p["lora_rank"] == 32 and p.decisions["lora_rank"].rule == "sweep point"
    assert p.run_key == "t/lora_rank=32"
    assert p["lora_alpha"] == 64.0  # follows the swept rank


def test_eval_serving() -> None:
    p = make_plan(experiment("qwen3-8b-lora", eval={"max_samples": 20}), profile())
    box = p.eval_serving()
    assert box["devices"] == 1 and box["batch_size"] == 20  # capped by eval.max_samples
    samples = p.decisions["eval_num_samples"]
    assert samples.value == 20 and samples.overridden and samples.rule == "experiment.eval"
    assert "the planner would pick 43" in samples.reason
    assert box["max_new_tokens"] == 384  # 1.25 x p99 completion (300) rounded to 16
    assert p.decisions["eval_max_num_seqs"].rule == "eval.kv_cache"


def test_validation_says_what_to_change() -> None:
    with pytest.raises(PlanError, match="set data.max_tokens to at most 8192"):
        make_plan(experiment(data={"max_tokens": 16384}), profile())
    with pytest.raises(PlanError, match="do not exist in .*choose from q_proj"):
        make_plan(experiment(overrides={"lora_target_modules": ["qkv"]}), profile())
    with pytest.raises(PlanError, match="set parallelism: fsdp2 or num_devices: 1"):
        make_plan(experiment(overrides={"parallelism": "single", "num_devices": 2}), profile())
    with pytest.raises(PlanError, match="needs .* GiB per device.*gradient_checkpointing: true"):
        make_plan(experiment(overrides={"micro_batch_size": 64, "gradient_checkpointing": False}),
                  profile())
    with pytest.raises(PlanError, match="no train samples; widen data.where"):
        make_plan(experiment(), profile(num_samples=0))


@pytest.mark.parametrize("recipe", list_recipe_names())
def test_every_recipe_plans_into_a_valid_trainer_config(recipe: str) -> None:
    p = make_plan(experiment(recipe), profile())
    TrainConfig(**p.train_config()).validate()
    assert set(p.to_dict()["reasons"]) == set(p.decisions)


def test_checkpoints_come_at_least_as_often_as_evals() -> None:
    # A short CPU run: the 15-minute rule would checkpoint once at the end, leaving the
    # checkpoint sensor nothing to judge mid-training.
    plan = make_plan(experiment(), profile(num_samples=200, prompt_tokens_max=100,
                                           prompt_tokens_p99=90, completion_tokens_max=50,
                                           completion_tokens_p99=40))
    assert plan["checkpoint_every_steps"] == plan["eval_every_steps"]
    assert plan.decisions["checkpoint_every_steps"].rule == "ckpt.eval"


def test_forced_micro_batch_recomputes_only_when_it_must() -> None:
    short = make_plan(experiment(overrides={"micro_batch_size": 1}), profile(num_samples=200))
    assert short["micro_batch_size"] == 1 and short.decisions["micro_batch_size"].overridden
    assert short["gradient_checkpointing"] is False
    assert short.decisions["gradient_checkpointing"].rule == "memory.no_recompute"
    long = profile(num_samples=5000, prompt_tokens_max=7000, prompt_tokens_p99=5000)
    fits = make_plan(experiment(data={"max_tokens": 8192}, overrides={"micro_batch_size": 2}),
                     long)
    assert fits["gradient_checkpointing"] is True
    assert fits.decisions["gradient_checkpointing"].rule == "memory.checkpointing"
    with pytest.raises(PlanError, match="needs .* GiB per device.*micro_batch_size: 4") as err:
        make_plan(experiment(data={"max_tokens": 8192}, overrides={"micro_batch_size": 8}), long)
    assert "gradient_checkpointing: true" not in str(err.value)  # it is already on


def test_a_shared_system_prompt_is_computed_once_per_micro_batch() -> None:
    # The triage shape: ~90-token samples, ~60 of them one system prompt, label answers.
    triage = dict(num_samples=434, prompt_tokens_p50=87, prompt_tokens_p95=108,
                  prompt_tokens_p99=114, prompt_tokens_max=121, completion_tokens_p50=4,
                  completion_tokens_p95=5, completion_tokens_p99=5, completion_tokens_max=5,
                  total_tokens_p50=92, total_tokens_p99=118, total_tokens_max=126,
                  num_train_tokens=40380)
    shared = make_plan(experiment(), profile(**triage, shared_prefix_tokens=60))
    alone = make_plan(experiment(), profile(**triage, shared_prefix_tokens=3))
    assert shared["share_prefix"] is True and shared.decisions["share_prefix"].rule == "prefix.shared"
    assert "~60 shared tokens" in shared.decisions["share_prefix"].reason
    assert alone["share_prefix"] is False and alone.decisions["share_prefix"].rule == "prefix.none"
    assert TrainConfig(**shared.train_config()).share_prefix is True
    # The step the time model predicts is the rows' tokens: 8 x 118 padded against
    # 60 + 8 x (93 - 60), so well under half.
    assert shared.estimates["tokens_per_step"] < 0.45 * alone.estimates["tokens_per_step"]
    assert shared.estimates["step_seconds"] < 0.7 * alone.estimates["step_seconds"]
    # The agent shape: ~670-token samples, 596 of them the system prompt and tools block. The
    # prefix computed once holds its activations once, so a micro-batch of 8 fits the CPU's
    # memory where 8 whole rows do not (measured: 4 rows with the prefix shared peaked at
    # 5.4 GiB RSS in the agent task's trainer; the model says 4.6).
    agent = dict(num_samples=534, prompt_tokens_p50=627, prompt_tokens_p95=700,
                 prompt_tokens_p99=740, prompt_tokens_max=760, completion_tokens_p50=46,
                 completion_tokens_p95=80, completion_tokens_p99=80, completion_tokens_max=85,
                 total_tokens_p50=673, total_tokens_p99=800, total_tokens_max=805,
                 num_train_tokens=366_515)
    # With LoRA dropout as that run had it (its masks are kept for the backward).
    whole = make_plan(experiment(overrides={"share_prefix": False, "lora_dropout": 0.1}),
                      profile(**agent, shared_prefix_tokens=596))
    once = make_plan(experiment(overrides={"lora_dropout": 0.1}),
                     profile(**agent, shared_prefix_tokens=596))
    assert once["share_prefix"] is True and once["max_seq_len"] == whole["max_seq_len"]
    assert once["micro_batch_size"] > whole["micro_batch_size"]
    assert once.memory.total < whole.memory.total
    # An override turns it off, marked as such.
    off = make_plan(experiment(overrides={"share_prefix": False}),
                    profile(**triage, shared_prefix_tokens=60))
    assert off["share_prefix"] is False and off.decisions["share_prefix"].rule == "override"
    # Attention that is not plain causal attention cannot share a prefix exactly.
    vl = make_plan(experiment("qwen2.5-vl-7b-lora"), profile(shared_prefix_tokens=60))
    assert vl["share_prefix"] is False and vl.decisions["share_prefix"].rule == "prefix.attention"


def test_a_recall_only_eval_split_is_named_at_plan_time_with_its_numbers() -> None:
    reason = ("recall only: 3 phrasing clusters of 40 samples, fewer than the 20 an eval set "
              "of 10% needs; the eval set is held out by trace, first user turn and "
              "near-duplicate group (4 samples), so its scores measure recall of the "
              "traffic's own phrasings, not new ones")
    p = make_plan(experiment(), profile(eval_split="recall only", eval_split_reason=reason))
    assert any(n.startswith("eval scores measure recall only: " + reason) for n in p.notes)
    held = make_plan(experiment(), profile(eval_split="phrasing",
                                           eval_split_reason="held out by phrasing: ..."))
    assert not any("recall only" in n for n in held.notes)


def test_a_base_model_s_untrained_turn_tokens_train_their_rows() -> None:
    """Gemma 3 270M was never instruction-tuned: its recipe names the turn tokens pretraining
    never trained, and the plan trains their rows (the trainer gets their ids); an
    instruction-tuned base keeps its embedding frozen; an experiment may turn it off."""
    gemma = make_plan(experiment("gemma3-270m-lora"), profile(num_samples=400))
    assert gemma["trainable_token_ids"] == [105, 106]
    assert gemma.decisions["trainable_token_ids"].rule == "tokens.untrained_turn_tokens"
    assert "<end_of_turn> (106)" in gemma.decisions["trainable_token_ids"].reason
    assert TrainConfig(**gemma.train_config()).trainable_token_ids == [105, 106]
    smol = make_plan(experiment(), profile(num_samples=400))
    assert smol["trainable_token_ids"] == []
    assert smol.decisions["trainable_token_ids"].rule == "tokens.none"
    off = make_plan(experiment("gemma3-270m-lora", overrides={"trainable_token_ids": []}),
                    profile(num_samples=400))
    assert off.train_config()["trainable_token_ids"] == []
