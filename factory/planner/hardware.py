"""The hardware table: accelerator types the planner targets, with memory, bf16 throughput and
memory bandwidth.

Throughput is the dense bf16 peak of the datasheet (no sparsity) and bandwidth the datasheet's
(SXM for H200, H100, A100); with the ``mfu`` column they give the time model's defaults for recipes nobody has
measured on that type (``factory.planner.timing``). The ``CPU`` row describes a
modest training host (the embedded default) so that CPU plans are reproducible from a commit,
whatever machine renders them.
"""

from __future__ import annotations

from dataclasses import dataclass

from factory.errors import FactoryError


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator type."""

    name: str
    """Key in the table (``H100``...)."""
    memory_gib: float
    """Memory of one device, GiB."""
    bf16_tflops: float
    """Dense bf16 peak throughput of one device, TFLOP/s."""
    mfu: float
    """Model FLOPs utilization expected of a tuned LoRA run (the time model's defaults take a
    share of it where nothing was measured)."""
    max_devices: int
    """Devices in one node (the most the planner shards over)."""
    fused_attention: bool
    """Whether attention runs as a fused (flash) kernel that keeps no ``seq x seq`` scores."""
    interconnect: str
    """How devices talk (informational, shown in plans)."""
    memory_bandwidth_gbs: float
    """Memory bandwidth of one device, GB/s (a decode step reads every weight)."""
    evals_share_devices: bool
    """Whether evals run on the training devices (the CPU's cores), so they compete with
    training and add to its wall time; otherwise they run on their own devices (vLLM)."""


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="H200", memory_gib=141, bf16_tflops=989, mfu=0.40, max_devices=8,
             fused_attention=True, interconnect="NVLink",
             memory_bandwidth_gbs=4800, evals_share_devices=False),
    Hardware(name="H100", memory_gib=80, bf16_tflops=989, mfu=0.40, max_devices=8,
             fused_attention=True, interconnect="NVLink",
             memory_bandwidth_gbs=3350, evals_share_devices=False),
    Hardware(name="A100-80G", memory_gib=80, bf16_tflops=312, mfu=0.45, max_devices=8,
             fused_attention=True, interconnect="NVLink",
             memory_bandwidth_gbs=2039, evals_share_devices=False),
    Hardware(name="L40S", memory_gib=48, bf16_tflops=362, mfu=0.35, max_devices=8,
             fused_attention=True, interconnect="PCIe",
             memory_bandwidth_gbs=864, evals_share_devices=False),
    Hardware(name="L4", memory_gib=24, bf16_tflops=121, mfu=0.35, max_devices=8,
             fused_attention=True, interconnect="PCIe",
             memory_bandwidth_gbs=300, evals_share_devices=False),
    # torch's CPU SDPA is a flash kernel too (it saves the log-sum-exp, not the scores).
    Hardware(name="CPU", memory_gib=16, bf16_tflops=1.0, mfu=0.25, max_devices=1,
             fused_attention=True, interconnect="none", memory_bandwidth_gbs=20,
             evals_share_devices=True),
)}
"""Hardware by type."""


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise FactoryError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None
