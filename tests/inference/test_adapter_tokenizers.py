"""Adapters whose tokenizer files are the same share one tokenizer object in the CPU engine (an
engine holds every deployed version of its base); an adapter with a tokenizer of its own (another
chat template) keeps it, and unloading one adapter leaves the others' tokenizer in place."""

from __future__ import annotations

from pathlib import Path

from factory.inference.engine import Engine
from tests.inference.conftest import make_adapter

MESSAGES = [{"role": "user", "content": "hi"}]


def test_adapters_with_the_same_tokenizer_files_share_one_tokenizer(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = Engine(tiny_model_dir, served_model_name="base")
    for name, seed in (("a", 1), ("b", 2)):
        engine.load_adapter(name, make_adapter(tiny_model_dir, tmp_path / name, seed=seed))
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    engine.load_adapter("c", make_adapter(tiny_model_dir, tmp_path / "c", seed=3, template=own))
    assert engine.tokenizer_for("a") is engine.tokenizer_for("b")
    assert engine.tokenizer_for("c") is not engine.tokenizer_for("a")
    assert engine.render("c", MESSAGES, add_generation_prompt=False) == "<<hi>>"
    rendered = engine.render("b", MESSAGES)
    engine.unload_adapter("a")
    assert engine.render("b", MESSAGES) == rendered
    assert engine.model_names() == ["base", "b", "c"]
