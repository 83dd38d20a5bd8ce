"""Synthesis: thin slices, a scripted OpenAI-compatible teacher, drops with reasons, a slice
filled to its target, resume, and synthetic samples through curation (train side only,
decontaminated, in the profile)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest

from factory.curation import synthesis
from factory.curation.slices import Labeler, length_bucket, profile_slices
from factory.experiments import ExperimentError, parse_experiment
from factory.lake import Lake
from factory.normalize.canon import canonical_json, sample_id
from factory.planner import DatasetProfile
from factory.tables import TABLES
from factory.tasks import ticket_triage
from factory.tasks.planted import chat

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

THIN = "shipping"
SURE, UNSURE = 0.97, 0.4
REFUSAL = "I'm sorry, but I can't help with that request."


def _rows(num: int, *, keep_thin: int, seed: int = 1) -> list[dict[str, Any]]:
    """``samples`` rows of ticket triage, the THIN label cut to ``keep_thin`` tickets."""
    out, kept = [], 0
    for i, conv in enumerate(ticket_triage.generate_conversations(num, seed=seed)):
        if conv["label"] == THIN:
            kept += 1
            if kept > keep_thin:
                continue
        system, user = conv["messages"][0]["content"], conv["messages"][1]["content"]
        messages = chat(user, conv["label"], system)
        out.append({"sample_id": sample_id(messages, []), "raw_trace_id": f"t{seed}-{i}",
                    "source": "upload", "provider": "openai", "model": "gpt-x",
                    "messages": canonical_json(messages), "tools": "[]", "num_turns": 1,
                    "has_images": False, "has_tool_calls": False, "created_at": None,
                    "project": "triage", "tags": [("project", "triage")]})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class ScriptedTeacher:
    """An OpenAI-compatible teacher. Request calls for the THIN label take the next of
    ``modes`` (then ``good``); every other call is answered well. Modes: ``good`` (a held-out
    ticket of the label), ``malformed`` (no <request> tags), ``refusal``, ``timeout`` (answers
    after ``delay_s``), ``http_error`` (500), ``off_slice`` (answered with another label),
    ``empty_answer``, ``dup`` (the same request each time), ``copy:<text>`` (that request),
    ``unsure`` (a good request whose answer the teacher gives probability ``UNSURE``). Asked
    for ``logprobs``, it gives each answer's probability as one token's, unless ``logprobs``
    is off (an endpoint that returns none)."""

    def __init__(self, modes: list[str], *, delay_s: float = 3.0) -> None:
        self.modes = list(modes)
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.answers: dict[str, str] = {}
        self.tickets = iter(ticket_triage.generate_heldout(400, seed=9))
        self.num_calls = 0
        self.bodies: list[dict[str, Any]] = []
        self.logprobs = True
        self.probability: dict[str, float] = {}

    def _ticket(self, label: str) -> str:
        for t in self.tickets:
            if t["label"] == label:
                return str(t["messages"][1]["content"])
        raise AssertionError("out of held-out tickets")

    def reply(self, body: dict[str, Any]) -> tuple[int, str | None, float, float | None]:
        """(HTTP status, text, delay, the answer's probability when asked and given)."""
        status, text, delay = self._reply(body)
        messages = body["messages"]
        asked = body.get("logprobs") and self.logprobs \
            and _text(messages[0]["content"]) != synthesis.REQUEST_SYSTEM
        p = self.probability.get(_text(messages[-1]["content"]), SURE) if asked else None
        return status, text, delay, p

    def _reply(self, body: dict[str, Any]) -> tuple[int, str | None, float]:
        with self.lock:
            self.num_calls += 1
            self.bodies.append(body)
            messages = body["messages"]
            user = _text(messages[-1]["content"])
            if _text(messages[0]["content"]) != synthesis.REQUEST_SYSTEM:  # the answer call
                return 200, self.answers.get(user, THIN), 0.0
            label = THIN if f"correct answer is `{THIN}`" in user else "billing"
            mode = self.modes.pop(0) if label == THIN and self.modes else "good"
            if mode == "malformed":
                return 200, "Sure, a customer could write: my parcel is late.", 0.0
            if mode == "refusal":
                return 200, REFUSAL, 0.0
            if mode == "timeout":
                return 200, "<request>too late</request>", self.delay_s
            if mode == "http_error":
                return 500, None, 0.0
            request = {"dup": "Where is my parcel? Tracking shows nothing for a week.",
                       }.get(mode) or (mode[5:] if mode.startswith("copy:")
                                       else self._ticket(label))
            self.answers[request] = {"off_slice": "billing", "empty_answer": ""}.get(mode, label)
            if mode == "unsure":
                self.probability[request] = UNSURE
            return 200, f"<request>{request}</request>", 0.0


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, text, delay, p = self.server.teacher.reply(body)  # type: ignore[attr-defined]
        if delay:
            time.sleep(delay)  # a slow teacher: the client gives up first
        payload = ({"error": {"message": "scripted failure"}} if status >= 400 else
                   {"id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}]})
        if p is not None and status < 400:
            payload["choices"][0]["logprobs"] = {"content": [
                {"token": text, "logprob": math.log(p), "bytes": list((text or "").encode()),
                 "top_logprobs": []}]}
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture()
def serve() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(teacher: ScriptedTeacher) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.teacher = teacher  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# -- slices ---------------------------------------------------------------------------------


def _train(rows: list[dict[str, Any]], origin: str = "traffic") -> pa.Table:
    t = pa.Table.from_pylist(rows, schema=TABLES["samples"])
    t = t.append_column("num_tokens", pa.array([100] * t.num_rows, pa.int32()))
    return t.append_column("origin", pa.array([origin] * t.num_rows))


def test_thin_slices_by_label_tool_and_length() -> None:
    slices = {s.key: s for s in profile_slices(_train(_rows(200, keep_thin=3)))}
    labels = {k: s for k, s in slices.items() if k.startswith("label:")}
    assert set(labels) == {f"label:{x}" for x in ticket_triage.LABELS}
    assert [k for k, s in labels.items() if s.thin] == [f"label:{THIN}"]
    assert labels[f"label:{THIN}"].num_traffic == 3
    assert labels[f"label:{THIN}"].even == -(-163 // 5)
    # one length bucket only: nothing to compare it with, so not thin
    assert [s.thin for k, s in slices.items() if k.startswith("length:")] == [False]
    assert length_bucket(10) == "<64" and length_bucket(64) == "64-127"
    assert length_bucket(300) == "256-511"
    # JSON answers: the field whose values are a closed label set labels them
    answers = [json.dumps({"name": f"n{i}", "intent": ["refund", "bug"][i % 2]})
               for i in range(20)]
    labeler = Labeler.fit(answers)
    assert labeler is not None and labeler.field == "intent"
    assert labeler.label(answers[1]) == "intent=bug"
    # tool calls: one slice per tool of the final assistant turn
    call = [{"role": "user", "content": [{"type": "text", "text": "where is order 7"}]},
            {"role": "assistant", "content": [],
             "tool_calls": [{"id": "call_0", "name": "lookup", "arguments": "{}"}]}]
    row = {**_rows(1, keep_thin=0)[0], "messages": canonical_json(call)}
    assert "tool:lookup" in {s.key for s in profile_slices(_train([row]))}
    # The planner reads samples per label from the profile's slices (its epochs rule).
    stats = {k: 1 for k in ("prompt_tokens_p50", "prompt_tokens_p95", "prompt_tokens_p99",
                            "prompt_tokens_max", "completion_tokens_p50", "completion_tokens_p95",
                            "completion_tokens_p99", "completion_tokens_max")}
    profile = DatasetProfile.from_row({"num_train": 200, **stats, "slices": json.dumps(
        [s.to_dict() for s in slices.values()])})
    assert set(profile.label_counts) == set(ticket_triage.LABELS)
    assert profile.label_counts[THIN] == 3
    assert sum(profile.label_counts.values()) == 163


def test_every_seed_leads_an_attempt_and_companions_vary() -> None:
    train = _train(_rows(200, keep_thin=6))
    labeler = Labeler.fit(list(ticket_triage.LABELS) * 4)
    members = synthesis.slice_members(train, labeler)
    thin = [s for s in profile_slices(train) if s.key == f"label:{THIN}"]
    attempts = synthesis.plan_attempts("triage", thin, members, max_per_slice=12)
    assert len(attempts) == 12 and all(len(a.seeds) == synthesis.NUM_SEEDS for a in attempts)
    assert {a.seed_ids[0] for a in attempts} == {r["sample_id"] for r in members[f"label:{THIN}"]}
    assert len({frozenset(a.seed_ids) for a in attempts}) > 6
    assert all(len(set(a.seed_ids)) == synthesis.NUM_SEEDS for a in attempts)
    assert synthesis.plan_attempts("triage", thin, members, max_per_slice=12) == attempts
    assert {a.target for a in attempts} == {12}
    # more attempts per sample extend the plan: the first ones are the same attempts
    more = synthesis.plan_attempts("triage", thin, members, max_per_slice=12,
                                   attempts_per_sample=2.5)
    assert len(more) == 30 and more[:12] == attempts
    assert len(synthesis.plan_attempts("triage", thin, members, max_per_slice=10,
                                       attempts_per_sample=1.1)) == 11
    with pytest.raises(ValueError, match="attempts_per_sample"):
        synthesis.plan_attempts("triage", thin, members, max_per_slice=12,
                                attempts_per_sample=0.5)


# -- the teacher ----------------------------------------------------------------------------


def _attempts(num: int, *, attempts_per_sample: float = 1.0) -> list[synthesis.Attempt]:
    """The thin slice's attempts for a target of ``num`` samples."""
    rows = _rows(200, keep_thin=3)
    train = _train(rows)
    slices = [s for s in profile_slices(train) if s.key == f"label:{THIN}"]
    labeler = Labeler.fit([ticket_triage.LABELS[i % 5] for i in range(20)])
    members = synthesis.slice_members(train, labeler)
    attempts = synthesis.plan_attempts("triage", slices, members, max_per_slice=num,
                                       attempts_per_sample=attempts_per_sample)
    assert len(attempts) == math.ceil(num * attempts_per_sample)
    assert {a.target for a in attempts} == {num}
    assert all(set(a.seed_ids) <= {r["sample_id"] for r in members[f"label:{THIN}"]}
               for a in attempts)
    return attempts


MODES = ["malformed", "refusal", "timeout", "http_error", "off_slice", "empty_answer", "dup",
         "dup", "good", "good"]


def test_teacher_failures_are_counted_drops_and_a_crash_resumes_without_duplicates(
        serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = _attempts(len(MODES))
    labeler = Labeler.fit(list(ticket_triage.LABELS) * 4)
    scripted = ScriptedTeacher(MODES)
    teacher = synthesis.Teacher(base_url=serve(scripted), model="scripted", timeout_s=1.0)
    written: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []
    calls = {"n": 0}

    def crash_after_first_batch(rows: list[dict[str, Any]],
                                drops: list[dict[str, Any]]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the run was killed")
        written.extend(rows)
        dropped.extend(drops)

    monkeypatch.setattr(synthesis, "BATCH", 4)
    with pytest.raises(RuntimeError, match="killed"):
        synthesis.synthesize(attempts, teacher, labeler, recorded=[], known_ids=[],
                             write=crash_after_first_batch, concurrency=1)
    assert len(written) + len(dropped) == 4

    def write(rows: list[dict[str, Any]], drops: list[dict[str, Any]]) -> None:
        written.extend(rows)
        dropped.extend(drops)

    # the second batch was lost with the crash: its modes are asked again, in order
    scripted.modes = MODES[4:]
    recorded = {r["attempt_id"] for r in written + dropped}
    out = synthesis.synthesize(attempts, teacher, labeler, recorded=recorded,
                               known_ids={r["sample_id"] for r in written},
                               write=write, concurrency=1)
    # one attempt per sample: every attempt runs, the slice short of its target
    assert (out.num_planned, out.num_skipped, out.num_not_needed) == (10, 4, 0)
    ids = [r["attempt_id"] for r in written + dropped]
    assert sorted(ids) == sorted(a.attempt_id for a in attempts)  # each attempt once
    reasons = Counter(d["reason"] for d in dropped)
    assert reasons == {"malformed": 2, "refusal": 1, "timeout": 1, "teacher_error": 1,
                       "off_slice": 1, "duplicate": 1}
    by_reason = {d["reason"]: d for d in dropped}
    # requests are sampled, seeded by the attempt (a retried attempt asks for the same draw);
    # answers are greedy
    asked = [b for b in scripted.bodies
             if _text(b["messages"][0]["content"]) == synthesis.REQUEST_SYSTEM]
    assert {b["temperature"] for b in asked} == {synthesis.REQUEST_TEMPERATURE}
    assert len({b["seed"] for b in asked}) == 10
    assert {b["temperature"] for b in scripted.bodies if b not in asked} == {0}
    assert by_reason["timeout"]["step"] == "request"
    assert "1.0s" in by_reason["timeout"]["detail"]
    assert {d["step"] for d in dropped if d["reason"] == "malformed"} == {"request", "answer"}
    assert len(written) == 3 and len({r["sample_id"] for r in written}) == 3
    for r in written:
        messages = json.loads(r["messages"])
        assert messages[-1]["content"] == [{"type": "text", "text": THIN}]
        assert r["source"] == "synthetic" and r["teacher"] == "scripted"
        assert r["slice"] == f"label:{THIN}" and len(r["seed_sample_ids"]) == 3
        assert json.loads(r["prompt"])[0]["content"] == synthesis.REQUEST_SYSTEM
        assert r["sample_id"] == sample_id(messages, [])
    # everything recorded: a third run calls the teacher no more
    before = scripted.num_calls
    again = synthesis.synthesize(attempts, teacher, labeler, recorded=set(ids), known_ids=[],
                                 write=write)
    assert (again.num_skipped, again.num_written, scripted.num_calls) == (10, 0, before)


def _requests(scripted: ScriptedTeacher) -> list[dict[str, Any]]:
    """The request-writing calls the teacher was sent: one per attempt run."""
    return [b for b in scripted.bodies
            if _text(b["messages"][0]["content"]) == synthesis.REQUEST_SYSTEM]


def test_a_slice_stops_at_its_target_and_its_later_attempts_are_not_run(serve: Any) -> None:
    """Three attempts per sample for a target of 4: each batch takes no more attempts than the
    slice lacks, so the slice ends at exactly 4 samples; the 4 attempts it did not need are
    neither run nor recorded."""
    attempts = _attempts(4, attempts_per_sample=3)
    labeler = Labeler.fit(list(ticket_triage.LABELS) * 4)
    scripted = ScriptedTeacher(["malformed", "good", "off_slice", "good", "unsure", "good",
                                "refusal", "good", "good", "good"])
    teacher = synthesis.Teacher(base_url=serve(scripted), model="scripted", min_confidence=0.9)
    rows: list[dict[str, Any]] = []
    drops: list[dict[str, Any]] = []
    batches: list[list[int]] = []

    def write(r: list[dict[str, Any]], d: list[dict[str, Any]]) -> None:
        rows.extend(r)
        drops.extend(d)
        batches.append(sorted(x["attempt"] for x in r + d))

    out = synthesis.synthesize(attempts, teacher, labeler, recorded=[], known_ids=[],
                               write=write, concurrency=1)
    teacher.close()
    assert batches == [[0, 1, 2, 3], [4, 5], [6], [7]]
    assert len(rows) == 4 and len({r["sample_id"] for r in rows}) == 4
    assert (out.num_planned, out.num_written, out.num_not_needed) == (12, 4, 4)
    assert out.by_slice == {f"label:{THIN}": 4}
    assert out.drops == {"low_confidence": 1, "malformed": 1, "off_slice": 1, "refusal": 1}
    assert sorted(d["reason"] for d in drops) == sorted(out.drops)
    assert len(_requests(scripted)) == 8 and scripted.modes == ["good", "good"]


def test_a_resumed_synthesis_counts_earlier_samples_toward_the_target(serve: Any) -> None:
    """A run killed after its first batch, resumed: the resumed run takes only what the slice
    still lacks, drops a copy of an earlier sample as a duplicate, and the slice ends at its
    target; a third run asks the teacher nothing."""
    attempts = _attempts(4, attempts_per_sample=3)
    labeler = Labeler.fit(list(ticket_triage.LABELS) * 4)
    scripted = ScriptedTeacher(["malformed", "good", "good", "off_slice"])
    teacher = synthesis.Teacher(base_url=serve(scripted), model="scripted")
    rows: list[dict[str, Any]] = []
    drops: list[dict[str, Any]] = []

    def killed_after_first_batch(r: list[dict[str, Any]], d: list[dict[str, Any]]) -> None:
        if rows or drops:
            raise RuntimeError("the run was killed")
        rows.extend(r)
        drops.extend(d)

    with pytest.raises(RuntimeError, match="killed"):
        synthesis.synthesize(attempts, teacher, labeler, recorded=[], known_ids=[],
                             write=killed_after_first_batch, concurrency=1)
    assert (len(rows), len(drops)) == (2, 2)

    def resume() -> synthesis.Outcome:
        return synthesis.synthesize(
            attempts, teacher, labeler, recorded={x["attempt_id"] for x in rows + drops},
            known_ids={r["sample_id"] for r in rows},
            write=lambda r, d: (rows.extend(r), drops.extend(d)), concurrency=1,
            written_before=Counter(r["slice"] for r in rows))

    earlier = _user_and_answer(rows[0]["messages"])[0]
    scripted.modes = [f"copy:{earlier}", "good", "good", "good"]
    before = len(_requests(scripted))
    out = resume()
    assert (out.num_skipped, out.num_written, out.num_not_needed) == (4, 2, 5)
    assert out.drops == {"duplicate": 1}
    assert len(_requests(scripted)) - before == 3 and scripted.modes == ["good"]
    assert len(rows) == 4 and len({r["sample_id"] for r in rows}) == 4
    ids = [x["attempt_id"] for x in rows + drops]
    assert len(ids) == len(set(ids)) == 7
    # the slice holds its target: nothing more is asked
    before = len(scripted.bodies)
    again = resume()
    assert (again.num_skipped, again.num_written, again.num_not_needed) == (7, 0, 5)
    assert len(scripted.bodies) == before
    teacher.close()


def test_the_lake_side_run_resumes_from_the_samples_it_wrote(
        factory_home: Path, serve: Any) -> None:
    """``synthesis.run`` counts the ``synthetic_samples`` rows of the experiment per slice:
    a first run filled the slice to 2, a second with a target of 4 and two attempts per
    sample writes 2 more and leaves the rest unrun (both batches of 2 whatever order the
    teacher answers them in)."""
    train = _train(_rows(200, keep_thin=3))
    scripted = ScriptedTeacher(["good", "good", "malformed", "malformed", "good", "good"])
    teacher = synthesis.Teacher(base_url=serve(scripted), model="scripted")
    lake = Lake()

    def run(max_per_slice: int, attempts_per_sample: float) -> synthesis.Outcome:
        session = lake.session(run_id="r", asset_key="synthetic_samples")
        out, _ = synthesis.run(session, "triage", train, teacher, known_ids=[],
                               max_per_slice=max_per_slice, seed=0, samples_snapshot_id=None,
                               attempts_per_sample=attempts_per_sample)
        return out

    first = run(2, 1)
    assert (first.num_planned, first.num_written) == (2, 2)
    second = run(4, 2)
    assert (second.num_planned, second.num_skipped, second.num_written,
            second.num_not_needed) == (8, 2, 2, 2)
    made = lake.read("synthetic_samples", row_filter="experiment = 'triage'")
    assert made.num_rows == 4 and len(set(made.column("sample_id").to_pylist())) == 4
    assert sorted(made.column("attempt").to_pylist()) == [0, 1, 4, 5]
    assert lake.read("synthesis_drops").column("reason").to_pylist() == ["malformed"] * 2
    teacher.close()


def test_an_answer_the_teacher_is_unsure_of_is_a_low_confidence_drop(serve: Any) -> None:
    """With ``min_confidence`` the answer call asks for logprobs, an answer given less
    probability is dropped with it, and a kept sample records its probability; an endpoint
    that returns no logprobs gives counted drops, not samples of unknown confidence."""
    attempts = _attempts(3)
    labeler = Labeler.fit(list(ticket_triage.LABELS) * 4)

    def run(scripted: ScriptedTeacher, min_confidence: float | None
            ) -> tuple[synthesis.Outcome, list[dict[str, Any]], list[dict[str, Any]]]:
        teacher = synthesis.Teacher(base_url=serve(scripted), model="scripted",
                                    min_confidence=min_confidence)
        rows: list[dict[str, Any]] = []
        drops: list[dict[str, Any]] = []
        out = synthesis.synthesize(attempts, teacher, labeler, recorded=[], known_ids=[],
                                   write=lambda r, d: (rows.extend(r), drops.extend(d)),
                                   concurrency=1)
        teacher.close()
        return out, rows, drops

    scripted = ScriptedTeacher(["good", "unsure", "good"])
    out, rows, drops = run(scripted, 0.9)
    assert (out.num_written, out.drops) == (2, {"low_confidence": 1})
    assert [r["confidence"] for r in rows] == pytest.approx([SURE, SURE])
    assert drops[0]["step"] == "answer"
    assert drops[0]["detail"] == f"the teacher gives its answer probability {UNSURE:.3f} < 0.9"
    answers = [b for b in scripted.bodies
               if _text(b["messages"][0]["content"]) != synthesis.REQUEST_SYSTEM]
    assert len(answers) == 3 and all(b["logprobs"] is True for b in answers)

    # not asked: no logprobs requested, the unsure answer kept, confidence unknown
    scripted = ScriptedTeacher(["good", "unsure", "good"])
    out, rows, _ = run(scripted, None)
    assert (out.num_written, out.drops) == (3, {})
    assert [r["confidence"] for r in rows] == [None, None, None]
    assert not any("logprobs" in b for b in scripted.bodies)

    # asked of an endpoint that returns none
    scripted = ScriptedTeacher([])
    scripted.logprobs = False
    out, rows, drops = run(scripted, 0.5)
    assert (out.num_written, out.drops) == (0, {"no_logprobs": 3})
    assert "no logprobs" in drops[0]["detail"]


def test_an_unreachable_teacher_stops_and_records_nothing(serve: Any) -> None:
    url = serve(ScriptedTeacher([]))
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    teacher = synthesis.Teacher(base_url=f"http://127.0.0.1:{port + 1}/v1", model="x",
                                timeout_s=1.0)
    written: list[Any] = []
    with pytest.raises(synthesis.TeacherUnreachable):
        synthesis.synthesize(_attempts(2), teacher, None, recorded=[], known_ids=[],
                             write=lambda rows, drops: written.extend(rows + drops))
    assert written == []


def test_a_sample_outside_its_length_bucket_is_off_slice(serve: Any, smollm2_dir: Path) -> None:
    from factory.curation.tokens import RenderCounter

    counter = RenderCounter(smollm2_dir)
    seeds = _attempts(1)[0]
    request = "Where is my parcel? The tracking page shows nothing."
    expected = chat(request, THIN, ticket_triage.SYSTEM_PROMPT)
    bucket = length_bucket(counter.count([expected], [[]])[0][0])
    teacher = synthesis.Teacher(base_url=serve(ScriptedTeacher([])), model="scripted")

    def attempt(value: str) -> synthesis.Attempt:
        return synthesis.Attempt(experiment="triage", attempt=0, seeds=seeds.seeds,
                                 slice=replace(seeds.slice, dimension="length", value=value))

    sample = synthesis.answer_request(attempt(bucket), request, teacher, None, counter)
    assert sample["messages"] == expected
    with pytest.raises(synthesis.Drop) as drop:
        synthesis.answer_request(attempt("1024-2047"), request, teacher, None, counter)
    assert (drop.value.reason, drop.value.detail) == (
        "off_slice", f"asked for length:1024-2047, got length:{bucket}")
    teacher.close()


@pytest.mark.slow
def test_the_factory_cpu_server_as_teacher(tiny_model_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The real serving protocol: the random-init tiny model writes no <request> block (a
    malformed drop per attempt), and its answer to a request runs to the token limit (a
    truncated drop)."""
    from factory.inference.launcher import InferenceServer

    monkeypatch.setattr(synthesis, "REQUEST_MAX_TOKENS", 24)
    attempts = _attempts(2)
    with InferenceServer(tiny_model_dir, served_model_name="base",
                         log_path=tmp_path / "server.log", startup_timeout_s=240,
                         threads=1) as server:
        teacher = synthesis.Teacher(base_url=server.base_url, model="base", timeout_s=120,
                                    max_tokens=16)
        written: list[dict[str, Any]] = []
        dropped: list[dict[str, Any]] = []
        out = synthesis.synthesize(attempts, teacher, None, recorded=[], known_ids=[],
                                   write=lambda rows, drops: (written.extend(rows),
                                                              dropped.extend(drops)))
        assert (out.num_written, out.drops) == (0, {"malformed": 2})
        assert {d["step"] for d in dropped} == {"request"}
        assert all("<request> blocks" in d["detail"] for d in dropped)
        length = synthesis.Attempt(experiment="triage", attempt=0, seeds=attempts[0].seeds,
                                   slice=replace(attempts[0].slice, dimension="length",
                                                 value="64-127"))
        # greedy decoding of the seeded tiny model runs to the token limit
        with pytest.raises(synthesis.Drop) as drop:
            synthesis.answer_request(length, "Where is my parcel?", teacher, None)
        assert (drop.value.step, drop.value.reason) == ("answer", "truncated")
        # the server's chat logprobs give the answer's probability (``min_confidence``)
        reply = teacher.call("answer", [{"role": "user", "content": "Where is my parcel?"}],
                             max_tokens=4, logprobs=True)
        content = reply["choices"][0]["logprobs"]["content"]
        p = synthesis.answer_confidence(reply["choices"][0])
        assert p is not None and 0 < p <= 1
        assert p == pytest.approx(math.exp(sum(e["logprob"] for e in content)))
        teacher.close()


# -- the experiment file --------------------------------------------------------------------


def test_synthesize_is_validated_with_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    ok = parse_experiment("name: x\nrecipe: smollm2-135m-lora\ndata:\n  synthesize:\n"
                          "    teacher: gpt-4o\n    max_per_slice: 5\n", path)
    assert ok.data.synthesize is not None and ok.data.synthesize.max_per_slice == 5
    assert ok.data.synthesize.min_confidence is None
    sure = parse_experiment("name: x\nrecipe: smollm2-135m-lora\ndata:\n  synthesize:\n"
                            "    teacher: gpt-4o\n    min_confidence: 0.9\n", path)
    assert sure.data.synthesize is not None and sure.data.synthesize.min_confidence == 0.9
    assert sure.data.synthesize.attempts_per_sample == 1
    more = parse_experiment("name: x\nrecipe: smollm2-135m-lora\ndata:\n  synthesize:\n"
                            "    teacher: gpt-4o\n    attempts_per_sample: 2.5\n", path)
    assert more.data.synthesize is not None and more.data.synthesize.attempts_per_sample == 2.5
    for body, where in (
            ("    teacher: ''\n", "5: data.synthesize.teacher"),
            ("    teacher: t\n    max_per_slice: 0\n", "6: data.synthesize.max_per_slice"),
            ("    teacher: t\n    base_url: ftp://x\n", "6: data.synthesize.base_url"),
            ("    teacher: t\n    min_confidence: 1.5\n", "6: data.synthesize.min_confidence"),
            ("    teacher: t\n    attempts_per_sample: 0.5\n",
             "6: data.synthesize.attempts_per_sample: got 0.5; allowed: a number >= 1"),
            ("    teacher: t\n    attempts_per_sample: yes\n",
             "6: data.synthesize.attempts_per_sample"),
            ("    teacher: t\n    attempts_per_sample: .inf\n",
             "6: data.synthesize.attempts_per_sample"),
            ("    teacher: t\n    timeot_s: 3\n", "6: data.synthesize.timeot_s: unknown key "
                                                "'timeot_s'; did you mean 'timeout_s'?")):
        with pytest.raises(ExperimentError) as err:
            parse_experiment("name: x\nrecipe: smollm2-135m-lora\ndata:\n  synthesize:\n"
                             + body, path)
        assert f"{path}:{where}" in str(err.value)


# -- curation of synthetic rows ------------------------------------------------------------


def _synthetic_row(user: str, answer: str, system: str) -> dict[str, Any]:
    messages = chat(user, answer, system)
    return {"sample_id": sample_id(messages, []), "raw_trace_id": None, "source": "synthetic",
            "provider": "openai", "model": "teacher", "messages": canonical_json(messages),
            "tools": "[]", "num_turns": 1, "has_images": False, "has_tool_calls": False,
            "created_at": None, "project": "triage", "tags": [("project", "triage")],
            "origin": "synthetic"}


def test_synthetic_rows_never_enter_eval_nor_carry_an_eval_sample_into_train(
        smollm2_dir: Path) -> None:
    from factory.curation.config import CurationConfig
    from factory.curation.pipeline import curate
    from factory.curation.tokens import RenderCounter

    config, counter = CurationConfig(max_tokens=1024), RenderCounter(smollm2_dir)
    traffic = pa.Table.from_pylist(_rows(200, keep_thin=40), schema=TABLES["samples"])
    alone = curate(traffic, config, counter)
    system = ticket_triage.SYSTEM_PROMPT
    ev = [_user_and_answer(m) for m in alone.eval.column("messages").to_pylist()]
    tr = [_user_and_answer(m) for m in alone.train.column("messages").to_pylist()]
    # the last word changed to "thanks": one 3-word shingle of 30+ differs (Jaccard >= 0.88);
    # a ticket that already ends in "thanks" would stay the same prompt
    def long(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(u, a) for u, a in pairs
                if len(u.split()) >= 30 and u.split()[-1].strip(".!,").lower() != "thanks"]

    long_ev, long_tr = long(ev), long(tr)
    reworded = long_ev[0][0].rsplit(" ", 1)[0] + " thanks"
    planted = {
        "copy of an eval sample": _synthetic_row(*ev[0], system),
        "eval prompt, other answer": _synthetic_row(ev[2][0], "feature_request"
                                                    if ev[2][1] != "feature_request"
                                                    else "bug", system),
        "eval sample reworded": _synthetic_row(reworded, long_ev[0][1], system),
        "near-duplicate of a train sample": _synthetic_row(
            long_tr[0][0].rsplit(" ", 1)[0] + " thanks", long_tr[0][1], system),
        "new": _synthetic_row("My parcel never came and the tracking number gives an error.",
                              THIN, system),
    }
    rows = traffic.append_column("origin", pa.array(["traffic"] * traffic.num_rows))
    both = curate(pa.concat_tables([rows, pa.Table.from_pylist(list(planted.values()),
                                                               schema=rows.schema)]),
                  config, counter)
    # the eval set is the traffic's, row for row; the train set gains the new sample alone
    assert both.eval.equals(alone.eval)
    assert set(both.train.column("sample_id").to_pylist()) == \
        set(alone.train.column("sample_id").to_pylist()) | {planted["new"]["sample_id"]}
    reasons = {d["sample_id"]: (d["reason"], d["split"]) for d in both.drops
               if d["origin"] == "synthetic"}
    assert reasons == {
        planted["copy of an eval sample"]["sample_id"]: ("duplicate", "eval"),
        planted["eval prompt, other answer"]["sample_id"]: ("eval_prompt_match", "train"),
        planted["eval sample reworded"]["sample_id"]: ("eval_near_duplicate", "train"),
        planted["near-duplicate of a train sample"]["sample_id"]: ("near_duplicate", "train"),
    }
    assert both.profile["num_synthetic"] == 1
    assert "1 kept" in both.report and "## Synthetic samples" in both.report


# -- the assets: synthesis, curation with the traffic, the profile -------------------------


def _user_and_answer(messages: str) -> tuple[str, str]:
    msgs = json.loads(messages)
    return msgs[1]["content"][0]["text"], msgs[-1]["content"][0]["text"]


def _materialize(key: str) -> Any:
    from factory.assets.curation import dataset, dataset_profile, synthetic_samples
    from factory.resources.judge import EmbeddedJudgeResource
    from factory.resources.lake import LakeResource

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", [key])
    return dg.materialize([synthetic_samples, dataset, dataset_profile], instance=instance,
                          partition_key=key, resources={"lake": LakeResource(),
                                                        "judge": EmbeddedJudgeResource()})


def test_synthetic_samples_fill_the_thin_slice_on_the_train_side_only(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, serve: Any,
        smollm2_dir: Path) -> None:
    from factory.curation.config import CurationConfig
    from factory.curation.pipeline import curate
    from factory.curation.tokens import RenderCounter

    rows = _rows(240, keep_thin=6)
    traffic = curate(pa.Table.from_pylist(rows, schema=TABLES["samples"]),
                     CurationConfig(max_tokens=1024), RenderCounter(smollm2_dir))
    # an eval ticket of another label, asked again (same prompt) and pasted into a longer one
    ev = next(user for user, answer in map(_user_and_answer,
                                           traffic.eval.column("messages").to_pylist())
              if answer != THIN and len(user.split()) >= 20)
    scripted = ScriptedTeacher([f"copy:{ev}", f"copy:{ev} I wrote to you about this before, "
                                              "please reply soon."])
    exps = factory_home / "experiments"
    exps.mkdir()
    (exps / "triage.yaml").write_text(
        "name: triage\nrecipe: smollm2-135m-lora\n"
        "data:\n  where: \"tags['project'] = 'triage'\"\n  max_tokens: 1024\n"
        f"  synthesize: {{teacher: scripted, base_url: '{serve(scripted)}', max_per_slice: 10,"
        " timeout_s: 5}\n")
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(exps))
    Lake().append("samples", rows)

    result = _materialize("triage")
    assert result.success
    lake = Lake()
    flt = "experiment = 'triage'"
    made = lake.read("synthetic_samples", row_filter=flt)
    assert made.num_rows == 10 and set(made.column("slice").to_pylist()) == {f"label:{THIN}"}
    train = lake.read("dataset_train", row_filter=flt)
    evals = lake.read("dataset_eval", row_filter=flt)
    # seeds are train samples only, and the eval set holds no synthetic sample
    traffic_train = {s for s, o in zip(train.column("sample_id").to_pylist(),
                                       train.column("origin").to_pylist(), strict=True)
                     if o == "traffic"}
    assert {s for ids in made.column("seed_sample_ids").to_pylist() for s in ids} \
        <= traffic_train
    assert set(evals.column("origin").to_pylist()) == {"traffic"}
    assert evals.column("sample_id").to_pylist() == traffic.eval.column("sample_id").to_pylist()
    # the copies of the eval ticket are decontaminated; the other eight are kept
    drops = [d for d in lake.read("dataset_drops", row_filter=flt).to_pylist()
             if d["origin"] == "synthetic"]
    assert sorted(d["reason"] for d in drops) == ["eval_ngram_overlap", "eval_prompt_match"]
    synthetic = [o for o in train.column("origin").to_pylist() if o == "synthetic"]
    assert len(synthetic) == 8
    profile = lake.read("dataset_profile", row_filter=flt).to_pylist()[0]
    assert profile["num_synthetic"] == 8
    assert profile["share_synthetic"] == round(8 / train.num_rows, 6)
    thin = [s for s in json.loads(profile["slices"]) if s["thin"]]
    assert [(s["value"], s["num_synthetic"]) for s in thin] == [(THIN, 8)]
    report = result.asset_materializations_for_node("dataset")[0].metadata["report"].value
    assert "## Synthetic samples" in report and "eval_prompt_match" in report
    # a second run resumes: every attempt is recorded, nothing is asked or written twice
    calls = scripted.num_calls
    again = _materialize("triage")
    assert again.success and scripted.num_calls == calls
    meta = again.asset_materializations_for_node("synthetic_samples")[0].metadata
    assert (meta["num_resumed"].value, meta["num_written"].value) == (10, 0)
    assert meta["num_not_needed"].value == 0
    made = lake.read("synthetic_samples", row_filter=flt)
    assert made.num_rows == 10 and len(set(made.column("attempt_id").to_pylist())) == 10


def test_an_attempt_written_twice_is_read_once(factory_home: Path) -> None:
    attempt = _attempts(1)[0]
    teacher = synthesis.Teacher(base_url="http://127.0.0.1:9/v1", model="t")
    messages = chat("Where is my parcel?", THIN, ticket_triage.SYSTEM_PROMPT)
    sample = {"sample_id": sample_id(messages, []), "provider": "openai",
              "messages_json": canonical_json(messages), "tools_json": "[]", "num_turns": 1,
              "has_images": False, "has_tool_calls": False, "prompt": []}
    lake = Lake()
    row = synthesis.sample_row(attempt, sample, teacher, None)
    lake.append("synthetic_samples", [row])
    lake.append("synthetic_samples", [row])  # a second run of the experiment at once
    session = lake.session(run_id="r", asset_key="dataset")
    read = synthesis.read_synthetic(session, "triage")
    assert read.column("sample_id").to_pylist() == [sample["sample_id"]]
    assert read.column("origin").to_pylist() == ["synthetic"]
    assert session.lineage.reads["synthetic_samples"] == lake.snapshot_id("synthetic_samples")
    # and counted once toward its slice's target
    assert synthesis.recorded_attempts(session, "triage") == (
        {attempt.attempt_id}, {sample["sample_id"]}, {f"label:{THIN}": 1})
    teacher.close()


def test_a_teacher_behind_the_gateway_gets_the_key_and_its_calls_stay_out_of_curation(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.experiments import SynthesizeSpec
    from factory.gateway import Gateway, GatewayConfig, ServerThread
    from factory.gateway.standin import StandIn

    captured: list[Any] = []
    standin = StandIn()
    with ServerThread(standin) as upstream, ServerThread(Gateway(
            GatewayConfig(port=0, openai_base_url=upstream.url + "/v1",
                          flush_interval_s=0.05, segment_max_age_s=0.05),
            lake_factory=lambda: None,
            ingest=lambda lake, records, new_ids: captured.extend(records))) as gateway:
        monkeypatch.setenv("FACTORY_GATEWAY_URL", gateway.url)
        monkeypatch.setenv("TEAM_KEY", "sk-team")
        teacher = synthesis.teacher_for(
            SynthesizeSpec(teacher="gpt-4o-mini", api_key_env="TEAM_KEY"), "triage")
        assert teacher.base_url == gateway.url + "/v1"
        dropped: list[dict[str, Any]] = []
        synthesis.synthesize(_attempts(1), teacher, None, recorded=[], known_ids=[],
                             write=lambda rows, drops: dropped.extend(drops))
        teacher.close()
    # the stand-in echoes the prompt, whose examples are three <request> blocks
    assert [(d["reason"], d["detail"][:20]) for d in dropped] == [
        ("malformed", "3 <request> blocks i")]
    assert standin.seen_auth["authorization"] == "Bearer sk-team"
    # the gateway captured the call (flushed when it stopped), tagged as a teacher call
    assert [r.tags for r in captured] == [{synthesis.TEACHER_TAG: "triage"}]
    tagged = {**_rows(1, keep_thin=0)[0], "sample_id": "teacher-call",
              "tags": [(synthesis.TEACHER_TAG, "triage")]}
    table = pa.Table.from_pylist([_rows(2, keep_thin=0)[1], tagged], schema=TABLES["samples"])
    assert synthesis.without_teacher_calls(table).column("sample_id").to_pylist() == \
        [table.column("sample_id")[0].as_py()]


def test_the_default_judge_threshold_of_synthetic_samples() -> None:
    from factory.evals.rubric import Criterion, Rubric
    from factory.evals.shadow import FREE_TEXT_PASS

    label = Criterion(name="label_match", description="the label", check="label_match",
                      weight=1.0, params={"labels": list(ticket_triage.LABELS)})
    llm = Criterion(name="helpful", description="helps", check="llm", weight=1.0, params={})
    assert synthesis.default_judge_threshold(Rubric(criteria=(label,))) == 1.0
    assert synthesis.default_judge_threshold(Rubric(criteria=(label, llm))) == FREE_TEXT_PASS


class _TicketJudge:
    """A local judge: a ticket that names a parcel passes (1.0); any other fails (0.0).
    Records which samples it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def score(self, sample: dict[str, Any]) -> float:
        self.asked.append(sample["sample_id"])
        user = sample["messages"][1]["content"][0]["text"]
        return 1.0 if "parcel" in user else 0.0


def test_the_judge_rejects_synthetic_samples_below_their_bar_and_leaves_traffic_alone(
        smollm2_dir: Path) -> None:
    from factory.curation.config import CurationConfig
    from factory.curation.pipeline import curate
    from factory.curation.tokens import RenderCounter

    traffic = pa.Table.from_pylist(_rows(120, keep_thin=4), schema=TABLES["samples"])
    system = ticket_triage.SYSTEM_PROMPT
    good = _synthetic_row("My parcel never came and the tracking number gives an error.",
                          THIN, system)
    poor = _synthetic_row("Good morning, My order is a full cancellation due to the order.",
                          THIN, system)
    rows = traffic.append_column("origin", pa.array(["traffic"] * traffic.num_rows))
    table = pa.concat_tables([rows, pa.Table.from_pylist([good, poor], schema=rows.schema)])
    judge = _TicketJudge()
    config = CurationConfig(max_tokens=1024, synthetic_judge_threshold=1.0)
    result = curate(table, config, RenderCounter(smollm2_dir), judge=judge)
    # Only the synthetic samples are judged (no data.judge_threshold for the traffic).
    assert sorted(judge.asked) == sorted([good["sample_id"], poor["sample_id"]])
    drops = [(d["sample_id"], d["reason"]) for d in result.drops if d["origin"] == "synthetic"]
    assert drops == [(poor["sample_id"], "judge_below_threshold")]
    train = set(result.train.column("sample_id").to_pylist())
    assert good["sample_id"] in train and poor["sample_id"] not in train
    assert result.profile["num_synthetic"] == 1
