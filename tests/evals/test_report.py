"""``factory report RUN``: rubric score and loss against step, written as a PNG and an HTML page."""

from __future__ import annotations

import base64
import itertools
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from factory.app.cli import main
from factory.lake import Lake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = "support-run-7"
_SAMPLES = itertools.count()
"""Each score row's own eval sample: samples sharing an id would share a phrasing cluster."""


def _score(kind: str, step: int | None, score: float | None, *, version: str = "v2",
           minutes: int = 0, run_id: str = RUN) -> dict[str, Any]:
    return {"run_id": run_id, "experiment": "support", "step": step, "kind": kind,
            "rubric_version": version, "sample_id": f"s{next(_SAMPLES)}", "score": score,
            "status": "ok" if score is not None else "failed", "judge": "embedded:test",
            "evaluated_at": datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes)}


def _seed_lake(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000020"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(
        {"step": 20, "loss_history": [[s, 2.0 / s] for s in range(1, 21)]}))
    lake = Lake()
    lake.append("eval_scores", [
        # an older rubric's scores: not mixed into the curve
        _score("checkpoint", 10, 0.01, version="v1", minutes=0),
        _score("base", 0, 0.2, minutes=1), _score("base", 0, 0.4, minutes=1),
        _score("reference", None, 1.0, minutes=1),
        _score("checkpoint", 10, 0.5, minutes=2), _score("checkpoint", 10, 0.7, minutes=2),
        _score("checkpoint", 10, None, minutes=2),  # a failed judgement: left out, not a zero
        _score("checkpoint", 20, 0.9, minutes=3),
        _score("checkpoint", 20, 0.3, run_id="other-run", minutes=4),
    ])
    lake.append("checkpoints", [{"run_id": RUN, "experiment": "support", "step": 20,
                                 "path": str(ckpt), "verified": True}])


def test_report_writes_png_and_html(factory_home: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _seed_lake(tmp_path)
    assert main(["report", RUN]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    png, page = Path(out["png"]), Path(out["html"])
    assert png.parent == factory_home / "reports" / RUN and page.parent == png.parent
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (700, 400)
    assert out["scores"] == [[0, pytest.approx(0.3)], [10, pytest.approx(0.6)],
                             [20, pytest.approx(0.9)]]
    assert out["reference"] == pytest.approx(1.0)
    assert out["final_loss"] == pytest.approx(0.1)  # the loss history's last point (step 20)
    text = page.read_text()
    embedded = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    assert embedded and base64.b64decode(embedded.group(1)) == data
    assert "<td>10</td><td>0.600 [0.202, 0.866] n=2 (Wilson, graded)</td>" in text
    assert "reference answers: 1.000" in text
    assert "final training loss: 0.1000 at step 20" in text

    dest = tmp_path / "elsewhere"
    assert main(["report", RUN, "--out", str(dest)]) == 0
    capsys.readouterr()
    assert (dest / "curve.png").read_bytes()[:8] == PNG_MAGIC
    assert (dest / "report.html").is_file()


def test_report_of_a_run_without_scores_is_a_clear_error(
        factory_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "nobody"]) == 2  # before any eval ever ran
    assert "has no eval scores yet" in capsys.readouterr().err
    _seed_lake(tmp_path)
    assert main(["report", "nobody"]) == 2
    assert "'nobody' has no eval scores yet" in capsys.readouterr().err
    assert not (factory_home / "reports" / "nobody").exists()
