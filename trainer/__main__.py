"""``python -m trainer --job JOB.json``: the container command. Exit codes: see trainer.train."""

from __future__ import annotations

import argparse
import os
import sys

from .config import Job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer",
                                     description="Train a LoRA adapter from a job file.")
    parser.add_argument("--job", required=True, help="path of the job JSON")
    parser.add_argument("--check", action="store_true",
                        help="validate the job and exit (0 valid, 2 invalid)")
    args = parser.parse_args(argv)
    try:
        job = Job.from_json(args.job)
    except ValueError as e:
        print(f"trainer: invalid job: {e}", file=sys.stderr)
        return 2
    if args.check:
        return 0
    if job.plan.num_devices > 1 and "WORLD_SIZE" not in os.environ:
        from .distributed import launch

        return launch(args.job, job.plan.num_devices)
    from .train import StopFlag, install_signal_handlers, run_job

    stop = StopFlag()
    install_signal_handlers(stop)
    return int(run_job(job, stop=stop))


if __name__ == "__main__":
    sys.exit(main())
