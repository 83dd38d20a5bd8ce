"""The machine's cores split among the factory's CPU torch processes (``trainer/cores.py``):
claims of live processes count, a dead one's claim is removed, pinned counts are kept and
subtracted, and a real trainer and a real CPU server hold a claim while they run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from factory.trainer.cores import ENV_FOLDER, ENV_SWITCH, CoreShare
from factory.trainer.webhooks import read_events
from tests.conftest import ROOT


@pytest.fixture()
def other() -> Iterator[subprocess.Popen[bytes]]:
    """Another live process (its pid names a claim)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _claim(folder: Path, pid: int, pinned: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(pid)
    path.write_text(str(pinned or ""))
    return path


def test_a_process_alone_keeps_its_threads_and_splits_them_beside_another(
        tmp_path: Path, other: subprocess.Popen[bytes]) -> None:
    with CoreShare(folder=tmp_path, cores=4) as share:
        assert share.share() == 4
        claim = _claim(tmp_path, other.pid)
        assert share.share() == 2
        other.kill()
        other.wait()
        assert share.share() == 4  # a dead process's claim is not counted ...
        assert not claim.exists()  # ... and is removed
        assert (tmp_path / str(os.getpid())).exists()
    assert not (tmp_path / str(os.getpid())).exists()


def test_pinned_threads_are_kept_and_left_to_their_process(
        tmp_path: Path, other: subprocess.Popen[bytes]) -> None:
    _claim(tmp_path, other.pid, pinned=1)
    with CoreShare(folder=tmp_path, cores=4) as flexible:
        assert flexible.share() == 3
    with CoreShare(folder=tmp_path, cores=4, pinned=2) as pinned:
        assert pinned.share() == 2
    _claim(tmp_path, other.pid, pinned=8)
    with CoreShare(folder=tmp_path, cores=4) as squeezed:
        assert squeezed.share() == 1  # never less than one


def test_adjust_sets_torchs_threads_and_leave_gives_them_back(
        tmp_path: Path, other: subprocess.Popen[bytes]) -> None:
    import torch

    torch.set_num_threads(2)
    share = CoreShare(folder=tmp_path)
    share.join()
    _claim(tmp_path, other.pid)
    assert share.adjust() == 1 and torch.get_num_threads() == 1
    share.leave()
    assert torch.get_num_threads() == 2


def test_sharing_is_off_with_the_switch_and_omp_num_threads_pins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FOLDER, str(tmp_path))
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert CoreShare.for_this_process() is None
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    share = CoreShare.for_this_process()
    assert share is not None and share.pinned == 3
    assert (tmp_path / str(os.getpid())).read_text() == "3"
    share.leave()


def _train(make_job, name: str, folder: Path) -> list[dict]:
    job = make_job(name, plan={"deterministic": False, "num_steps": 4,
                               "checkpoint_every_steps": 4})
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({ENV_FOLDER: str(folder), "PYTHONPATH": str(ROOT)})
    subprocess.run([sys.executable, "-m", "factory.trainer", "--job", str(job)], env=env,
                   check=True, capture_output=True, timeout=300)
    body = json.loads(job.read_text())
    return [e for e in read_events(Path(body["output_dir"]) / "events.jsonl")
            if e["type"] == "progress" and "loss" in e]


@pytest.mark.slow
def test_a_cpu_trainer_takes_half_the_threads_beside_another_claim(
        make_job, tmp_path: Path, other: subprocess.Popen[bytes]) -> None:
    full = _fresh_threads()
    alone = _train(make_job, "alone", tmp_path / "cores-alone")
    assert alone and {e["cpu_threads"] for e in alone} == {full}
    folder = tmp_path / "cores-beside"
    _claim(folder, other.pid)
    beside = _train(make_job, "beside", folder)
    assert beside and {e["cpu_threads"] for e in beside} == {max(1, full // 2)}
    assert sorted(p.name for p in folder.iterdir()) == [str(other.pid)]  # the trainer left


def _fresh_threads() -> int:
    """torch's thread count in a fresh process without ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, check=True, capture_output=True, text=True, timeout=120)
    return int(out.stdout)


@pytest.mark.slow
def test_the_cpu_server_holds_a_claim_while_it_serves(tiny_model_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from factory.inference.launcher import InferenceServer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # `make test` pins one thread

    folder = tmp_path / "cores"
    with InferenceServer(tiny_model_dir, served_model_name="base", startup_timeout_s=240,
                         env={ENV_FOLDER: str(folder)}) as server:
        assert server.proc is not None
        claim = folder / str(server.proc.pid)
        assert claim.exists() and claim.read_text() == ""  # not pinned: its share moves
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
    assert not claim.exists()  # left on a graceful stop
