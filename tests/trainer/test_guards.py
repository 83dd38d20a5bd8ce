"""The NaN guard, checkpoint verification, and signed webhooks end to end."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from factory.trainer.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import ReplayCache, WebhookError, read_events, verify

SECRET = b"s3cret-for-tests"


@pytest.fixture()
def receiver() -> Iterator[tuple[str, list[dict[str, Any]], list[str]]]:
    """A webhook receiver that verifies every POST with ``factory.trainer.webhooks.verify``."""
    accepted: list[dict[str, Any]] = []
    rejected: list[str] = []
    cache = ReplayCache()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                accepted.append(verify(dict(self.headers), body, {"k1": SECRET},
                                       replay_cache=cache))
                self.send_response(204)
            except WebhookError as e:
                rejected.append(str(e))
                self.send_response(401)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/trainer/events", accepted, rejected
    server.shutdown()
    server.server_close()


def test_nan_stops_without_checkpointing_bad_state_and_reports_signed_events(
        make_job, tmp_path: Path, receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    url, accepted, rejected = receiver
    monkeypatch.setenv("TEST_HOOK_SECRET", SECRET.decode())
    job_path = make_job("nan", plan={"num_steps": 6, "checkpoint_every_steps": 2},
                        debug={"nan_at_step": 4}, webhook_url=url, webhook_key_id="k1",
                        webhook_secret_env="TEST_HOOK_SECRET")
    job = TrainerJob.from_json(job_path)
    assert run_job(job) == ExitCode.NAN

    events = read_events(job.events_path)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "nan"
    nan = events[-1]
    assert nan["step"] == 4 and nan["loss"] is None and nan["last_good_step"] == 3
    assert nan["last_checkpoint"].endswith("step-00000002")
    # Step 4 never completed, so no checkpoint at or after it exists; step 2 is the resume point.
    assert [s for s, _ in list_checkpoints(job.output_dir)] == [2]
    assert [e["step"] for e in events if e["type"] == "progress"] == [1, 2, 3]
    # Every event reached the receiver, verified; none was rejected.
    assert [e["event_id"] for e in accepted] == [e["event_id"] for e in events]
    assert rejected == []

    # A resumed run models a transient fault: the injection does not fire again.
    resumed = job.replace(resume_from="latest")
    assert run_job(resumed) == ExitCode.FINISHED
    assert [s for s, _ in list_checkpoints(job.output_dir)] == [2, 4, 6]
    assert accepted[-1]["type"] == "finished"


def test_verify_rejects_tampered_missing_and_non_finite_checkpoints(make_job, tmp_path: Path
                                                                      ) -> None:
    job = TrainerJob.from_json(make_job("verify",
                                        plan={"num_steps": 1, "checkpoint_every_steps": 1}))
    assert run_job(job) == ExitCode.FINISHED
    (_, path), = list_checkpoints(job.output_dir)
    info = verify_checkpoint(path)
    assert info.step == 1 and len(info.manifest_sha256) == 64

    state = Path(path) / "trainer_state.json"
    original = state.read_bytes()
    state.write_bytes(original.replace(b'"step": 1', b'"step": 2'))
    with pytest.raises(CheckpointError, match="trainer_state.json does not match"):
        verify_checkpoint(path)
    state.write_bytes(original)

    # NaN weights whose manifest was (re)computed to match still do not count.
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    adapter = Path(path) / "adapter_model.safetensors"
    weights = load_file(adapter)
    first = next(iter(weights))
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, adapter)
    manifest_path = Path(path) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][adapter.name]["sha256"] = hashlib.sha256(adapter.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not finite"):
        verify_checkpoint(path)

    manifest_path.unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(path)
