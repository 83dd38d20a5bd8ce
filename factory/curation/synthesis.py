"""Synthesis: a teacher model writes new train samples for an experiment's thin slices.

For each thin slice (``factory.curation.slices``) synthesis fills the slice toward its even
share: its *target* is the samples it lacks, at most ``max_per_slice``, and it plans
``attempts_per_sample`` attempts per sample of the target (rounded up), since many attempts
give no sample. The attempts of a slice run in index order and the slice stops once it holds
its target (samples written by earlier runs count): a batch takes, per slice, no more attempts
than the slice still needs, so it never overshoots, and the attempts left unrun are not
recorded (a later run with a higher target runs them). Attempt ``i`` of a slice shows the teacher
``NUM_SEEDS`` train samples of the slice (never eval ones): the ``i``-th of the slice in a
stable hash order, then others picked by a hash of the attempt, so every sample leads some
attempt and no two attempts need see the same seeds. It takes two calls:

1. *request*: the teacher writes one new user request like the seeds' (``request_prompt``),
   between ``<request>`` tags, sampled (``REQUEST_TEMPERATURE``, seeded by the attempt id);
2. *answer*: the teacher answers that request as an ordinary chat call, with the seeds' system
   prompt and tools, so the answer's format is the one the traffic has.

The two turns (system, request, answer) normalize like any logged OpenAI call into a canonical
sample. An attempt gives a sample or exactly one drop with its reason: ``timeout``,
``teacher_error`` (the endpoint answered an HTTP error), ``malformed`` (no tagged request, an
empty or unparseable answer), ``refusal`` (``detectors.refusal``), ``truncated`` (the answer
stopped at its token limit), ``off_slice`` (a sample outside the slice it was asked for:
another tool or label, or, with a token counter, another length bucket), ``low_confidence``
(with ``min_confidence``: the teacher gives its own answer less probability than that;
``no_logprobs`` when the endpoint returns none to tell) or ``duplicate`` (a sample id the
experiment already has). An unreachable endpoint stops synthesis instead
(nothing recorded for the attempt), so a teacher that is down never uses up attempts.

Attempt ids hash (experiment, slice, attempt index); each is recorded once, as a sample or a
drop, so a resumed synthesis skips recorded attempts, writes no duplicate and continues up to
the target. Synthetic samples
then go through curation with the traffic (``factory.curation.pipeline.curate``): train side
only, decontaminated against the eval set, judged by rejection sampling.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.compute as pc

from factory.curation import detectors
from factory.curation.decide import SYNTHETIC
from factory.curation.slices import (
    Labeler,
    Slice,
    fit_labeler,
    length_bucket,
    membership,
    origins,
    profile_slices,
    sample_slices,
)
from factory.curation.store import experiment_filter
from factory.curation.text import message_text, parse_json
from factory.curation.tokens import TokenCounter
from factory.errors import FactoryError
from factory.evals.rubric import Rubric
from factory.evals.shadow import FREE_TEXT_PASS
from factory.gateway.keys import gateway_api_url, headers_for
from factory.inference.client import InferenceClient, InferenceClientError
from factory.lake import LakeSession
from factory.normalize.canon import NormalizeError
from factory.normalize.openai import normalize_call
from factory.normalize.request import wire_messages, wire_tools
from factory.settings import Settings, get_settings
from factory.tables import TABLES

NUM_SEEDS = 3
"""Train samples shown per attempt: enough to show the slice's range, few enough that the
teacher writes a new request rather than a blend of many."""

MAX_REQUEST_CHARS = 8000
"""A written request longer than this is malformed (the teacher ran on)."""

REQUEST_MAX_TOKENS = 1024
"""Token limit of the request call."""

REQUEST_TEMPERATURE = 1.0
"""Requests are sampled: greedy decoding writes the same request for the same seeds, and a
slice with fewer than ``NUM_SEEDS`` + 1 samples has one set of seeds. The seed sent with the
call (from the attempt id) makes a rerun ask for the same draw on servers that honour it
(vLLM, the factory's CPU server). Answers stay greedy: the teacher's best answer."""

BATCH = 16
"""Attempts per write: a crash loses at most this many attempts' calls."""

_REQUEST_RE = re.compile(r"<request>(.*?)</request>", re.DOTALL)

REQUEST_SYSTEM = (
    "You write new requests for a dataset that trains an assistant. You are shown example "
    "requests that users sent to that assistant. Write one new request a real user could send: "
    "the same kind of request in the same language and register, with different details, "
    "never a copy or light rewording of an example. Reply with the request only, between "
    "<request> and </request>.")


TEACHER_TAG = "factory-synthesis"
"""Tag (``X-Factory-Tags``) of every teacher call: where the teacher is behind the gateway,
its captures carry ``factory-synthesis=<experiment>``, and curation leaves them out
(``without_teacher_calls``): a request-writing call is no user's traffic."""


def without_teacher_calls(samples: pa.Table) -> pa.Table:
    """``samples`` rows other than the gateway's captures of teacher calls (``TEACHER_TAG``)."""
    if not samples.num_rows:
        return samples
    found = pc.map_lookup(samples.column("tags"), pa.scalar(TEACHER_TAG), "first")
    return samples.filter(pc.is_null(found))


def default_judge_threshold(rubric: Rubric) -> float:
    """The rejection-sampling score synthetic samples need when the experiment names none:
    1.0 when code checks every criterion (the answer meets each), else ``FREE_TEXT_PASS``, the
    pass mark of free-text answers (an LLM judge's 1-10 marks of a good answer are rarely all
    10)."""
    return 1.0 if all(c.check != "llm" for c in rubric.criteria) else FREE_TEXT_PASS


class TeacherUnreachable(FactoryError):
    """The teacher endpoint could not be reached at all."""


class Drop(Exception):
    """Why an attempt gave no sample: the ``step`` (``request`` or ``answer``), the
    ``reason`` and a ``detail``."""

    def __init__(self, *, step: str, reason: str, detail: str) -> None:
        super().__init__(f"{step}: {reason}: {detail}")
        self.step, self.reason, self.detail = step, reason, detail


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One planned teacher attempt for one slice."""

    experiment: str
    slice: Slice
    attempt: int
    """Index within the slice, from 0."""
    seeds: tuple[dict[str, Any], ...]
    """Train rows (``sample_id``, ``messages``, ``tools``, ``project``, ``tags``) shown."""
    target: int | None = None
    """Samples the slice is filled to (``synthesize`` runs no attempt of a slice that holds
    them); None: no target, the attempt runs."""

    @property
    def attempt_id(self) -> str:
        return attempt_id(self.experiment, self.slice.key, self.attempt)

    @property
    def seed_ids(self) -> list[str]:
        return [str(s["sample_id"]) for s in self.seeds]


def attempt_id(experiment: str, slice_key: str, attempt: int) -> str:
    """Stable id of an attempt: a resumed synthesis finds it recorded and skips it."""
    key = json.dumps([experiment, slice_key, attempt], separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _rank(seed: int, slice_key: str, sample_id: str) -> str:
    return hashlib.sha256(f"{seed}:{slice_key}:{sample_id}".encode()).hexdigest()


def plan_attempts(experiment: str, slices: Sequence[Slice], members: dict[str, list[dict[str, Any]]],
                  *, max_per_slice: int, seed: int = 0,
                  attempts_per_sample: float = 1.0) -> list[Attempt]:
    """Attempts for every thin slice, in index order: its target (the samples it lacks of its
    even share, at most ``max_per_slice``) times ``attempts_per_sample``, rounded up.

    ``members``: slice key -> the traffic train rows in it (the seed pool).
    """
    if attempts_per_sample < 1:
        raise ValueError(f"attempts_per_sample: got {attempts_per_sample}; allowed: >= 1")
    out = []
    for s in slices:
        pool = sorted(members.get(s.key, []), key=lambda r: _rank(seed, s.key, r["sample_id"]))
        if not s.thin or not pool:
            continue
        target = min(max_per_slice, max(0, s.even - s.num_traffic))
        # rounded to 9 places first: 10 * 1.1 is 11.000000000000002 in floats, not 12 attempts
        num = math.ceil(round(target * attempts_per_sample, 9))
        for i in range(num):
            first = pool[i % len(pool)]
            rest = heapq.nsmallest(NUM_SEEDS - 1, (r for r in pool if r is not first),
                                   key=lambda r: _rank(seed, f"{s.key}#{i}", r["sample_id"]))
            out.append(Attempt(experiment=experiment, slice=s, attempt=i,
                               seeds=(first, *rest), target=target))
    return out


def _user_text(messages: list[dict[str, Any]]) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    return message_text(users[-1]).strip() if users else ""


def _system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages[:1] if m.get("role") == "system"]


def describe(s: Slice, tools: list[dict[str, Any]]) -> str:
    """What the seeds of slice ``s`` have in common, in words for the teacher."""
    if s.dimension == "tool":
        desc = next((t.get("description") for t in tools if t.get("name") == s.value), "")
        return (f"Each example is a request the assistant handles by calling its tool "
                f"`{s.value}`" + (f" ({desc})" if desc else "") + "; so must yours.")
    if s.dimension == "label":
        label = s.value.split("=", 1)[-1]
        return (f"Each example is a request whose correct answer is `{label}`; yours must be "
                "one too.")
    return f"Each example's whole conversation is {s.value} tokens long; yours should be too."


def request_prompt(attempt: Attempt) -> list[dict[str, Any]]:
    """The messages asking the teacher for a new request (sent as plain OpenAI messages)."""
    first = parse_json(attempt.seeds[0]["messages"])
    tools = parse_json(attempt.seeds[0]["tools"]) or []
    system = "\n".join(message_text(m) for m in _system(first)).strip()
    lines = []
    if system:
        lines += ["The assistant's instructions:", "<instructions>", system, "</instructions>", ""]
    lines += [describe(attempt.slice, tools), ""]
    for i, row in enumerate(attempt.seeds, 1):
        lines += [f"Example {i}:", "<request>", _user_text(parse_json(row["messages"])),
                  "</request>", ""]
    lines.append("Write one new request.")
    return [{"role": "system", "content": REQUEST_SYSTEM},
            {"role": "user", "content": "\n".join(lines)}]


def parse_request(text: str) -> str:
    """The request between the tags; ``Drop`` (malformed) when there is none or it is unusable."""
    found = _REQUEST_RE.findall(text or "")
    if len(found) != 1:
        raise Drop(step="request", reason="malformed",
                   detail=f"{len(found)} <request> blocks in the reply (one expected): "
                          f"{(text or '')[:80]!r}")
    request = found[0].strip()
    if not request:
        raise Drop(step="request", reason="malformed", detail="empty <request> block")
    if len(request) > MAX_REQUEST_CHARS:
        raise Drop(step="request", reason="malformed",
                   detail=f"request of {len(request)} characters > {MAX_REQUEST_CHARS}")
    return request


class Teacher:
    """An OpenAI-compatible endpoint that writes requests and answers them."""

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 60.0, max_tokens: int = 512, experiment: str = "",
                 min_confidence: float | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        """``headers``: sent with every call besides the tag (the factory key of a teacher
        behind the gateway, ``teacher_for``)."""
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.min_confidence = min_confidence
        """Least probability of its own answer the teacher must give (None: not asked)."""
        self.client = InferenceClient(base_url, api_key=api_key, timeout_s=timeout_s)
        self.client.http.headers.update(headers or {})
        self.client.http.headers["X-Factory-Tags"] = f"{TEACHER_TAG}={experiment}"

    def close(self) -> None:
        self.client.close()

    def call(self, step: str, messages: list[dict[str, Any]], *,
             tools: list[dict[str, Any]] | None = None, max_tokens: int,
             **sampling: Any) -> dict[str, Any]:
        """One chat completion (greedy unless ``sampling`` says otherwise); ``Drop`` for a
        timeout or an HTTP error, ``TeacherUnreachable`` when nothing answers."""
        try:
            return self.client.chat(self.model, messages, tools=tools, max_tokens=max_tokens,
                                    **sampling)
        except httpx.ConnectTimeout as exc:
            raise TeacherUnreachable(f"teacher {self.model} at {self.base_url}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise Drop(step=step, reason="timeout",
                       detail=f"no answer within {self.client.http.timeout.read}s "
                              f"({type(exc).__name__})") from None
        except httpx.TransportError as exc:  # refused, reset, DNS: nothing to record
            raise TeacherUnreachable(f"teacher {self.model} at {self.base_url}: {exc}") from exc
        except InferenceClientError as exc:
            raise Drop(step=step, reason="teacher_error", detail=str(exc)[:300]) from None
        except ValueError as exc:  # a body that is not JSON
            raise Drop(step=step, reason="malformed", detail=f"not JSON: {exc}"[:300]) from None


def answer_confidence(choice: dict[str, Any]) -> float | None:
    """The probability the teacher gave its answer: the product of its generated tokens'
    probabilities (OpenAI's chat ``logprobs.content``), None when the choice has none."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or not content:
        return None
    values = [e.get("logprob") if isinstance(e, dict) else None for e in content]
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    return math.exp(sum(numbers)) if len(numbers) == len(content) else None


def _first_choice(step: str, response: Any) -> dict[str, Any]:
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
            or not isinstance(choices[0].get("message"), dict):
        raise Drop(step=step, reason="malformed", detail="the response has no choices[0].message")
    return choices[0]


def write_request(attempt: Attempt, teacher: Teacher) -> tuple[list[dict[str, Any]], str]:
    """Step 1: (the prompt sent, the new request the teacher wrote); ``Drop`` when none."""
    prompt = request_prompt(attempt)
    reply = teacher.call("request", prompt, max_tokens=REQUEST_MAX_TOKENS,
                         temperature=REQUEST_TEMPERATURE, seed=int(attempt.attempt_id[:8], 16))
    choice = _first_choice("request", reply)
    text = choice["message"].get("content")
    if not isinstance(text, str):
        raise Drop(step="request", reason="malformed", detail="no text in the reply")
    flag = detectors.refusal([{"role": "assistant", "content": [{"type": "text", "text": text}]}])
    if flag:
        raise Drop(step="request", reason="refusal", detail=flag)
    return prompt, parse_request(text)


def answer_request(attempt: Attempt, request: str, teacher: Teacher, labeler: Labeler | None,
                   counter: TokenCounter | None = None) -> dict[str, Any]:
    """Step 2: the canonical sample (``factory.normalize.canon.finish``'s dict) of the teacher's
    answer to ``request`` under the seeds' system prompt and tools; ``Drop`` when it gives
    none. ``counter`` places a length slice's sample in its bucket (unchecked without one)."""
    seed = parse_json(attempt.seeds[0]["messages"])
    tools = parse_json(attempt.seeds[0]["tools"]) or []
    conversation = [*_system(seed), {"role": "user", "content": [{"type": "text",
                                                                   "text": request}]}]
    asks = {"logprobs": True} if teacher.min_confidence is not None else {}
    response = teacher.call("answer", conversation, tools=tools or None,
                            max_tokens=teacher.max_tokens, **asks)
    choice = _first_choice("answer", response)
    if choice.get("finish_reason") == "length":
        raise Drop(step="answer", reason="truncated",
                   detail=f"the answer stopped at the {teacher.max_tokens}-token limit")
    body: dict[str, Any] = {"model": teacher.model, "messages": wire_messages(conversation)}
    if tools:
        body["tools"] = wire_tools(tools)
    try:
        sample = normalize_call(body, response, None)[0]
    except NormalizeError as exc:
        raise Drop(step="answer", reason="malformed", detail=str(exc)[:300]) from None
    last = sample["messages"][-1]
    if not last.get("tool_calls") and not message_text(last, with_reasoning=False).strip():
        raise Drop(step="answer", reason="malformed", detail="empty answer")
    flag = detectors.refusal(sample["messages"])
    if flag:
        raise Drop(step="answer", reason="refusal", detail=flag)
    if attempt.slice.dimension in ("tool", "label"):
        got = sample_slices(sample["messages"], None, labeler)
        if attempt.slice.key not in got:
            raise Drop(step="answer", reason="off_slice",
                       detail=f"asked for {attempt.slice.key}, got {', '.join(got) or 'none'}")
    if attempt.slice.dimension == "length" and counter is not None:
        count = counter.count([sample["messages"]], [sample["tools"]])[0]
        bucket = length_bucket(count[0]) if count is not None else "none (not renderable)"
        if bucket != attempt.slice.value:
            raise Drop(step="answer", reason="off_slice",
                       detail=f"asked for {attempt.slice.key}, got length:{bucket}")
    sample["confidence"] = answer_confidence(choice)
    if teacher.min_confidence is not None:
        if sample["confidence"] is None:
            raise Drop(step="answer", reason="no_logprobs",
                       detail="min_confidence is set but the teacher's response has no "
                              "logprobs for its answer")
        if sample["confidence"] < teacher.min_confidence:
            raise Drop(step="answer", reason="low_confidence",
                       detail=f"the teacher gives its answer probability "
                              f"{sample['confidence']:.3f} < {teacher.min_confidence}")
    return sample


def synthesize_one(attempt: Attempt, teacher: Teacher, labeler: Labeler | None,
                   counter: TokenCounter | None = None) -> dict[str, Any]:
    """The canonical sample of one attempt, with the ``prompt`` that asked for its request;
    ``Drop`` when it gives none."""
    prompt, request = write_request(attempt, teacher)
    sample = answer_request(attempt, request, teacher, labeler, counter)
    sample["prompt"] = prompt
    return sample


@dataclass(kw_only=True)
class Outcome:
    """What one synthesis run did."""

    num_planned: int = 0
    num_skipped: int = 0
    """Attempts already recorded by an earlier run (resumed)."""
    num_written: int = 0
    num_not_needed: int = 0
    """Attempts left unrun because their slice held its target (not recorded)."""
    drops: dict[str, int] = field(default_factory=dict)
    """Reason -> attempts of this run dropped."""
    by_slice: dict[str, int] = field(default_factory=dict)
    """Slice -> samples this run wrote."""


def sample_row(attempt: Attempt, sample: dict[str, Any], teacher: Teacher,
               samples_snapshot_id: int | None) -> dict[str, Any]:
    """A ``synthetic_samples`` row."""
    seed = attempt.seeds[0]
    tags = dict(seed.get("tags") or [])
    return {
        "experiment": attempt.experiment, "attempt_id": attempt.attempt_id,
        "sample_id": sample["sample_id"], "raw_trace_id": None, "source": SYNTHETIC,
        "provider": sample["provider"], "model": teacher.model,
        "messages": sample["messages_json"], "tools": sample["tools_json"],
        "num_turns": sample["num_turns"], "has_images": sample["has_images"],
        "has_tool_calls": sample["has_tool_calls"], "created_at": datetime.now(UTC),
        "project": seed.get("project"), "tags": list(tags.items()),
        "slice": attempt.slice.key, "attempt": attempt.attempt, "teacher": teacher.model,
        "teacher_base_url": teacher.base_url,
        "prompt": json.dumps(sample["prompt"], ensure_ascii=False),
        "seed_sample_ids": attempt.seed_ids, "samples_snapshot_id": samples_snapshot_id,
        "confidence": sample.get("confidence"),
    }


def drop_row(attempt: Attempt, drop: Drop, teacher: Teacher) -> dict[str, Any]:
    """A ``synthesis_drops`` row."""
    return {"experiment": attempt.experiment, "attempt_id": attempt.attempt_id,
            "slice": attempt.slice.key, "attempt": attempt.attempt, "teacher": teacher.model,
            "seed_sample_ids": attempt.seed_ids, "step": drop.step, "reason": drop.reason,
            "detail": drop.detail, "created_at": datetime.now(UTC)}


def synthesize(attempts: Sequence[Attempt], teacher: Teacher, labeler: Labeler | None, *,
               recorded: Iterable[str], known_ids: Iterable[str],
               write: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None],
               samples_snapshot_id: int | None = None, concurrency: int = 4,
               counter: TokenCounter | None = None,
               written_before: Mapping[str, int] | None = None) -> Outcome:
    """Run the attempts not in ``recorded`` (attempt ids), in order, ``BATCH`` at a time, each
    batch's sample and drop rows handed to ``write`` before the next starts. A batch takes no
    more of a slice's attempts than the slice lacks of its ``Attempt.target``; the attempts of
    a slice that holds it are left unrun (``Outcome.num_not_needed``). ``written_before``:
    slice key -> samples earlier runs wrote, counted toward the target. ``known_ids``: sample
    ids the experiment already has (traffic and synthetic); a sample among them is a
    duplicate."""
    done = set(recorded)
    seen = set(known_ids)
    todo = [a for a in attempts if a.attempt_id not in done]
    out = Outcome(num_planned=len(attempts), num_skipped=len(attempts) - len(todo))
    queues: dict[str, deque[Attempt]] = {}
    for a in todo:
        queues.setdefault(a.slice.key, deque()).append(a)
    before = written_before or {}
    need = {key: len(q) if q[0].target is None else max(0, q[0].target - before.get(key, 0))
            for key, q in queues.items()}

    def run(a: Attempt) -> dict[str, Any] | Drop:
        try:
            return synthesize_one(a, teacher, labeler, counter)
        except Drop as d:
            return d

    def next_batch() -> list[Attempt]:
        batch: list[Attempt] = []
        for key, queue in queues.items():
            for _ in range(min(len(queue), need[key], BATCH - len(batch))):
                batch.append(queue.popleft())
        return batch

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        while batch := next_batch():
            rows, drops = [], []
            for a, result in zip(batch, pool.map(run, batch), strict=True):
                if isinstance(result, dict) and result["sample_id"] in seen:
                    result = Drop(step="answer", reason="duplicate",
                                  detail=f"sample {result['sample_id']} is already in the "
                                         "experiment's samples")
                if isinstance(result, Drop):
                    drops.append(drop_row(a, result, teacher))
                    out.drops[result.reason] = out.drops.get(result.reason, 0) + 1
                    continue
                seen.add(result["sample_id"])
                rows.append(sample_row(a, result, teacher, samples_snapshot_id))
                out.by_slice[a.slice.key] = out.by_slice.get(a.slice.key, 0) + 1
                need[a.slice.key] -= 1
            write(rows, drops)
            out.num_written += len(rows)
    out.num_not_needed = sum(len(q) for q in queues.values())
    out.drops = dict(sorted(out.drops.items()))
    out.by_slice = dict(sorted(out.by_slice.items()))
    return out


# -- the lake side: what an experiment already has, one synthesis run -------------------------

def teacher_for(spec: Any, experiment: str, settings: Settings | None = None) -> Teacher:
    """The ``Teacher`` of ``data.synthesize`` (``factory.experiments.SynthesizeSpec``) for
    ``experiment``: its endpoint, or the gateway's (``settings.gateway_url``); the API key from
    the environment variable it names, and, when the teacher is the gateway, the factory key of
    ``settings`` (default: read from the environment), which no other endpoint is sent."""
    settings = settings or get_settings()
    base_url = spec.base_url or gateway_api_url(settings)
    headers = headers_for(base_url, settings)
    key = None
    if spec.api_key_env:
        key = os.environ.get(spec.api_key_env)
        if not key:
            raise FactoryError(f"data.synthesize.api_key_env: environment variable "
                               f"{spec.api_key_env} is not set")
    return Teacher(base_url=base_url, model=spec.teacher, api_key=key, timeout_s=spec.timeout_s,
                   experiment=experiment, min_confidence=spec.min_confidence, headers=headers)


def read_synthetic(session: LakeSession, experiment: str) -> pa.Table:
    """The experiment's synthetic samples as ``samples`` rows with ``origin`` synthetic (empty
    when there are none), recorded as this run's read; one row per attempt (two runs of one
    experiment at once may both have written an attempt)."""
    schema = TABLES["samples"]
    if session.lake.exists("synthetic_samples"):
        t = session.read("synthetic_samples", row_filter=experiment_filter(experiment))
    else:
        t = pa.Table.from_pylist([], schema=TABLES["synthetic_samples"])
    t = t.sort_by([("attempt_id", "ascending"), ("created_at", "ascending")])
    ids = t.column("attempt_id").to_pylist()
    t = t.take(pa.array([i for i, a in enumerate(ids) if i == 0 or a != ids[i - 1]],
                        pa.int64()))
    out = pa.Table.from_arrays([t.column(f.name).cast(f.type) for f in schema], schema=schema)
    return out.append_column("origin", pa.array([SYNTHETIC] * out.num_rows, pa.string()))


def recorded_attempts(session: LakeSession, experiment: str
                      ) -> tuple[set[str], set[str], dict[str, int]]:
    """(attempt ids already recorded as a sample or a drop, sample ids of the samples, slice
    key -> samples written: attempts with a sample, each once)."""
    flt = experiment_filter(experiment)
    attempts: set[str] = set()
    ids: set[str] = set()
    by_slice: dict[str, int] = {}
    if session.lake.exists("synthetic_samples"):
        t = session.read("synthetic_samples", row_filter=flt,
                         columns=("attempt_id", "sample_id", "slice"))
        attempts.update(t.column("attempt_id").to_pylist())
        ids.update(t.column("sample_id").to_pylist())
        # one per attempt: two runs of one experiment at once may both have written it
        for key in dict(zip(t.column("attempt_id").to_pylist(), t.column("slice").to_pylist(),
                            strict=True)).values():
            by_slice[key] = by_slice.get(key, 0) + 1
    if session.lake.exists("synthesis_drops"):
        t = session.read("synthesis_drops", row_filter=flt, columns=("attempt_id",))
        attempts.update(t.column("attempt_id").to_pylist())
    return attempts, ids, by_slice


def slice_members(train: pa.Table, labeler: Labeler | None) -> dict[str, list[dict[str, Any]]]:
    """Slice key -> the traffic train rows in it (the seed pool)."""
    cols = ["sample_id", "messages", "tools", "project", "tags"]
    rows = train.select(cols).to_pylist()
    out: dict[str, list[dict[str, Any]]] = {}
    for row, keys, origin in zip(rows, membership(train, labeler), origins(train),
                                 strict=True):
        if origin == SYNTHETIC:
            continue
        for k in keys:
            out.setdefault(k, []).append(row)
    return out


def run(session: LakeSession, experiment: str, train: pa.Table, teacher: Teacher, *,
        known_ids: Iterable[str], max_per_slice: int, seed: int,
        samples_snapshot_id: int | None, counter: TokenCounter | None = None,
        attempts_per_sample: float = 1.0) -> tuple[Outcome, list[Slice]]:
    """Synthesize for the thin slices of ``train`` (the traffic train split), appending each
    batch to ``synthetic_samples`` and ``synthesis_drops``; attempts recorded by an earlier run
    are skipped and its samples count toward their slice's target."""
    slices = profile_slices(train)
    labeler = fit_labeler(train)
    attempts = plan_attempts(experiment, slices, slice_members(train, labeler),
                             max_per_slice=max_per_slice, seed=seed,
                             attempts_per_sample=attempts_per_sample)
    recorded, synthetic_ids, written_before = recorded_attempts(session, experiment)

    def write(rows: list[dict[str, Any]], drops: list[dict[str, Any]]) -> None:
        if rows:
            session.append("synthetic_samples", rows)
        if drops:
            session.append("synthesis_drops", drops)

    outcome = synthesize(attempts, teacher, labeler, recorded=recorded,
                         known_ids={*known_ids, *synthetic_ids}, write=write,
                         samples_snapshot_id=samples_snapshot_id, counter=counter,
                         written_before=written_before)
    return outcome, slices
