"""Dev and test splits of the benches' held-out requests, and the ledger of every test score.

A figure from a set that also chose the configuration reports the best draw, not what a user
gets (the agent bench once kept the best of seven configurations scored on one set). So each
bench that scores held-out requests draws them from one of two splits of the same generator:

- ``dev``: for choosing configurations (recipes, overrides, planner defaults); score it as often
  as you like. The default.
- ``test``: scored once per configuration chosen on dev, with its baseline (the base model)
  from the same run. Every test score is appended to ``LEDGER`` (committed with the repository:
  the record of what was tried), with the commit, the configuration and the seed;
  ``python bench/splits.py`` prints the ledger as BENCHMARKS.md's "Test-split ledger" shows
  it, with the mean and spread over seeds per configuration.

The two splits are the same generator at seeds ``DEV_OFFSET`` apart: different draws (a short
ticket of a frame without slots can come out the same in both: 3 of triage's 200); the test
seeds are the ones the benches always used (seed + 1 for the held-out frames), so earlier
figures stay comparable. The ledger begins with the test scores BENCHMARKS.md kept before the
split existed (their ``note`` says so); older ones are in git history only.

    .venv/bin/python bench/splits.py            # the ledger, grouped, as Markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SPLITS = ("dev", "test")

DEV_OFFSET = 1000
"""Dev draws use the test seed plus this."""

LEDGER = Path(__file__).resolve().parent / "test_ledger.jsonl"
"""Every test-split score taken, one JSON object a line (``record``)."""

ROOT = Path(__file__).resolve().parent.parent
LEDGER_PATH = LEDGER.relative_to(ROOT).as_posix()
"""The ledger's path in the repository (what the commit label leaves out)."""


def heldout_seed(seed: int, split: str) -> int:
    """The generator seed of a held-out set: ``seed`` on the test split (what the benches
    always drew), ``seed + DEV_OFFSET`` on dev."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    return seed + (DEV_OFFSET if split == "dev" else 0)


def commit() -> str:
    """The checkout's short commit, ``-dirty`` when the tree differs from it (the ledger aside:
    the benches append to it themselves)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  f":(exclude){LEDGER_PATH}")
    return sha + ("-dirty" if changed else "")


def record(*, bench: str, task: str, config: Mapping[str, Any], seed: int, heldout: str,
           num: int, deployed: float | None, base: float | None,
           ledger: Path = LEDGER, note: str = "") -> dict[str, Any]:
    """Append one test score: the bench, its task and held-out set, the configuration (every
    setting that was chosen: recipe, records, overrides), the seed, the number of requests,
    the deployed model's and the base model's exact-match share. Returns the entry."""
    entry = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit(),
             "bench": bench, "task": task, "heldout": heldout,
             "config": dict(sorted(config.items())), "seed": seed, "num": num,
             "deployed": deployed, "base": base, "note": note}
    with ledger.open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def read(ledger: Path = LEDGER) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def _pct(values: Sequence[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1%}"
    return f"{mean:.1%} ± {statistics.stdev(values):.1%}"


def render(entries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per (bench, task, held-out set, configuration, commit) with its seeds,
    the deployed model's mean ± standard deviation over them, every score, and the base
    model's; rows in the order their first score was taken."""
    groups: dict[tuple[str, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for e in entries:
        key = (e["bench"], e["task"], e["heldout"], json.dumps(e["config"], sort_keys=True),
               e["commit"])
        groups[key].append(e)
    lines = ["| bench | task | held-out set | configuration | commit | seeds | deployed: mean "
             "± sd (each) | base |", "|---|---|---|---|---|---|---|---|"]
    for (bench, task, heldout, config, sha), es in groups.items():
        dep = [e["deployed"] for e in es if e["deployed"] is not None]
        base = [e["base"] for e in es if e["base"] is not None]
        each = ", ".join(f"{v:.1%}" for v in dep)
        notes = "; ".join(sorted({e["note"] for e in es if e.get("note")}))
        lines.append(f"| {bench} | {task} | {heldout} | `{config}`"
                     + (f" ({notes})" if notes else "")
                     + f" | {sha} | {', '.join(str(e['seed']) for e in es)} | "
                     f"{_pct(dep)} ({each}) | {_pct(base)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ledger", type=Path, default=LEDGER)
    args = p.parse_args(argv)
    print(render(read(args.ledger)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
