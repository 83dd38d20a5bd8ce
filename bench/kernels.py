"""Benchmark the Triton kernels against eager torch and torch.compile (GPU only).

Per op and per model-size shape: milliseconds of forward+backward and peak extra GPU memory for
our kernel, the eager torch reference (for LoRA: PEFT's unfused formula) and
``torch.compile`` of that reference, with ratios and the issue's goals:

- RMSNorm forward+backward at least 2x eager;
- fused LoRA linear at least 1.3x PEFT's unfused path;
- fused linear + cross-entropy at vocabulary 152k under a quarter of eager's peak memory.

Usage: ``python bench/kernels.py [--sizes 0.5b,8b] [--tokens 8192] [--json out.json]``.
Without a CUDA GPU it says so and exits 0; ``--smoke`` then runs a tiny correctness check of
every op through Triton's CPU interpreter instead (seconds, no timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's folder is first on sys.path and its name would shadow the
# ``kernels`` package: put the checkout root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

# name -> (hidden, intermediate, vocab, linear-attention value heads x head dim)
SIZES: dict[str, tuple[int, int, int, tuple[int, int]]] = {
    "0.5b": (896, 4864, 151936, (16, 64)),     # Qwen2.5-0.5B
    "1.5b": (1536, 8960, 151936, (16, 96)),    # Qwen2.5-1.5B
    "3b": (2048, 11008, 151936, (32, 64)),     # Qwen2.5-3B
    "8b": (4096, 12288, 151936, (32, 128)),    # Qwen3-8B
}
LORA_RANK = 16


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,1.5b,3b,8b",
                        help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (rows)")
    parser.add_argument("--ops", default="rms_norm,gated_rms_norm,lora_linear,cross_entropy")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true",
                        help="without a GPU: tiny interpreter correctness check of every op")
    args = parser.parse_args()
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}; choose from {', '.join(SIZES)}")
    if args.tokens < 1:
        parser.error("--tokens must be positive")
    return args


def _measure(step: Callable[[], None]) -> tuple[float, float]:
    """(median ms, peak extra MiB) of one forward+backward ``step``."""
    import torch
    from triton.testing import do_bench

    step()  # warm-up / compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = float(do_bench(step, warmup=10, rep=50, return_mode="median"))
    return ms, peak


def _cases(op: str, size: str, tokens: int):
    """(name -> fwd+bwd step) for our kernel, eager and (wrapped later) compiled reference."""
    import torch

    from factory.kernels import fused_linear_cross_entropy as fce
    from factory.kernels import gated_rms_norm as grn
    from factory.kernels import lora_linear as ll
    from factory.kernels import rms_norm as rn

    hidden, inter, vocab, (heads, head_dim) = SIZES[size]
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    if op == "rms_norm":
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(hidden, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn_like(x)

        def norm_step(fn):
            return lambda: fn(x, w).backward(g)

        return norm_step(rn.rms_norm), norm_step(rn.rms_norm_reference), rn.rms_norm_reference, \
            norm_step
    if op == "gated_rms_norm":
        x = torch.randn(tokens * heads, head_dim, device=dev, dtype=bf16, requires_grad=True)
        z = torch.randn_like(x, requires_grad=True)
        w = torch.randn(head_dim, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn_like(x)

        def gated_step(fn):
            return lambda: fn(x, z, w).backward(g)

        return (gated_step(grn.gated_rms_norm), gated_step(grn.gated_rms_norm_reference),
                grn.gated_rms_norm_reference, gated_step)
    if op == "lora_linear":
        # PEFT's default for a bf16 model: frozen bf16 base, float32 adapters.
        x = torch.randn(tokens, hidden, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(inter, hidden, device=dev, dtype=bf16) / hidden**0.5
        a = torch.randn(LORA_RANK, hidden, device=dev, requires_grad=True)
        b = torch.randn(inter, LORA_RANK, device=dev, requires_grad=True)
        g = torch.randn(tokens, inter, device=dev, dtype=bf16)

        def lora_step(fn):
            return lambda: fn(x, w, a, b, scale=2.0).backward(g)

        return (lora_step(ll.lora_linear), lora_step(ll.lora_linear_reference),
                ll.lora_linear_reference, lora_step)
    assert op == "cross_entropy"
    h = torch.randn(tokens, hidden, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(vocab, hidden, device=dev, dtype=bf16) / hidden**0.5  # frozen LM head
    t = torch.randint(0, vocab, (tokens,), device=dev)

    def ce_step(fn):
        return lambda: fn(h, w, t).backward()

    return (ce_step(fce.fused_linear_cross_entropy),
            ce_step(fce.fused_linear_cross_entropy_reference),
            fce.fused_linear_cross_entropy_reference, ce_step)


def run_gpu(args: argparse.Namespace) -> list[dict[str, object]]:
    import torch

    results: list[dict[str, object]] = []
    print(f"device: {torch.cuda.get_device_name()}, tokens per step {args.tokens}, bf16")
    header = (f"{'op':<15}{'size':<6}{'triton ms':>10}{'eager ms':>10}{'compile ms':>11}"
              f"{'x eager':>9}{'x compile':>10}{'triton MiB':>11}{'eager MiB':>10}"
              f"{'mem ratio':>10}")
    print(header)
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            ours, eager, ref, make = _cases(op, size, args.tokens)
            row: dict[str, object] = {"op": op, "size": size, "tokens": args.tokens}
            row["triton_ms"], row["triton_mib"] = _measure(ours)
            row["eager_ms"], row["eager_mib"] = _measure(eager)
            row["compile_ms"] = row["compile_mib"] = None
            if not args.no_compile:
                try:
                    row["compile_ms"], row["compile_mib"] = _measure(make(torch.compile(ref)))
                except Exception as exc:  # report, do not hide: the other columns still stand
                    row["compile_error"] = f"{type(exc).__name__}: {exc}"[:200]
            torch.cuda.empty_cache()
            x_eager = float(row["eager_ms"]) / float(row["triton_ms"])  # type: ignore[arg-type]
            x_comp = (float(row["compile_ms"]) / float(row["triton_ms"])  # type: ignore[arg-type]
                      if row["compile_ms"] is not None else float("nan"))
            mem = float(row["triton_mib"]) / max(float(row["eager_mib"]), 1e-9)  # type: ignore[arg-type]
            row.update(speedup_vs_eager=x_eager, speedup_vs_compile=x_comp, memory_ratio=mem)
            results.append(row)
            comp_ms = row["compile_ms"] if row["compile_ms"] is not None else float("nan")
            print(f"{op:<15}{size:<6}{row['triton_ms']:>10.3f}{row['eager_ms']:>10.3f}"
                  f"{comp_ms:>11.3f}{x_eager:>9.2f}{x_comp:>10.2f}{row['triton_mib']:>11.1f}"
                  f"{row['eager_mib']:>10.1f}{mem:>10.3f}")
            if "compile_error" in row:
                print(f"    torch.compile failed: {row['compile_error']}")
    _print_goals(results)
    return results


def _print_goals(results: list[dict[str, object]]) -> None:
    goals = {
        "rms_norm": ("speedup_vs_eager", 2.0, ">="),
        "lora_linear": ("speedup_vs_eager", 1.3, ">="),
        "cross_entropy": ("memory_ratio", 0.25, "<"),
    }
    print("\ngoals:")
    for row in results:
        goal = goals.get(str(row["op"]))
        if goal is None:
            continue
        key, target, cmp = goal
        value = float(row[key])  # type: ignore[arg-type]
        met = value >= target if cmp == ">=" else value < target
        print(f"  {row['op']:<15}{row['size']:<6}{key} {value:.3f} {cmp} {target}: "
              f"{'met' if met else 'MISSED'}")


def run_smoke() -> int:
    """Tiny shapes through the CPU interpreter: each op's output against its reference."""
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels (and so triton) are imported
    import torch

    from factory.kernels.fused_linear_cross_entropy import (
        fused_linear_cross_entropy,
        fused_linear_cross_entropy_reference,
    )
    from factory.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
    from factory.kernels.lora_linear import lora_linear, lora_linear_reference
    from factory.kernels.rms_norm import rms_norm, rms_norm_reference

    torch.manual_seed(0)
    x, z, w = torch.randn(5, 37), torch.randn(5, 37), torch.randn(37)
    wl, a, b = torch.randn(45, 37), torch.randn(3, 37), torch.randn(45, 3)
    wv, t = torch.randn(101, 37), torch.randint(0, 101, (5,))
    checks = {
        "rms_norm": (rms_norm(x, w, 1e-6, 1.0), rms_norm_reference(x, w, 1e-6, 1.0)),
        "gated_rms_norm": (gated_rms_norm(x, z, w), gated_rms_norm_reference(x, z, w)),
        "lora_linear": (lora_linear(x, wl, a, b, scale=2.0),
                        lora_linear_reference(x, wl, a, b, scale=2.0)),
        "cross_entropy": (fused_linear_cross_entropy(x, wv, t, chunk_size=2),
                          fused_linear_cross_entropy_reference(x, wv, t)),
    }
    worst = 0.0
    for name, (got, want) in checks.items():
        err = float((got - want).abs().max())
        worst = max(worst, err)
        print(f"smoke {name:<15} max |kernel - reference| = {err:.2e}")
    return 0 if worst < 1e-4 else 1


def main() -> int:
    args = _parse()
    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU on this machine (torch.cuda.is_available() is "
              "False), so kernel timings and GPU memory cannot be measured here; nothing was "
              "benchmarked.")
        if args.smoke:
            return run_smoke()
        print("Run it on a CUDA machine, or pass --smoke for an interpreter correctness check.")
        return 0
    results = run_gpu(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
