"""Whether this CPU computes bf16 natively, and the precision a CPU trainer really runs.

bf16 autocast on a CPU is fast only where the CPU has bf16 instructions: AVX512-BF16 or AMX on
x86, the BF16 extension on Arm. Elsewhere (an AVX2-only x86) oneDNN emulates bf16 and a training
step takes several times as long as in fp32 (``bench/cpu_precision.py``). The planner cannot
know the CPU a trainer lands on (a CPU plan is the same whatever machine renders it), so the
trainer resolves ``bf16-autocast`` on its own CPU and reports what it ran (``started``'s
``precision``).

``FACTORY_CPU_BF16=native`` or ``emulated`` overrides the reading of the CPU's flags.
"""

from __future__ import annotations

import os
import platform

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags in ``/proc/cpuinfo`` of a CPU with bf16 instructions."""


def _cpu_flags() -> set[str] | None:
    """The flags (x86) or features (Arm) of the first CPU in ``/proc/cpuinfo``; None where
    there is no such file."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        return None
    return set()


def cpu_bf16() -> tuple[bool, str]:
    """(whether bf16 is native on this CPU, what says so)."""
    forced = os.environ.get("FACTORY_CPU_BF16", "").strip().lower()
    if forced in ("native", "emulated"):
        return forced == "native", f"FACTORY_CPU_BF16={forced}"
    flags = _cpu_flags()
    if flags is None:  # not Linux: no flags to read; an Apple M2 and later has bf16
        return True, f"{platform.system()} {platform.machine()}: flags not read, bf16 assumed"
    if platform.machine() in ("aarch64", "arm64"):
        native = "bf16" in flags
        return native, "Arm BF16 extension" if native else "Arm without the BF16 extension"
    found = [f for f in NATIVE_FLAGS if f in flags]
    if found:
        return True, " and ".join(found)
    best = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no AVX")
    return False, f"{best} without avx512_bf16 or amx_bf16"


def effective_precision(precision: str, device_type: str) -> tuple[str, str | None]:
    """The precision a trainer on ``device_type`` runs for the plan's ``precision``, and why
    it differs (None when it does not): ``bf16-autocast`` on a CPU without bf16 runs fp32."""
    if device_type != "cpu" or precision != "bf16-autocast":
        return precision, None
    native, what = cpu_bf16()
    if native:
        return precision, None
    return "fp32", (f"bf16-autocast planned, fp32 run: this CPU ({what}) emulates bf16, "
                    "several times slower than fp32")
