"""Train/serve equivalence: the served adapter matches the trainer's log-probs; a checkpoint
with the wrong chat template is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.evals import EquivalenceError, check_equivalence
from factory.inference import InferenceServer
from factory.tasks import generate_conversations


def _canonical(conv: dict) -> dict:
    return {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                         for m in conv["messages"]], "tools": []}


def test_good_checkpoint_passes_wrong_template_fails(
        cpu_server: InferenceServer, adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    samples = [_canonical(c) for c in generate_conversations(2, seed=5)]
    client = cpu_server.client()
    client.load_adapter("ok", str(adapter_dirs["good"]))
    client.load_adapter("broken", str(adapter_dirs["wrong_template"]))
    try:
        good = check_equivalence(client, "ok", str(adapter_dirs["good"]), samples,
                                 base_model=str(tiny_model_dir))
        assert good.passed, good.problems
        assert good.num_tokens > 20 and good.max_abs_diff is not None
        assert good.max_abs_diff < 1e-3
        bad = check_equivalence(client, "broken", str(adapter_dirs["wrong_template"]), samples,
                                base_model=str(tiny_model_dir))
        assert not bad.passed
        assert "chat template or tokenizer mismatch" in bad.problems[0]
        with pytest.raises(EquivalenceError, match="train/serve mismatch"):
            bad.raise_if_failed()
    finally:
        client.unload_adapter("ok")
        client.unload_adapter("broken")
