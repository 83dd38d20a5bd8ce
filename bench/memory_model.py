"""Check the planner's memory model against measured peak RSS of real CPU LoRA training steps.

Each configuration runs in a fresh subprocess: import torch/transformers/peft, read the baseline
RSS, load the model (fp32), wrap it with LoRA, run two AdamW steps of forward + backward on
random tokens, and report peak RSS (``VmHWM``) minus the baseline. The estimate comes from
``factory.planner.memory.estimate_memory`` with the model's real config.

    .venv/bin/python bench/memory_model.py            # all configurations, a table + JSON line
    .venv/bin/python bench/memory_model.py --quick    # the two smallest (for the slow test)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CONFIGS = [
    # (model, micro_batch, seq_len, gradient_checkpointing)
    ("tiny-llama", 4, 512, False),
    ("tiny-llama", 8, 1024, False),
    ("smollm2-135m-instruct", 1, 512, False),
    ("smollm2-135m-instruct", 2, 1024, False),
    ("smollm2-135m-instruct", 4, 1024, True),
]

CHILD = r"""
import json, sys
import torch, transformers, peft

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

path, batch, seq, gc, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", 16
targets = json.loads(sys.argv[5])
torch.manual_seed(0)
torch.set_num_threads(2)
base = rss("VmRSS:")
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
if gc:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05,
                      target_modules=targets, task_type="CAUSAL_LM")
model = peft.get_peft_model(model, cfg)
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
vocab = model.config.vocab_size
for _ in range(2):
    ids = torch.randint(0, vocab, (batch, seq))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(json.dumps({"peak": rss("VmHWM:") - base}))
"""


def models_dir() -> Path:
    return Path(os.environ.get("FACTORY_TEST_MODELS") or ROOT / ".cache" / "test-models")


def ensure_model(name: str) -> Path:
    from trainer.base_models import build_smollm2, build_tiny_llama

    dest = models_dir() / name
    return build_tiny_llama(dest) if name == "tiny-llama" else build_smollm2(dest)


def architecture_of(path: Path):  # noqa: ANN201 - returns factory.recipes.Architecture
    from factory.recipes import Architecture

    cfg = json.loads((path / "config.json").read_text())
    from safetensors import safe_open

    num = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                num += fh.get_slice(key).get_shape().numel() if hasattr(
                    fh.get_slice(key).get_shape(), "numel") else _prod(fh.get_slice(key)
                                                                        .get_shape())
    return Architecture(
        family=cfg["model_type"], num_parameters=num, num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"], max_context=cfg["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings")), linear_modules=tuple(TARGETS))


def _prod(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def measure(path: Path, batch: int, seq: int, gc: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(batch), str(seq),
                          "1" if gc else "0", json.dumps(TARGETS)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


def run(configs: list[tuple[str, int, int, bool]]) -> list[dict[str, object]]:
    from factory.planner.memory import GIB, estimate_memory

    rows = []
    for name, batch, seq, gc in configs:
        path = ensure_model(name)
        arch = architecture_of(path)
        est = estimate_memory(arch, micro_batch_size=batch, seq_len=seq, lora_rank=16,
                              target_modules=TARGETS, precision="fp32",
                              gradient_checkpointing=gc,
                              # CPU attention here is the math kernel (scores materialized),
                              # as the hardware table's CPU row says.
                              fused_attention=False).total
        peak = measure(path, batch, seq, gc)
        rows.append({"model": name, "micro_batch": batch, "seq_len": seq,
                     "gradient_checkpointing": gc, "measured_gib": round(peak / GIB, 3),
                     "estimated_gib": round(est / GIB, 3),
                     "error": round((est - peak) / peak, 3)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the two smallest configs")
    args = parser.parse_args()
    configs = CONFIGS[:1] + CONFIGS[2:3] if args.quick else CONFIGS
    rows = run(configs)
    for r in rows:
        print(f"{r['model']:<24} b={r['micro_batch']:<2} s={r['seq_len']:<5} "
              f"gc={str(r['gradient_checkpointing']):<5} measured={r['measured_gib']:.3f} GiB "
              f"estimated={r['estimated_gib']:.3f} GiB error={r['error']:+.1%}")
    print(json.dumps(rows))
    return 0 if all(abs(float(r["error"])) <= 0.25 for r in rows) else 1  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
