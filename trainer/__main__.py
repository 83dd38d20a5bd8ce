"""``python -m trainer --job JOB.json``: the container command. Exit codes: see trainer.train."""

from __future__ import annotations

import argparse
import os
import sys

from .config import TrainerJob

JEMALLOC = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
            "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
            "/usr/local/lib/libjemalloc.so.2")
"""Where Debian (``libjemalloc2``), RHEL and a source build put jemalloc."""
MALLOC_ENV = "FACTORY_TRAINER_MALLOC"
"""``jemalloc`` (the default: used when installed) or ``system`` (glibc's malloc)."""


def preload_jemalloc() -> None:
    """Run this command again with jemalloc preloaded, when it is installed and not loaded.

    Under glibc's malloc a CPU training run's heap fragments: on the agent task the same step
    went from 4.3 to 5.3 s over 50 steps and peak RSS to 5.9 GB; with jemalloc it held 3.5-3.8 s
    and 3.7 GB (BENCHMARKS.md, "Trainer"). The allocator is chosen when a process starts, so
    this replaces the process (same pid) before torch is imported; the ranks of a multi-device
    run inherit the environment.
    """
    if os.environ.get(MALLOC_ENV, "jemalloc") != "jemalloc":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "jemalloc" in preload or not sys.platform.startswith("linux"):
        return
    lib = next((p for p in JEMALLOC if os.path.exists(p)), None)
    if lib is None:
        return
    env = {**os.environ, "LD_PRELOAD": f"{lib} {preload}".strip()}
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:  # run on with the system allocator
        print(f"trainer: could not preload {lib} ({e}); glibc malloc", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer",
                                     description="Train a LoRA adapter from a job file.")
    parser.add_argument("--job", required=True, help="path of the job JSON")
    parser.add_argument("--check", action="store_true",
                        help="validate the job and exit (0 valid, 2 invalid)")
    args = parser.parse_args(argv)
    try:
        job = TrainerJob.from_json(args.job)
    except ValueError as e:
        print(f"trainer: invalid job: {e}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    if job.plan.num_devices > 1 and "WORLD_SIZE" not in os.environ:
        # torch loads after jemalloc is preloaded and the job is checked (--check stays fast)
        from .distributed import launch

        return launch(args.job, job.plan.num_devices)
    # torch loads after jemalloc is preloaded and the job is checked (--check stays fast)
    from .train import StopFlag, install_signal_handlers, run_job

    stop = StopFlag()
    install_signal_handlers(stop)
    return int(run_job(job, stop=stop))


if __name__ == "__main__":
    preload_jemalloc()
    sys.exit(main())
