"""``factory report RUN``: the run's rubric score and loss against step, as PNG and HTML."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from factory.errors import FactoryError
from factory.lake import Lake
from factory.settings import get_settings


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="plot a run's rubric score and loss against step")
    p.add_argument("run_id", help="training run id")
    p.add_argument("--out", default=None,
                   help="output folder (default $FACTORY_HOME/reports/RUN)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    # the report loads factory.evals and httpx (0.4 s): other commands start without
    from factory.evals.report import plot_png, read_curves, write_html

    lake = Lake()
    curves = read_curves(lake, args.run_id)
    if not curves.scores:
        raise FactoryError(f"run {args.run_id!r} has no eval scores yet")
    out = Path(args.out) if args.out else get_settings().home / "reports" / args.run_id
    png = plot_png(curves, out / "curve.png")
    page = write_html(curves, png, out / "report.html")
    print(json.dumps({"run_id": args.run_id, "png": str(png), "html": str(page),
                      "scores": curves.scores, "reference": curves.reference,
                      "final_loss": curves.loss[-1][1] if curves.loss else None}))
    return 0
