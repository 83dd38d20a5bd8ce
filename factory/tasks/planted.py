"""Generated ``samples`` rows with a planted mix of problems, and what curation must find.

Used by the curation tests and ``bench/curation.py``. In ``planted``, clean samples are random
sentences over a large made-up vocabulary, so two clean samples share no 13-word n-gram and have
Jaccard ~0; every planted problem carries the label of the drop it must cause. ``templated`` is
the opposite: distinct clean support tickets that share long phrases, plus a paraphrase and a
paste of eval tickets, the only samples decontamination may drop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pyarrow as pa

from factory.curation.config import CurationConfig
from factory.curation.decide import EVAL, TRAIN, split_side
from factory.normalize.canon import canonical_json, sample_id
from factory.tables import TABLES
from factory.tasks.support_extract import SYSTEM_PROMPT, generate_conversations

_SYL = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "dor", "pi", "ne", "zu", "ha", "qo", "bri",
        "tal", "mon", "ex", "ul", "ia", "fer", "gos", "wi", "yan", "cre"]
_REFUSALS = ["I'm sorry, but I can't help with that request.",
             "Lo siento, pero no puedo ayudarte con eso.",
             "Je suis désolé, mais je ne peux pas vous aider avec cela.",
             "Es tut mir leid, aber ich kann dabei nicht helfen.",
             "抱歉，我无法帮助你完成这个请求。"]
_TOOL = {"name": "lookup_order", "description": "Find an order",
         "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"},
                                                         "verbose": {"type": "boolean"}},
                        "required": ["order_id"]}}
_JSON_SYSTEM = "Extract the fields and answer with a JSON object only."


@dataclass(kw_only=True)
class Planted:
    """Generated rows and the drops they must cause."""

    rows: list[dict[str, Any]]
    """``samples`` rows."""
    expected: dict[str, str] = field(default_factory=dict)
    """sample_id -> drop reason (for a duplicate: the reason of its extra rows)."""
    near_pairs: list[tuple[str, str]] = field(default_factory=list)
    """(original, near-duplicate) sample ids: exactly the larger id of each is dropped."""
    overlaps: list[tuple[str, str]] = field(default_factory=list)
    """(train sample, eval sample) planted contamination."""

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=TABLES["samples"])


class _Gen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = sorted({"".join(self.rng.choice(_SYL) for _ in range(self.rng.randint(2, 4)))
                             for _ in range(30000)})
        self.t0 = datetime(2025, 1, 1, tzinfo=UTC)
        self.n = 0

    def words(self, k: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=k))

    def row(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            *, project: str = "support", tags: dict[str, str] | None = None,
            trace: str | None = None) -> dict[str, Any]:
        tools = tools or []
        self.n += 1
        return {
            "sample_id": sample_id(messages, tools),
            "raw_trace_id": trace or f"trace-{self.n:08d}",
            "source": "upload", "provider": "openai", "model": "gpt-x",
            "messages": canonical_json(messages), "tools": canonical_json(tools),
            "num_turns": len(messages),
            "has_images": False,
            "has_tool_calls": any(m.get("tool_calls") for m in messages),
            "created_at": self.t0 + timedelta(seconds=self.n),
            "project": project, "tags": list((tags or {"project": project}).items()),
        }


def _t(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


def chat(question: str, answer: str, system: str | None = None) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if system:
        msgs.append({"role": "system", "content": _t(system)})
    msgs += [{"role": "user", "content": _t(question)},
             {"role": "assistant", "content": _t(answer)}]
    return msgs


def planted(num_clean: int = 200, *, seed: int = 0, config: CurationConfig | None = None,
            dup_share: float = 0.10, near_share: float = 0.05, overlap_share: float = 0.02,
            refusal_share: float = 0.01, broken_share: float = 0.01,
            num_special: int = 2) -> Planted:
    """``num_clean`` clean samples plus planted problems (shares are of ``num_clean``).

    ``num_special`` of each rarer kind (truncated, tool schema, agent loop, empty, too long)
    are planted too. Overlaps are planted only where the split puts the copy in train and its
    source in eval, so each one must be caught by decontamination.
    """
    config = config or CurationConfig()
    g = _Gen(seed)
    out = Planted(rows=[])
    clean: list[dict[str, Any]] = []
    questions: dict[str, str] = {}
    for i in range(num_clean):
        if i % 5 == 4:  # a JSON-answering project: the format detector's context
            q = g.words(g.rng.randint(16, 30))
            ans = canonical_json({"name": g.words(2), "city": g.words(1),
                                  "items": g.words(g.rng.randint(5, 20)).split()})
            row = g.row(chat(q, ans, _JSON_SYSTEM), project="extract")
        elif i % 5 == 3:  # a valid tool call
            q = g.words(g.rng.randint(16, 30))
            msgs: list[dict[str, Any]] = [
                {"role": "user", "content": _t(q)},
                {"role": "assistant", "content": [],
                 "tool_calls": [{"id": "call_0", "name": "lookup_order",
                                 "arguments": canonical_json({"order_id": g.rng.randint(1, 9999)})}]},
                {"role": "tool", "tool_call_id": "call_0",
                 "content": _t(canonical_json({"status": "shipped", "eta": g.words(2)}))},
                {"role": "assistant", "content": _t(g.words(g.rng.randint(20, 50)) + ".")}]
            row = g.row(msgs, [_TOOL])
        else:
            q = g.words(g.rng.randint(16, 40))
            row = g.row(chat(q, g.words(g.rng.randint(20, 80)) + "."))
        clean.append(row)
        questions[row["sample_id"]] = q
    out.rows.extend(clean)

    group_members: dict[str, list[str]] = {r["sample_id"]: [r["sample_id"]] for r in clean}
    plain = [r for r in clean if r["project"] == "support" and not r["has_tool_calls"]]
    # exact duplicates: the same conversation again from another record
    for r in g.rng.sample(clean, int(num_clean * dup_share)):
        out.rows.append({**r, "raw_trace_id": f"dup-{g.n}", "created_at": r["created_at"]
                         + timedelta(days=1)})
        g.n += 1
        out.expected[r["sample_id"]] = "duplicate"
    # near duplicates: one word of the question changed (so only the LSH edge relates them)
    used_near = set()
    long_enough = [r for r in plain if r["sample_id"] not in out.expected
                   and len(orjson.loads(r["messages"])[0]["content"][0]["text"]
                           .split()) + len(orjson.loads(r["messages"])[1]
                                           ["content"][0]["text"].split()) >= 50]
    for r in g.rng.sample(long_enough, min(len(long_enough), int(num_clean * near_share))):
        msgs = orjson.loads(r["messages"])
        ws = msgs[0]["content"][0]["text"].split()
        ws[len(ws) // 2] = g.rng.choice(g.vocab)
        msgs[0]["content"][0]["text"] = " ".join(ws)
        copy = g.row(msgs)
        out.rows.append(copy)
        out.near_pairs.append((r["sample_id"], copy["sample_id"]))
        group_members[r["sample_id"]].append(copy["sample_id"])
        used_near.add(r["sample_id"])
    # eval overlap: a train prompt embedding an eval sample's question
    def side_of(sid: str) -> str:
        return split_side(min(group_members[sid]), config)

    sources = [r for r in plain if r["sample_id"] not in used_near
               and r["sample_id"] not in out.expected and side_of(r["sample_id"]) == EVAL
               and len(questions[r["sample_id"]].split()) >= config.decontam_ngram]
    for r in sources[:max(1, int(num_clean * overlap_share)) if overlap_share else 0]:
        for _ in range(50):
            q = f"Context: {g.words(12)}. Now: {questions[r['sample_id']]}"
            copy = g.row(chat(q, g.words(g.rng.randint(20, 60)) + "."))
            if split_side(copy["sample_id"], config) == TRAIN:
                out.rows.append(copy)
                out.overlaps.append((copy["sample_id"], r["sample_id"]))
                out.expected[copy["sample_id"]] = "eval_ngram_overlap"
                break
    # refusals, in several languages
    for i in range(max(1, int(num_clean * refusal_share)) if refusal_share else 0):
        row = g.row(chat(g.words(20), _REFUSALS[i % len(_REFUSALS)]))
        out.rows.append(row)
        out.expected[row["sample_id"]] = "refusal"
    # broken JSON inside the JSON project
    for _ in range(max(1, int(num_clean * broken_share)) if broken_share else 0):
        bad = '{"name": "' + g.words(2) + '", "city": ' + g.words(1) + '}'
        row = g.row(chat(g.words(20), bad, _JSON_SYSTEM), project="extract")
        out.rows.append(row)
        out.expected[row["sample_id"]] = "format"
    for _ in range(num_special):
        row = g.row(chat(g.words(20), '{"name": "' + g.words(3) + '", "items": ["'),
                    project="support")
        out.rows.append(row)
        out.expected[row["sample_id"]] = "truncated"
        msgs = [{"role": "user", "content": _t(g.words(20))},
                {"role": "assistant", "content": [],
                 "tool_calls": [{"id": "call_0", "name": "lookup_order",
                                 "arguments": canonical_json({"order_id": "abc"})}]},
                {"role": "tool", "tool_call_id": "call_0", "content": _t("ok")},
                {"role": "assistant", "content": _t(g.words(20) + ".")}]
        row = g.row(msgs, [_TOOL])
        out.rows.append(row)
        out.expected[row["sample_id"]] = "tool_schema"
        args = canonical_json({"order_id": g.rng.randint(1, 999)})
        msgs = [{"role": "user", "content": _t(g.words(20))}]
        for k in range(2):
            msgs += [{"role": "assistant", "content": [],
                      "tool_calls": [{"id": f"call_{k}", "name": "lookup_order",
                                      "arguments": args}]},
                     {"role": "tool", "tool_call_id": f"call_{k}",
                      "content": _t(canonical_json({"error": "backend timeout"}))}]
        msgs.append({"role": "assistant", "content": _t(g.words(15) + ".")})
        row = g.row(msgs, [_TOOL])
        out.rows.append(row)
        out.expected[row["sample_id"]] = "agent_loop"
        row = g.row([{"role": "user", "content": _t(g.words(20))}])
        out.rows.append(row)
        out.expected[row["sample_id"]] = "no_assistant_turn"
        row = g.row(chat(g.words(30), g.words(config.max_tokens) + "."))
        out.rows.append(row)
        out.expected[row["sample_id"]] = "too_long"
    return out


# Rewordings of phrases in the support tickets' bodies (``support_extract``).
_REWORDS = (("would like", "want"), ("charged twice", "billed two times"),
            ("arrived broken", "came damaged"), ("crashes every time", "freezes whenever"),
            ("Please", "Kindly"), ("Could you", "Can you"), ("are wrong", "are incorrect"),
            ("still haven't seen", "have not yet received"), ("blank screen", "empty page"),
            ("It would be great if", "I'd love it if"), ("Any plans to", "Will you"),
            ("can't log in", "cannot sign in"), ("got locked", "was blocked"),
            ("Cancel my plan please", "Please cancel my plan"), ("lost access", "no longer have access"),
            ("Where is", "What happened to"), ("hasn't updated", "has not moved"),
            ("was supposed to arrive", "should have arrived"), ("explain", "clarify"),
            ("Why did", "How come"), ("We no longer need", "We don't need"),
            ("does nothing", "has no effect"), ("never arrives", "doesn't come"),
            ("We'd love", "We would like"), ("Do you offer", "Is there"),
            ("Which card is on file", "What card do you have"), ("never reached us", "never got here"),
            ("I returned", "I sent back"), ("Since the update", "After the update"),
            ("Two-factor codes", "The 2FA codes"), ("still says", "keeps saying"))
_GREETING_SWAP = {"Hi,": "Hello there,", "Hello,": "Hi!", "Hi there,": "Good day,",
                  "Dear support team,": "To the support team,", "Hey,": "Hi folks,",
                  "Good morning,": "Good evening,"}


def reword(message: str) -> tuple[str, int]:
    """A paraphrase of a support ticket: another greeting and every known phrase reworded;
    also the number of phrases reworded. Names, emails, numbers and the ask stay."""
    lines = message.split("\n")
    lines[0] = _GREETING_SWAP.get(lines[0], "Hello,\n" + lines[0])
    text = "\n".join(lines)
    num = 0
    for old, new in _REWORDS:
        if old in text:
            text, num = text.replace(old, new), num + 1
    return text, num


def templated(num_tickets: int = 600, *, seed: int = 0,
              config: CurationConfig | None = None) -> Planted:
    """``num_tickets`` distinct clean support tickets (one system prompt, a few dozen body
    templates, so many pairs share long phrases) plus two contaminated train samples: a
    paraphrase of an eval ticket with its answer (``eval_conversation_overlap``) and an eval
    ticket pasted into a longer prompt with another answer (``eval_ngram_overlap``)."""
    config = config or CurationConfig()
    g = _Gen(seed)
    out = Planted(rows=[])
    def ticket(message: str, answer: str) -> dict[str, Any]:
        return g.row(chat(message, answer, SYSTEM_PROMPT), project="extract",
                     trace=f"ticket-{g.n + 1:08d}")

    for conv in generate_conversations(num_tickets, seed):
        m = conv["messages"]
        out.rows.append(ticket(m[1]["content"], m[2]["content"]))
    tickets = list(out.rows)
    evals = [r for r in tickets if split_side(r["sample_id"], config) == EVAL]
    paraphrased = pasted = False
    for r in evals:
        msgs = orjson.loads(r["messages"])
        message, answer = msgs[1]["content"][0]["text"], msgs[2]["content"][0]["text"]
        if not paraphrased:
            text, num = reword(message)
            row = ticket(text, answer)
            if num >= 2 and split_side(row["sample_id"], config) == TRAIN:
                out.rows.append(row)
                out.expected[row["sample_id"]] = "eval_conversation_overlap"
                out.overlaps.append((row["sample_id"], r["sample_id"]))
                paraphrased = True
                continue
        if not pasted:
            text = ("Forwarded from the shared inbox, with the account notes: customer since "
                    "2019, prefers email, open ticket count two.\n\n" + message)
            other = canonical_json({**orjson.loads(answer), "company": "Shared Inbox"})
            row = ticket(text, other)
            if split_side(row["sample_id"], config) == TRAIN:
                out.rows.append(row)
                out.expected[row["sample_id"]] = "eval_ngram_overlap"
                out.overlaps.append((row["sample_id"], r["sample_id"]))
                pasted = True
        if paraphrased and pasted:
            break
    return out
