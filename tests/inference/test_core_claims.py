"""The CPU server's claim on the machine's cores (``factory.trainer.cores``) follows its work:
``BatchScheduler`` claims when a request is submitted to it idle, holds the claim while any
request is waiting or running, generations and prompt log-probs alike, and releases it before
the last caller is answered, also when the work fails. The engine is the real one, on the tiny
model; the claims are read as a trainer reads them."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from factory.inference.engine import BatchScheduler, Engine, GenerationRequest
from factory.trainer.cores import CoreShare

# The engine passes ``past_key_values``, which transformers 5.25 deprecates for ``cache``; the
# server's process only logs it, a test generating in its own process would fail on it.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(tiny_model_dir, served_model_name="base")


@pytest.fixture()
def claims(tmp_path: Path) -> Path:
    return tmp_path / "cores"


@pytest.fixture()
def scheduler(engine: Engine, claims: Path) -> Iterator[BatchScheduler]:
    cores = CoreShare(folder=claims, cores=1)
    cores.join()  # as ``python -m factory.inference`` joins at start
    s = BatchScheduler(engine, max_batch_size=4, cores=cores)
    yield s
    s.close()


def _claimed(claims: Path) -> bool:
    """Whether this process (the server here) holds a claim."""
    return (claims / str(os.getpid())).exists()


def test_an_idle_server_holds_no_claim_and_claims_while_it_works(
        scheduler: BatchScheduler, engine: Engine, claims: Path) -> None:
    assert not _claimed(claims)  # idle from the start
    started, go = threading.Event(), threading.Event()

    def blocking() -> str:
        started.set()
        go.wait(timeout=60)
        return "done"

    held = scheduler.call(blocking)
    assert _claimed(claims)  # claimed at submission, before the work starts
    prompt = engine.encode("base", "hello there")
    queued = scheduler.submit(GenerationRequest(model="base", prompt_ids=prompt, max_tokens=3))
    assert started.wait(timeout=60)
    assert _claimed(claims)
    go.set()
    assert held.result(timeout=60) == "done"
    result = queued.result(timeout=120)
    assert result.token_ids and not _claimed(claims)  # answered: released before the answer
    lps = scheduler.call(engine.prompt_logprobs, "base", prompt, 1).result(timeout=60)
    assert lps[0] is None and len(lps) == len(prompt) and not _claimed(claims)


def test_failed_work_releases_the_claim_and_reaches_its_caller(
        scheduler: BatchScheduler, claims: Path) -> None:
    bad = scheduler.submit(GenerationRequest(model="nope", prompt_ids=[1], max_tokens=2))
    with pytest.raises(ValueError, match="`nope` does not exist"):
        bad.result(timeout=60)
    assert not _claimed(claims)

