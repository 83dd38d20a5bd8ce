"""The machine's cores split among the factory's CPU torch processes that work
(``trainer/cores.py``): claims of live processes count, a dead one's claim is removed, pinned
counts are kept and subtracted, a busy-while claim (a vLLM server's) counts only while its
server's metrics report requests, a real trainer holds a claim while it runs, and a real CPU
server only while it answers: a trainer beside an idle server gets every thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from factory.trainer.cores import ENV_FOLDER, ENV_SWITCH, CoreShare, claim_for, folder_of
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


def test_release_drops_the_claim_and_join_claims_again(tmp_path: Path) -> None:
    share = CoreShare(folder=tmp_path, cores=4)
    own = tmp_path / str(os.getpid())
    share.join()
    share.join()  # claiming while it holds the claim changes nothing
    assert own.exists() and share.path == own
    share.release()  # no work: no claim
    assert not own.exists() and share.path is None
    share.join()
    assert own.exists()
    share.leave()
    assert not own.exists()


class Metrics:
    """A Prometheus endpoint on a real HTTP server, serving ``text`` (what vLLM's ``/metrics``
    says), stopped by ``close``."""

    def __init__(self) -> None:
        self.text = ""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = metrics.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def serving(self, running: float, waiting: float) -> None:
        labels = '{engine="0",model_name="base"}'
        self.text = (f"# HELP vllm:num_requests_running Number of requests in model execution.\n"
                     f"# TYPE vllm:num_requests_running gauge\n"
                     f"vllm:num_requests_running{labels} {running}\n"
                     f"vllm:num_requests_waiting{labels} {waiting}\n"
                     f'vllm:num_requests_waiting_by_reason{{reason="capacity"}} {waiting}\n')

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    yield m
    m.close()


def test_a_busy_while_claim_counts_only_while_its_server_has_requests(
        tmp_path: Path, other: subprocess.Popen[bytes], metrics: Metrics) -> None:
    claim = claim_for(other.pid, pinned=2, busy_url=metrics.url, folder=tmp_path)
    assert claim == tmp_path / str(other.pid)
    with CoreShare(folder=tmp_path, cores=4) as trainer:
        metrics.serving(running=0.0, waiting=0.0)
        assert trainer.share() == 4  # an idle vLLM takes no core
        metrics.serving(running=1.0, waiting=0.0)
        assert trainer.share() == 2
        metrics.serving(running=0.0, waiting=3.0)
        assert trainer.share() == 2  # queued requests are work too
        metrics.text = "# a server that does not report requests\n"
        assert trainer.share() == 2  # it might be busy: counted
        metrics.serving(running=0.0, waiting=0.0)
        assert trainer.share() == 4
        metrics.close()
        assert trainer.share() == 2  # alive and not answering: counted
        other.kill()
        other.wait()
        assert trainer.share() == 4 and not claim.exists()  # it went with its process


def test_a_busy_while_claim_names_its_threads_and_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="pinned: must be at least 1"):
        claim_for(1, pinned=0, busy_url="http://127.0.0.1:1/metrics", folder=tmp_path)
    with pytest.raises(ValueError, match="busy_url: must be the server's http"):
        claim_for(1, pinned=1, busy_url="127.0.0.1:1/metrics", folder=tmp_path)
    monkeypatch.delenv(ENV_FOLDER, raising=False)
    assert folder_of({ENV_FOLDER: str(tmp_path)}) == tmp_path
    assert folder_of({ENV_SWITCH: "0", ENV_FOLDER: str(tmp_path)}) is None
    assert folder_of({}) is not None and folder_of({}) == folder_of()


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


def test_a_claim_made_mid_step_splits_the_cores_within_that_step(
        tiny_model_dir: Path, tmp_path: Path, other: subprocess.Popen[bytes],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An eval server's first request arrives mid-step: the trainer's decoder layers read the
    claims again (``_poll_within_steps``), so the rest of that step's forward runs at the split
    count, and its backward pass takes the cores back once the claim is gone; not only the next
    step, after one spent oversubscribed."""
    import torch

    from factory.trainer import cores
    from factory.trainer.config import TrainConfig
    from factory.trainer.model import CausalLMLoss, load_model
    from factory.trainer.train import _poll_within_steps

    monkeypatch.setattr(cores, "POLL_S", 0.0)  # every layer reads; the trainer's: 0.5 s
    plan = TrainConfig(base_model=str(tiny_model_dir), max_seq_len=64, learning_rate=1e-3,
                       num_steps=1, lora_rank=4)
    loss_module = CausalLMLoss(load_model(plan, torch.device("cpu")))
    layers = loss_module.decoder.layers
    assert len(layers) >= 2
    seen: list[int] = []
    with CoreShare(folder=tmp_path, cores=2) as share:
        assert share.adjust() == 2  # alone, as the step starts
        _poll_within_steps(loss_module, share)
        layers[0].register_forward_hook(lambda *_: _claim(tmp_path, other.pid) and None)
        layers[-1].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        ids = torch.randint(0, 100, (1, 16))
        loss = loss_module(ids, torch.arange(16)[None], None, ids)
        assert seen == [1]  # the claim appeared after layer 0; the last layer ran split
        (tmp_path / str(other.pid)).unlink()  # the eval ends before the backward pass
        loss.backward()
        assert torch.get_num_threads() == 2 and share.threads == 2


def _fresh_threads() -> int:
    """torch's thread count in a fresh process without ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, check=True, capture_output=True, text=True, timeout=120)
    return int(out.stdout)


@pytest.mark.slow
def test_a_trainer_beside_an_idle_cpu_server_gets_every_thread(
        make_job, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment waiting for traffic takes no core: a trainer beside it trains on all of
    them; while the server answers, the trainer's share drops, and it is back to all once the
    answer is in."""
    import httpx

    from factory.inference.launcher import InferenceServer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # `make test` pins one thread
    full = _fresh_threads()
    folder = tmp_path / "cores"
    with InferenceServer(tiny_model_dir, served_model_name="base", startup_timeout_s=240,
                         env={ENV_FOLDER: str(folder)}) as server:
        assert server.proc is not None
        claim = folder / str(server.proc.pid)
        assert not claim.exists()  # healthy and idle: no claim
        beside = _train(make_job, "beside-idle", folder)
        assert beside and {e["cpu_threads"] for e in beside} == {full}

        with CoreShare(folder=folder, cores=4) as trainer:  # a trainer's pick, on the claims
            assert trainer.share() == 4
            # Long enough to be still in flight after its first line: 8 tokens of the tiny
            # model could all be generated (and the claim released) before the test read it.
            body = {"model": "base", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 256, "stream": True}
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # the request is in flight
                assert claim.read_text() == ""  # not pinned: its share moves
                assert trainer.share() == 2
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            assert not claim.exists() and trainer.share() == 4  # answered: all of them again
            # A prompt's log-probs (the equivalence gate's echo) are work too, and end the same.
            r2 = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": "base", "prompt": "hello there", "max_tokens": 0, "echo": True,
                "logprobs": 0})
            assert r2.status_code == 200 and r2.json()["choices"][0]["logprobs"]["tokens"]
            assert not claim.exists() and trainer.share() == 4
    assert not claim.exists()
