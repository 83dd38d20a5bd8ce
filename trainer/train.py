"""The training loop: our own loop on PyTorch/transformers/PEFT primitives.

Why not the HF Trainer: exact resume needs every RNG and the data position in our checkpoint
format (no pickles), the NaN guard must run between backward and the optimizer step, the loss
must skip the full-vocabulary logits (see ``model.py``), and SIGTERM must checkpoint at a step
boundary; each is a fight with Trainer's callbacks, while the loop itself is ~200 lines.

Exit codes (``ExitCode``): 0 finished, 1 failed (a crash: retrying may heal it), 2 invalid job
(nothing loaded), 3 stopped on a non-finite loss or gradient (no checkpoint of the bad step;
resume from the last good one), 65 data or configuration error (``DataError``: the job's data,
base model or settings cannot train, and running it again cannot heal that), 75 preempted
(SIGTERM/SIGINT: a checkpoint of the last completed step was written; resume it), 69 owner gone
(the process following the run, ``TrainerJob.owner``, died: a checkpoint of the last completed step
was written and the run ends). The control plane never retries 2, 65 or 69.
"""

from __future__ import annotations

import math
import os
import random
import resource
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from .config import ExitCode, TrainConfig, TrainerJob
from .cores import ENV_POLL, CoreShare
from .data import (
    MicroBatchStream,
    MixtureStream,
    plan_tokenizer,
    read_rows,
    sources_fingerprint,
    tokenize,
)
from .distributed import shard_like, shard_model
from .model import CausalLMLoss, adapter_state, load_adapter_state, load_model
from .pids import owner_alive
from .precision import effective_precision
from .tracking import NullTracker, Tracker, make_tracker
from .vision import load_vision
from .webhooks import EventLog, WebhookSender

# Dense bf16 peak FLOP/s per device, from the vendors' datasheets (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                   "L4": 121e12}


class Preempted(Exception):
    pass


class DataError(ValueError):
    """The job cannot train on its data or settings, whatever the attempt: a ``ValueError`` of
    setup (data files, tokenizing, base model, adapter layout) or a checkpoint that belongs to
    other data or another layout. The trainer exits ``DATA_ERROR``."""


@dataclass
class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it at step boundaries."""

    signal: int | None = None
    at: float = 0.0
    event: threading.Event = field(default_factory=threading.Event)
    owner_gone: bool = False
    """Set instead of a signal when the job's owner (``TrainerJob.owner``) no longer runs."""

    def set(self, signum: int) -> None:
        self.signal, self.at = signum, time.time()
        self.event.set()


def install_signal_handlers(flag: StopFlag) -> None:
    def handler(signum: int, frame: Any) -> None:
        flag.set(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    # A blocked signal survives exec: a trainer launched by a process that had SIGTERM blocked
    # would never see the stop it is meant to checkpoint on.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def lr_at(plan: TrainConfig, step: int, num_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based): linear warmup then the schedule."""
    if plan.warmup_steps and step <= plan.warmup_steps:
        return plan.learning_rate * step / plan.warmup_steps
    if plan.lr_schedule == "constant":
        return plan.learning_rate
    span = max(1, num_steps - plan.warmup_steps)
    progress = min(1.0, (step - plan.warmup_steps) / span)
    if plan.lr_schedule == "linear":
        return plan.learning_rate * (1.0 - progress)
    return plan.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Reporter:
    """Every event to the events file, the webhook (rank 0 only) and the tracker."""

    def __init__(self, job: TrainerJob, *, rank: int, tracker: Tracker) -> None:
        self.job = job
        self.rank = rank
        self.tracker = tracker
        self.segment = uuid.uuid4().hex
        self.seq = 0
        self.log = EventLog(job.events_path) if rank == 0 else None
        self.sender = None
        secret = job.webhook_secret()
        if rank == 0 and job.webhook_url and secret is not None:
            assert job.webhook_key_id is not None
            self.sender = WebhookSender(job.webhook_url, job.webhook_key_id, secret)

    def emit(self, kind: str, **payload: Any) -> dict[str, Any]:
        event = {"event_id": uuid.uuid4().hex, "run_id": self.job.run_id, "type": kind,
                 "segment": self.segment, "seq": self.seq, "time": time.time(), **payload}
        self.seq += 1
        if self.log is not None:
            self.log.append(event)
        if self.sender is not None:
            self.sender.send(event)
        return event

    def close(self, status: str) -> None:
        if self.rank == 0:
            try:
                self.tracker.close(status)
            finally:
                if self.sender is not None:
                    self.sender.close(timeout_s=15.0)


def _setup_determinism(plan: TrainConfig) -> None:
    random.seed(plan.seed)
    import numpy as np

    np.random.seed(plan.seed % 2**32)
    torch.manual_seed(plan.seed)
    if plan.deterministic and torch.cuda.is_available():
        # CPU kernels are already run-to-run deterministic for a fixed thread count (the
        # bitwise resume test proves it for our loop); the switch matters for CUDA atomics,
        # and on CPU it costs a multi-second torch._inductor import.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return rank, world


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _autocast(plan: TrainConfig, device: torch.device) -> Any:
    if plan.precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16)


