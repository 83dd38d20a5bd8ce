"""The provider interface the scheduler and the control loop speak (implementations live in
``factory.control.providers``): capacity, launch, status, stop, max runtime, cost per GPU-hour.

A ``Handle`` is plain JSON so a segment launched in one sensor tick (or one process) can be
followed and stopped from another.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from factory.trainer.config import TrainerJob

STATES = ("pending", "running", "succeeded", "failed", "lost")


@dataclass(frozen=True, kw_only=True)
class Handle:
    """One launched trainer process/pod/sandbox."""

    provider: str
    """Name of the provider (rung) that launched it."""
    handle_id: str
    """Sandbox id, Kubernetes Job name, or local process id string."""
    launched_at: float
    """Unix time of the launch."""
    deadline: float | None = None
    """Unix time at which the provider kills it (hard wall-clock limit); None: no limit."""
    info: dict[str, Any] = field(default_factory=dict)
    """Provider-specific details (pid, namespace, log file)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Handle:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True)
class ProviderStatus:
    """What a provider knows about a handle."""

    state: str
    """``pending`` | ``running`` | ``succeeded`` | ``failed`` | ``lost`` (gone, no exit code)."""
    exit_code: int | None = None
    """The trainer's exit code when known (75 preempted, 3 NaN; negative: killed by signal)."""
    detail: str = ""
    """Human-readable reason (pod phase, signal name)."""

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed", "lost")


class Provider(Protocol):
    """A rung of the ladder."""

    name: str
    cost_per_gpu_hour: float

    @property
    def max_runtime_s(self) -> float | None:
        """Hard wall-clock limit of one launch (None: unlimited)."""
        ...

    def capacity(self) -> int:
        """GPU slots free right now."""
        ...

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        """Start ``python -m trainer`` for ``job``; return at once."""
        ...

    def status(self, handle: Handle) -> ProviderStatus:
        ...

    def stop(self, handle: Handle) -> None:
        """Ask it to stop (SIGTERM: the trainer checkpoints), kill after the grace period."""
        ...
