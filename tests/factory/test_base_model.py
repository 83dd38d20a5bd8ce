"""The embedded base models are plain HF directories that load (SmolLM2 answers a chat message),
one ``base_model`` partition and row each; a recipe whose weights are not here fails in one line
before any compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.mark.slow
def test_smollm2_directory_loads_and_answers(smollm2_dir: Path) -> None:
    assert (smollm2_dir / "config.json").is_file()
    assert list(smollm2_dir.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_base_model_asset_records_row(factory_home: Path, smollm2_dir: Path) -> None:
    import dagster as dg

    from factory.assets.base_model import base_model
    from factory.lake import Lake
    from factory.resources.lake import LakeResource

    result = dg.materialize([base_model], resources={"lake": LakeResource()},
                            partition_key="smollm2-135m-instruct")
    assert result.success
    [row] = Lake().read("base_models").to_pylist()
    assert row["name"] == "smollm2-135m-instruct"
    assert row["num_parameters"] > 100_000_000
    assert len(row["sha256"]) == 64


@pytest.mark.heavy
def test_gemma3_directory_is_a_plain_gemma3_with_the_factorys_template(gemma3_dir: Path) -> None:
    import json

    from factory.trainer.chat import GEMMA, chat_format, chat_template

    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    assert len(tok) == 262144 and chat_format(tok) is GEMMA
    assert tok.chat_template == chat_template(GEMMA)
    end_of_turn = tok.convert_tokens_to_ids(GEMMA.turn_end)
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, end_of_turn]
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    # A base model: natural text is far more likely to it than the same words shuffled.
    def nll(text: str) -> float:
        ids = tok("<bos>" + text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    words = "The capital of France is Paris, and the capital of Italy is Rome."
    assert nll(words) < 0.6 * nll(" ".join(reversed(words.split())))


def test_recipes_know_where_their_base_model_is(factory_home: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from factory.app.cli import main
    from factory.base_model import MissingBaseModelError, require_base_model

    assert main(["base-model", "--list"]) == 0
    rows = {r["recipe"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["smollm2-135m-lora"]["available"] and rows["gemma3-270m-lora"]["available"]
    assert rows["gemma3-270m-lora"]["family"] == "gemma3"
    for name in ("qwen3-8b-lora", "llama-3.1-8b-lora", "qwen2.5-vl-7b-lora"):
        assert not rows[name]["available"]
        with pytest.raises(MissingBaseModelError) as err:
            require_base_model(name)
        assert str(err.value) == rows[name]["missing"]
        assert "is not on this machine" in str(err.value) and "\n" not in str(err.value)


def test_factory_run_of_a_recipe_without_weights_fails_before_compute(
        factory_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from factory.app.cli import main

    path = tmp_path / "qwen-orders.yaml"
    path.write_text("name: qwen-orders\ndata: {where: \"tags['project'] = 'x'\"}\n"
                    "recipe: qwen3-8b-lora\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "recipe qwen3-8b-lora: base model Qwen/Qwen3-8B" in err
    from factory.app.instance import instance

    assert not instance().get_runs()  # nothing was submitted


def test_builders_racing_on_one_folder_keep_the_first_finished_build(tmp_path: Path) -> None:
    """Two processes building the same model at once (two test workers, two nodes on a shared
    models folder): both succeed, the folder is the first finished build and is never replaced
    under a reader; ``force`` still replaces it."""
    import threading

    from factory.trainer.base_models import _atomic_save, is_built

    dest = tmp_path / "model"
    both_saved = threading.Barrier(2)
    first_done = threading.Event()
    results: dict[str, Path] = {}

    def build(name: str, wait_for_first: bool) -> None:
        def save(tmp: Path) -> dict[str, str]:
            (tmp / "weights").write_text(name)
            both_saved.wait(timeout=30)
            if wait_for_first:
                assert first_done.wait(timeout=30)
            return {"builder": name}

        results[name] = _atomic_save(dest, save)
        first_done.set()

    threads = [threading.Thread(target=build, args=("a", False)),
               threading.Thread(target=build, args=("b", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"a": dest, "b": dest}
    assert is_built(dest) and (dest / "weights").read_text() == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no builder's temp folder left

    def rebuild(tmp: Path) -> dict[str, str]:
        (tmp / "weights").write_text("c")
        return {"builder": "c"}

    _atomic_save(dest, rebuild, force=True)
    assert (dest / "weights").read_text() == "c"
