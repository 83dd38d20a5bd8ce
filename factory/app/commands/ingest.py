"""``factory ingest PATH... [--format ...] [--tag k=v]``: upload logged inferences into the lake.

Files and folders (``.jsonl``, ``.json``, ``.gz``; folders recursively) are streamed in constant
memory. A progress bar is drawn on a terminal; the last line on stdout is always one JSON object
``{"read": n, "ingested": n, "rejected": n, "duplicates": n}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from factory.lake import Lake
from factory.normalize import FORMATS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ingest", help="ingest logged LLM calls or traces from files and folders",
        description="Ingest .jsonl/.json/.gz files (folders recursively) into raw_traces, "
                    "samples and rejected_traces.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to ingest")
    p.add_argument("--format", choices=["auto", *FORMATS], default="auto",
                   help="force one input format (default: detect per record)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V",
                   help="label every record (repeatable)")
    p.add_argument("--project", default=None, help="project the records belong to")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="processes that parse and normalize JSON Lines (default: one per CPU; "
                        "1: all in this process)")
    p.set_defaults(func=_ingest)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_tags(items: list[str]) -> dict[str, str]:
    tags = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag expects KEY=VALUE, got {item!r}")
        tags[key] = value
    return tags


def _ingest(args: argparse.Namespace) -> int:
    # ingest loads pyarrow.compute and its workers (0.3 s): other commands start without
    from factory.ingest import ingest_paths, iter_files

    tags = parse_tags(args.tag)
    files = list(iter_files(args.paths))
    lake = Lake()
    kwargs: dict[str, Any] = {"format": args.format, "tags": tags, "project": args.project,
                              "workers": args.workers}
    if sys.stderr.isatty():
        # rich (0.1 s): only a progress bar on a terminal needs it
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        total = sum(p.stat().st_size for p in files)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
                      console=_stderr_console()) as progress:
            task = progress.add_task("ingest", total=total or None)
            summary = ingest_paths(lake, files, **kwargs,
                                   on_bytes=lambda n: progress.advance(task, n))
    else:
        summary = ingest_paths(lake, files, **kwargs)
    print(json.dumps(summary.as_dict()))
    return 0


def _stderr_console() -> Any:
    # rich (0.1 s): only a progress bar on a terminal needs it
    from rich.console import Console

    return Console(file=sys.stderr)
