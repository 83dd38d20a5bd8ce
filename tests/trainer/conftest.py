"""Tiny canonical datasets and job files for the trainer tests."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone"]
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}


def _text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def make_samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Reverse-the-words conversations of varied length; every third one calls a tool."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 12))]
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": _text("Reverse the words.")},
            {"role": "user", "content": _text(" ".join(words))},
            {"role": "assistant", "content": _text(" ".join(reversed(words)))}]
        tools: list[dict[str, Any]] = []
        if i % 3 == 0:
            city = rng.choice(["Paris", "Oslo", "Lima"])
            tools = [WEATHER_TOOL]
            msgs += [
                {"role": "user", "content": _text(f"Weather in {city}?")},
                {"role": "assistant", "content": [], "tool_calls": [
                    {"id": "call_0", "name": "get_weather",
                     "arguments": json.dumps({"city": city}, separators=(",", ":"))}]},
                {"role": "tool", "tool_call_id": "call_0",
                 "content": _text('{"sky":"sunny"}')},
                {"role": "assistant", "content": _text(f"Sunny in {city}.")}]
        out.append({"sample_id": f"s{seed}-{i:04d}", "messages": msgs, "tools": tools})
    return out


def write_parquet(path: Path, samples: list[dict[str, Any]]) -> Path:
    table = pa.table({
        "sample_id": [s["sample_id"] for s in samples],
        "messages": [json.dumps(s["messages"], separators=(",", ":")) for s in samples],
        "tools": [json.dumps(s["tools"], separators=(",", ":")) for s in samples]})
    pq.write_table(table, path)
    return path


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model runs fastest on one thread, and the cores are shared: no oversubscription.
    Subprocess trainers get OMP_NUM_THREADS=1 to match (bitwise comparisons need it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def make_job(tmp_path: Path, tiny_model_dir: Path, factory_home: Path) -> Callable[..., Path]:
    """Write a job file for the tiny model; keyword arguments override plan/job fields."""

    def make(name: str = "job", *, num_samples: int = 24, plan: dict[str, Any] | None = None,
             **job: Any) -> Path:
        data = tmp_path / f"{name}-data.parquet"
        if not data.exists():
            write_parquet(data, make_samples(num_samples))
        # 320: the longest sample (a tool call and its result) renders to 274 tokens, and a
        # plan drops, never cuts, what is longer.
        full_plan = {"base_model": str(tiny_model_dir), "max_seq_len": 320, "packing": True,
                     "micro_batch_size": 2, "grad_accum_steps": 2, "learning_rate": 3e-3,
                     "warmup_steps": 2, "num_steps": 8, "lora_rank": 4, "lora_alpha": 8,
                     "lora_dropout": 0.1, "checkpoint_every_steps": 2, "seed": 7,
                     "deterministic": True}
        full_plan.update(plan or {})
        body = {"run_id": name, "plan": full_plan, "data_files": [str(data)],
                "output_dir": str(tmp_path / name / "out"), "tracker": {"backend": "jsonl"}}
        body.update(job)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(body))
        return path

    return make