def malloc_name() -> str:
    """``jemalloc`` when this process runs it (see ``__main__.preload_jemalloc``), else
    ``system``."""
    try:
        with open("/proc/self/maps") as maps:
            return "jemalloc" if any("libjemalloc" in line for line in maps) else "system"
    except OSError:
        return "system"


def _memory(device: torch.device) -> dict[str, int]:
    out = {"peak_rss_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        out["peak_accelerator_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


class Trainer:
    """One process's share of a job (rank ``rank`` of ``world``)."""

    def __init__(self, job: TrainerJob, *, stop: StopFlag | None = None) -> None:
        self.job = job
        self.stop = stop or StopFlag()
        self.rank, self.world = _dist()
        self.device = _device()
        # The precision this device really runs (bf16 autocast is fp32 on a CPU that would
        # emulate bf16); the started event says so when it differs from the plan's.
        precision, self.precision_note = effective_precision(job.plan.precision,
                                                             self.device.type)
        self.plan = replace(job.plan, precision=precision)
        self.loss_history: list[list[float]] = []
        self.resumed_from: str | None = None
        self.last_saved: ckpt.CheckpointInfo | None = None
        self.saved_step = -1
        self.step = 0
        self.cores: CoreShare | None = None

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Data, model and optimizer; a ``ValueError`` here is a ``DataError`` (see run_job)."""
        plan = self.plan
        if self.world > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            torch.distributed.init_process_group(backend)
        _setup_determinism(plan)
        self.tokenizer = plan_tokenizer(plan.base_model)
        vision = load_vision(plan.base_model, self.job.blob_dir)
        pad_id = int(self.tokenizer.pad_token_id)
        sources = self.job.sources()
        self.stream = MixtureStream(sources, self.tokenizer, max_seq_len=plan.max_seq_len,
                                    packing=plan.packing, micro_batch_size=plan.micro_batch_size,
                                    seed=plan.seed, pad_id=pad_id,
                                    share_prefix=plan.share_prefix, vision=vision)
        self.data_stats = self.stream.first_window_stats
        if not self.stream.per_epoch:
            raise ValueError(f"{'mix' if self.job.mix else 'data_files'}: none of the "
                             f"{self.data_stats.num_samples} samples can train at max_seq_len "
                             f"{plan.max_seq_len}: {self.data_stats.describe_drops()}")
        self.fingerprint = sources_fingerprint(sources)
        self.per_step = plan.grad_accum_steps * self.world
        if plan.num_steps is not None:
            self.num_steps = plan.num_steps
        else:
            assert plan.num_epochs is not None
            self.num_steps = max(1, math.ceil(plan.num_epochs * self.stream.per_epoch
                                              / self.per_step))
        self.eval_stream = None
        if self.job.eval_data_files:
            ev, ev_stats = tokenize(read_rows(data_files=self.job.eval_data_files),
                                    self.tokenizer, max_seq_len=plan.max_seq_len, vision=vision)
            if not ev:
                raise ValueError(f"eval_data_files: none of the {ev_stats.num_samples} samples "
                                 f"can be scored at max_seq_len {plan.max_seq_len}: "
                                 f"{ev_stats.describe_drops()}")
            self.eval_stream = MicroBatchStream(ev, max_seq_len=plan.max_seq_len, packing=True,
                                                micro_batch_size=plan.micro_batch_size,
                                                seed=0, pad_id=pad_id, shuffle=False,
                                                share_prefix=plan.share_prefix)
        self.model = load_model(plan, self.device)
        self.loss_module = CausalLMLoss(self.model)
        if plan.parallelism == "fsdp2":
            shard_model(self.loss_module, self.model, device=self.device, plan=plan)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=plan.learning_rate,
                                           weight_decay=plan.weight_decay, foreach=False)

    def resume(self, path: str) -> None:
        from safetensors.torch import load

        files = ckpt.read_checkpoint(path)
        state = _json(files["trainer_state.json"])
        if state["data_fingerprint"] != self.fingerprint:
            raise DataError(f"resume_from: {path} was trained on different data")
        try:
            self.stream.seek(state["data_position"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"resume_from: {path} has no usable data position ({e})") from None
        if state["world_size"] != self.world:
            raise DataError(f"resume_from: {path} was written by {state['world_size']} "
                            f"processes, this plan runs {self.world}")
        load_adapter_state(self.model, load(files[ckpt.ADAPTER]))
        opt_state, names = ckpt.optimizer_from_files(files)
        if names != self.param_names:
            raise DataError(f"resume_from: {path} has a different adapter layout")
        if self.plan.parallelism == "fsdp2":
            # Sorted on every rank alike: shard_like is a collective.
            opt_state["state"] = {i: {k: shard_like(s[k], self.params[i]) for k in sorted(s)}
                                  for i, s in sorted(opt_state["state"].items())}
        self.optimizer.load_state_dict(opt_state)
        self.step = int(state["step"])
        self.loss_history = state["loss_history"]
        ckpt.restore_rng(files, rank=self.rank)
        self.resumed_from = path
        self.saved_step, self.last_saved = self.step, ckpt.verify_checkpoint(path)

    # -- checkpoints -----------------------------------------------------------------------

    def save(self) -> ckpt.CheckpointInfo | None:
        """Checkpoint of the current step (collective under FSDP; rank 0 writes)."""
        import json

        adapter = adapter_state(self.model)
        per_rank = self._gather_rng() if self.world > 1 else None
        opt = self.optimizer.state_dict()
        full_state = {i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                          for k, v in s.items()} for i, s in opt["state"].items()}
        if self.rank != 0:
            return None
        # The guard's second line: bad state never reaches storage, even via a bug upstream.
        assert ckpt.all_finite(adapter), "non-finite adapter weights at checkpoint time"
        files = {ckpt.ADAPTER: ckpt.tensors_to_bytes(adapter)}
        peft_config = self.model.peft_config["default"].to_dict()
        peft_config["base_model_name_or_path"] = _abs(self.plan.base_model)
        peft_config = {k: (sorted(v) if isinstance(v, set) else v)
                       for k, v in peft_config.items()}
        files["adapter_config.json"] = json.dumps(peft_config, indent=1, sort_keys=True,
                                                  default=str).encode()
        files.update(ckpt.optimizer_to_files({"state": full_state,
                                               "param_groups": opt["param_groups"]},
                                              self.param_names))
        files.update(ckpt.rng_to_files(per_rank))
        position = self.stream.position(self.step * self.per_step)
        trainer_state = {
            "run_id": self.job.run_id, "step": self.step, "num_steps": self.num_steps,
            "data_position": position, "data_fingerprint": self.fingerprint,
            "loss_history": self.loss_history, "world_size": self.world,
            "scheduler": {"kind": self.plan.lr_schedule, "warmup_steps": self.plan.warmup_steps,
                          "base_lr": self.plan.learning_rate, "num_steps": self.num_steps,
                          "last_lr": lr_at(self.plan, max(1, self.step), self.num_steps)},
            "plan": self.plan.to_dict(),
        }
        files["trainer_state.json"] = json.dumps(trainer_state, indent=1, sort_keys=True).encode()
        tok_dir = Path(self._tokenizer_dir())
        return ckpt.write_checkpoint(self.job.output_dir, self.step, files,
                                     run_id=self.job.run_id, extra_dirs=(tok_dir,))

    def _gather_rng(self) -> dict[str, list[torch.Tensor]]:
        """Every rank's torch RNG states (collective), for rank 0 to save."""
        out = {}
        states = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda_current"] = torch.cuda.get_rng_state(self.device)
        for name, state in states.items():
            local = state.to(self.device)
            gathered = [torch.empty_like(local) for _ in range(self.world)]
            torch.distributed.all_gather(gathered, local)
            out[name] = [g.cpu() for g in gathered]
        return out

    def _tokenizer_dir(self) -> str:
        if not hasattr(self, "_tok_dir"):
            import tempfile

            self._tok_tmp = tempfile.TemporaryDirectory(prefix="trainer-tok-")
            self.tokenizer.save_pretrained(self._tok_tmp.name)
            self._tok_dir = self._tok_tmp.name
        return self._tok_dir

    def _mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization on a known GPU (None on CPU or an unknown device).

        LoRA training costs ~4N FLOPs per token (forward 2N, backward through activations 2N;
        the frozen weights need no weight gradient), N the base model's parameter count;
        ``tokens_per_s`` is summed over all ranks and counts the tokens computed (a shared
        prefix once per micro-batch).
        """
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if peak is None:
            return None
        if not hasattr(self, "_num_params"):
            self._num_params = sum(p.numel() for p in self.model.parameters())
        return 4.0 * self._num_params * tokens_per_s / (peak * self.world)

    def close(self) -> None:
        if self.cores is not None:
            self.cores.leave()
            self.cores = None
        tmp = getattr(self, "_tok_tmp", None)
        if tmp is not None:
            tmp.cleanup()

    # -- the loop ----------------------------------------------------------------------------

    def _held_out(self) -> dict[str, float]:
        """The held-out loss, and the seconds its pass took (``eval_loss_s``: the step's event
        comes after the pass, and a pace measured from event times leaves it out, as
        ``bench/loop.py``'s ``step_pace`` does)."""
        began = time.perf_counter()
        loss = self._eval_loss()
        return {"eval_loss": loss, "eval_loss_s": time.perf_counter() - began}

    def _eval_loss(self) -> float:
        assert self.eval_stream is not None
        total = 0.0
        count = 0
        self.model.eval()
        with torch.no_grad(), _autocast(self.plan, self.device):
            for k in range(self.rank, self.eval_stream.per_epoch, self.world):
                b = self.eval_stream.batch(k).to(self.device)
                total += float(self.loss_module(b.input_ids, b.position_ids, b.attention_mask,
                                                b.labels, pixel_values=b.pixel_values,
                                                image_grid_thw=b.image_grid_thw))
                count += b.num_label_tokens
        self.model.train()
        t = torch.tensor([total, count], dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return float(t[0] / max(1.0, float(t[1])))

    def train_step(self, step: int, inject_nan: bool) -> dict[str, float]:
        plan = self.plan
        lr = lr_at(plan, step, self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        first = (step - 1) * self.per_step
        indices = range(first, first + self.per_step)
        self.stream.release(first)
        # Normalize by the label tokens of the whole optimizer step (all ranks, all
        # micro-batches): packed and unpacked batches then give the same gradient.
        num_label = sum(self.stream.num_label_tokens(k) for k in indices)
        scale = self.world / max(1, num_label)  # FSDP averages gradients over ranks
        loss_sum = torch.zeros((), dtype=torch.float64)
        real = computed = 0
        for k in indices[self.rank::self.world]:
            batch = self.stream.batch(k).to(self.device)
            real += batch.num_real_tokens
            computed += batch.num_computed_tokens
            with _autocast(plan, self.device):
                loss = self.loss_module(batch.input_ids, batch.position_ids,
                                        batch.attention_mask, batch.labels,
                                        pixel_values=batch.pixel_values,
                                        image_grid_thw=batch.image_grid_thw)
            if inject_nan:
                loss = loss * float("nan")
            (loss * scale).backward()
            loss_sum += loss.detach().double().cpu()
        clip = plan.max_grad_norm if plan.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        stats = torch.tensor([float(loss_sum), float(real), float(computed), float(norm)],
                             dtype=torch.float64)
        if self.world > 1:  # on the device: NCCL reduces only CUDA tensors
            summed = stats[:3].to(self.device)
            torch.distributed.all_reduce(summed)
            stats[:3] = summed.cpu()
        loss_value = float(stats[0]) / max(1, num_label)
        grad_norm = float(stats[3])
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "finite": 0.0}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "finite": 1.0,
                "real_tokens": float(stats[1]), "computed_tokens": float(stats[2]),
                "label_tokens": float(num_label)}

    def run(self, reporter: Reporter) -> ExitCode:
        plan = self.plan
        job = self.job
        resume = job.resume_from
        if resume == "latest":
            latest = ckpt.latest_checkpoint(job.output_dir)
            resume = latest.path if latest else None
        if resume:
            self.resume(resume)
        inject_at = job.debug.nan_at_step if not self.resumed_from else None
        reporter.emit("started", step=self.step, num_steps=self.num_steps,
                      resumed_from=self.resumed_from, world_size=self.world,
                      device=str(self.device), pid=os.getpid(), malloc=malloc_name(),
                      precision={"planned": job.plan.precision, "ran": plan.precision,
                                 "reason": self.precision_note},
                      data=vars(self.data_stats), mix=self.stream.summary(),
                      shared_prefix=self.stream.shared_prefix_summary(),
                      num_trainable_parameters=sum(p.numel() for p in self.params),
                      kernels=_kernel_summary(self.model))
        if self.rank == 0:
            reporter.tracker.log_params({"run_id": job.run_id, **plan.to_dict()})
        self.model.train()
        if self.device.type == "cpu" and self.cores is None and not plan.deterministic:
            # The machine's cores are split with the factory's other torch processes there (an
            # eval server beside the trainer) while the loop runs: trainer/cores.py. Not for a
            # deterministic plan: CPU kernels reproduce bitwise only at a fixed thread count.
            self.cores = CoreShare.for_this_process()
            if self.cores is not None and os.environ.get(ENV_POLL, "1") != "0":
                _poll_within_steps(self.loss_module, self.cores)
        window_t = time.perf_counter()
        window_tokens = window_computed = 0.0
        while self.step < self.num_steps:
            if job.owner and not self.stop.event.is_set() and owner_alive(job.owner) is False:
                self.stop.owner_gone, self.stop.at = True, time.time()
                self.stop.event.set()
            if self._agree_stop():
                raise Preempted
            step = self.step + 1
            if self.cores is not None:
                self.cores.adjust()
            out = self.train_step(step, inject_nan=inject_at == step)
            if not out["finite"]:
                reporter.emit("nan", step=step, loss=ckpt.finite_float(out["loss"]),
                              grad_norm=ckpt.finite_float(out["grad_norm"]),
                              last_good_step=self.step,
                              last_checkpoint=_last_checkpoint_path(job))
                return ExitCode.NAN
            self.step = step
            self.loss_history.append([step, out["loss"]])
            window_tokens += out["real_tokens"]
            window_computed += out["computed_tokens"]
            saving = step % plan.checkpoint_every_steps == 0 or step == self.num_steps
            # The held-out loss at each eval step and at each checkpoint the run saves: the
            # checkpoints' judge scores can tie, and best_checkpoint then ranks them by it.
            eval_now = self.eval_stream is not None and plan.eval_every_steps is not None \
                and (step % plan.eval_every_steps == 0 or saving)
            if step % plan.log_every_steps == 0 or step == self.num_steps:
                elapsed = time.perf_counter() - window_t
                metrics = {"loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                           "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
                mfu = self._mfu(window_computed / max(elapsed, 1e-9))
                if mfu is not None:
                    metrics["mfu"] = mfu
                if eval_now:
                    metrics.update(self._held_out())
                mem = _memory(self.device)
                if self.cores is not None:
                    metrics["cpu_threads"] = self.cores.threads or 0
                reporter.emit("progress", step=step, num_steps=self.num_steps, **metrics,
                              memory=mem, data_position=self.stream.position(step * self.per_step))
                if self.rank == 0:
                    reporter.tracker.log_metrics({**metrics, **{k: float(v) for k, v in
                                                                mem.items()}}, step=step)
                window_t, window_tokens, window_computed = time.perf_counter(), 0.0, 0.0
            elif eval_now:
                reporter.emit("progress", step=step, **self._held_out())
            if saving:
                self._checkpoint(reporter)
            if job.debug.sleep_per_step_s:
                self.stop.event.wait(job.debug.sleep_per_step_s)
        reporter.emit("finished", step=self.step, final_loss=self.loss_history[-1][1]
                      if self.loss_history else None, checkpoint=_last_checkpoint_path(job),
                      memory=_memory(self.device))
        return ExitCode.FINISHED

    def _agree_stop(self) -> bool:
        """Whether to stop now; under FSDP every rank must stop at the same step."""
        flag = self.stop.event.is_set()
        if self.world == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def _checkpoint(self, reporter: Reporter) -> ckpt.CheckpointInfo | None:
        if self.saved_step == self.step:  # on every rank alike: save() is collective
            return self.last_saved
        info = self.save()
        self.saved_step, self.last_saved = self.step, info
        if self.world > 1:
            torch.distributed.barrier()
        if info is not None:
            reporter.emit("checkpoint", step=info.step, location=info.path,
                          manifest_sha256=info.manifest_sha256)
        return info

    def preempt(self, reporter: Reporter) -> None:
        """Checkpoint the last completed step and report; the process then exits 75."""
        info = self._checkpoint(reporter) if self.step > 0 else None
        reporter.emit("preempted", step=self.step, signal=self.stop.signal,
                      checkpoint=info.path if info else None,
                      seconds_since_signal=time.time() - self.stop.at)


def _poll_within_steps(loss_module: torch.nn.Module, cores: CoreShare) -> None:
    """Have each decoder layer read the core claims again (``CoreShare.poll``: at most every
    ``POLL_S``) as its forward starts and as the gradient of its input arrives in the backward
    pass (the autograd engine runs a CPU graph on the thread that called ``backward``, whose
    thread count ``adjust`` sets). A claim made mid-step then splits the cores within a layer
    or two, not after the step."""
    decoder: Any = getattr(loss_module, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return

    def on_grad(grad: torch.Tensor) -> None:
        cores.poll()

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cores.poll()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(on_grad)

    for layer in layers:
        layer.register_forward_pre_hook(before, with_kwargs=True)


def _kernel_summary(model: Any) -> dict[str, int] | None:
    """How many modules ``kernels.patcher.apply_kernels`` changed, by kind (None: not used)."""
    report = getattr(model, "factory_kernel_report", None)
    if report is None:
        return None
    return {k: len(v) for k, v in vars(report).items() if isinstance(v, list | tuple)}


def _json(data: bytes) -> Any:
    import json

    return json.loads(data)


def _abs(path: str) -> str:
    p = Path(path)
    return str(p.resolve()) if p.exists() else path


def _last_checkpoint_path(job: TrainerJob) -> str | None:
    info = ckpt.latest_checkpoint(job.output_dir)
    return info.path if info else None


def run_job(job: TrainerJob, *, stop: StopFlag | None = None) -> ExitCode:
    """Train ``job`` in this process; every outcome is an event and an exit code."""
    rank, _ = _dist()
    tracker: Tracker = NullTracker()
    try:
        if rank == 0:
            tracker = make_tracker(job.tracker, run_id=job.run_id, events_path=job.events_path)
    except ValueError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return ExitCode.INVALID_JOB
    reporter = Reporter(job, rank=rank, tracker=tracker)
    trainer = Trainer(job, stop=stop)
    code = ExitCode.FAILED
    status = "failed"
    try:
        try:
            trainer.setup()
        except ValueError as e:
            # Setup reads only the job, its files and the base model: a ValueError there comes
            # back on every attempt. Crashes (OSError, RuntimeError) may heal and stay FAILED.
            raise DataError(str(e)) from e
        code = trainer.run(reporter)
        status = {ExitCode.FINISHED: "finished", ExitCode.NAN: "nan"}[code]
    except Preempted:
        if trainer.stop.owner_gone:
            # Nobody follows the run any more: keep what it learned, and end it for good
            # (a preemption would be resumed by the control plane).
            info = trainer._checkpoint(reporter) if trainer.step > 0 else None
            reporter.emit("failed", step=trainer.step, owner_gone=True, data_error=False,
                          checkpoint=info.path if info else None,
                          error=f"its owner {job.owner} is gone: stopped after step "
                                f"{trainer.step}" + (f", checkpoint {info.path}" if info
                                                     else ""))
            print(f"trainer: owner {job.owner} is gone; stopped", file=sys.stderr)
            code, status = ExitCode.OWNER_GONE, "failed"
        else:
            trainer.preempt(reporter)
            code, status = ExitCode.PREEMPTED, "preempted"
    except DataError as e:
        stats = getattr(trainer, "data_stats", None)
        reporter.emit("failed", step=trainer.step, error=str(e), data_error=True,
                      data=vars(stats) if stats is not None else None,
                      traceback=traceback.format_exc(limit=20))
        print(f"trainer: data or configuration error: {e}", file=sys.stderr)
        code, status = ExitCode.DATA_ERROR, "failed"
    except Exception as e:
        reporter.emit("failed", step=trainer.step, error=f"{type(e).__name__}: {e}",
                      data_error=False, traceback=traceback.format_exc(limit=20))
        print(f"trainer: failed: {type(e).__name__}: {e}", file=sys.stderr)
        code, status = ExitCode.FAILED, "failed"
    finally:
        reporter.close(status)
        trainer.close()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return code
