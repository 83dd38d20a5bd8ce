"""Every recipe family's architecture runs: a tiny random-init llama, qwen3, gemma3 and qwen2_5_vl
(a one-block vision tower; text-only data here, images in tests/factory/test_vision.py), each with a real tokenizer of its chat format,
through curation's token counts, the planner (its family's recipe on the model's own
architecture), training, the train/serve equivalence gate and serving; a wrong template or
tokenizer fails the gate with a reason per sample."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from factory.curation.tokens import RenderCounter
from factory.evals import check_equivalence
from factory.inference import InferenceServer
from factory.trainer.chat import CHATML, FORMATS, GEMMA, chat_format, chat_template, encode
from factory.trainer.checkpoint import latest_checkpoint
from factory.trainer.config import TrainerJob
from factory.trainer.data import plan_tokenizer
from factory.trainer.train import ExitCode, run_job
from tests.trainer.conftest import make_samples, write_parquet

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _family(model_dir: Path) -> str:
    return str(json.loads((model_dir / "factory-model.json").read_text())["name"])[5:]


RECIPES = {"llama": "smollm2-135m-lora", "qwen3": "qwen3-0.6b-lora", "gemma3": "gemma3-270m-lora",
           "qwen2_5_vl": "qwen2.5-vl-7b-lora"}
"""A shipped recipe of each family, whose choices the planner starts from."""


def _plan(base: Path, family: str, samples: list[dict[str, Any]], tok: Any, *,
          num_steps: int) -> dict[str, Any]:
    """The planner's trainer config for these samples on ``base``: the family's recipe with the
    architecture read from the folder; the overrides size a short CPU run."""
    from dataclasses import replace

    import yaml

    from factory.experiments import parse_experiment
    from factory.planner.calibration import architecture_from_dir, profile_of
    from factory.planner.plan import make_plan
    from factory.recipes import load_recipe

    recipe = load_recipe(RECIPES[family])
    arch = replace(architecture_from_dir(base), family=recipe.architecture.family)
    recipe = replace(recipe, base_model_id=str(base), local_dir=None, builder=None,
                     architecture=arch, gpu="CPU")
    raw = {"name": "family-check", "recipe": recipe.name,
           "data": {"where": "true", "max_tokens": 512},
           "overrides": {"micro_batch_size": 2, "grad_accum_steps": 1, "num_steps": num_steps,
                         "learning_rate": 2e-2, "warmup_steps": 1, "lora_rank": 4,
                         "lora_alpha": 8, "lora_dropout": 0.0,
                         "checkpoint_every_steps": num_steps, "seed": 7}}
    experiment = parse_experiment(yaml.safe_dump(raw), Path("family-check.yaml"))
    plan = make_plan(experiment, profile_of(samples, tok), recipe=recipe)
    assert plan.memory is not None and plan.memory.total > 0
    cfg = plan.train_config()
    assert cfg["base_model"] == str(base) and cfg["num_steps"] == num_steps
    cfg["eval_every_steps"] = None  # no held-out rows here
    return cfg


def _train(base: Path, tmp_path: Path, samples: list[dict[str, Any]],
           plan: dict[str, Any]) -> Path:
    data = write_parquet(tmp_path / "data.parquet", samples)
    body = {"run_id": "family", "data_files": [str(data)], "plan": plan,
            "output_dir": str(tmp_path / "out"), "tracker": {"backend": "jsonl"}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body))
    assert run_job(TrainerJob.from_json(path)) == ExitCode.FINISHED
    info = latest_checkpoint(str(tmp_path / "out"))
    assert info is not None and info.step == plan["num_steps"]
    return Path(info.path)


def _copy_adapter(src: Path, dest: Path, *, template: str | None = None,
                  split_special_tokens: bool = False) -> Path:
    shutil.copytree(src, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if split_special_tokens:
        # The same vocabulary, but the turn tokens in text are split into ordinary pieces.
        config["split_special_tokens"] = True
    config_path.write_text(json.dumps(config))
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    return dest


def test_family_curates_trains_passes_the_gate_and_serves(tiny_family_dir: Path,
                                                          tmp_path: Path,
                                                          factory_home: Path) -> None:
    import torch

    torch.set_num_threads(1)  # the tiny models run fastest on one thread; the cores are shared
    family = _family(tiny_family_dir)
    _through_the_gate(tiny_family_dir, family, tmp_path, num_samples=12, num_steps=3)


@pytest.mark.heavy
def test_gemma3_270m_checkpoint_passes_the_gate(gemma3_dir: Path, tmp_path: Path,
                                                factory_home: Path) -> None:
    """The real base: a checkpoint trained on Gemma 3 270M gives, in plain transformers + PEFT
    (the gate's trainer view), the server's log-probs; a wrong template or tokenizer fails."""
    _through_the_gate(gemma3_dir, "gemma3", tmp_path, num_samples=4, num_steps=1)


def _through_the_gate(base: Path, family: str, tmp_path: Path, *, num_samples: int,
                      num_steps: int) -> None:
    fmt = GEMMA if family == "gemma3" else CHATML
    samples = make_samples(num_samples, seed=3)

    # Curation counts exactly the trainer's tokens, in the family's format.
    tok = plan_tokenizer(str(base))
    assert chat_format(tok) is fmt
    counts = RenderCounter(base).count([s["messages"] for s in samples],
                                       [s["tools"] for s in samples])
    assert [c[0] if c else None for c in counts] == [
        len(encode(s["messages"], s["tools"], tok)[0]) for s in samples]
    ids, _ = encode(samples[0]["messages"], samples[0]["tools"], tok)
    if fmt.begin:
        assert ids[0] == tok.bos_token_id

    plan = _plan(base, family, samples, tok, num_steps=num_steps)
    ckpt = _train(base, tmp_path, samples, plan)
    if family == "qwen2_5_vl":
        # Text-only data: the planner freezes the vision tower, and no adapter reaches it.
        from safetensors import safe_open

        assert plan["frozen_modules"] == ["model.visual"]
        with safe_open(str(ckpt / "adapter_model.safetensors"), "pt") as fh:
            keys = list(fh.keys())  # noqa: SIM118 - safe_open has no __iter__
        assert keys and not [k for k in keys if ".visual." in k]
    saved = (ckpt / "chat_template.jinja").read_text()
    assert saved == chat_template(fmt, vision=family == "qwen2_5_vl")

    other = next(f for f in FORMATS if f is not fmt)
    wrong_template = _copy_adapter(ckpt, tmp_path / "wrong-template",
                                   template=chat_template(other))
    wrong_tokenizer = _copy_adapter(ckpt, tmp_path / "wrong-tokenizer",
                                    split_special_tokens=True)
    gate = samples[:2]
    with InferenceServer(base, served_model_name="base", threads=1, startup_timeout_s=240,
                         log_path=tmp_path / "server.log") as server:
        client = server.client()
        client.load_adapter("ckpt", str(ckpt))
        client.load_adapter("wrong-template", str(wrong_template))
        client.load_adapter("wrong-tokenizer", str(wrong_tokenizer))
        good = check_equivalence(client, "ckpt", str(ckpt), gate, base_model=str(base))
        assert good.passed, good.problems
        assert good.num_tokens > 10 and good.max_abs_diff is not None
        for name in ("wrong-template", "wrong-tokenizer"):
            bad = check_equivalence(client, name, str(ckpt), gate, base_model=str(base))
            assert not bad.passed
            assert len(bad.problems) == len(gate), bad.problems
            assert all("chat template or tokenizer mismatch" in p for p in bad.problems)

        # Serving: the family's template and stop token; the answer never carries a turn token.
        answer = client.chat("ckpt", [{"role": "user", "content": "red cat"}], max_tokens=8)
        text = answer["choices"][0]["message"]["content"] or ""
        assert fmt.turn_end not in text and fmt.turn_start not in text
        ids = client.rendered_ids("ckpt", [{"role": "user", "content": "red cat"}])
        assert ids == tok(fmt.begin + f"{fmt.turn_start}user\nred cat{fmt.turn_end}\n",
                          add_special_tokens=False)["input_ids"]
