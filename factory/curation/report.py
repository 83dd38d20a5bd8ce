"""The trace-pattern report: what was wrong with the traffic, with counts and examples (Markdown)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

import pyarrow as pa

from factory.curation.config import CurationConfig
from factory.curation.decide import SYNTHETIC, TRAIN, Decisions, clean_loss_shares

_EXAMPLES = 3


def _pattern(detail: str) -> str:
    """Group details into patterns: numbers and quoted values replaced."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "…", detail)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:100]


def pattern_report(features: pa.Table, decisions: Decisions, config: CurationConfig, *,
                   num_selected: int, synthetic: frozenset[str] = frozenset()) -> str:
    """Markdown: drops by step/reason with examples, the clean samples each reason cost,
    detector patterns over all samples, then what became of the ``synthetic`` samples."""
    drops: list[dict[str, Any]] = list(decisions.drops)
    lines = ["# Trace-pattern report", "",
             f"{num_selected} rows selected, {len(drops)} dropped, "
             f"{len(decisions.kept_rows)} kept.", "", "## Drops by step", "",
             "| step | reason | rows | examples |", "|---|---|---|---|"]
    by_reason: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for d in drops:
        by_reason[(d["step"], d["reason"])].append(d)
    for (step, reason), ds in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        ex = "; ".join(f"`{d['sample_id'][:12]}` {d['detail'] or ''}".strip()
                       for d in ds[:_EXAMPLES])
        lines.append(f"| {step} | {reason} | {len(ds)} | {_cell(ex)} |")
    lines += clean_lost_lines(decisions)
    f = features.select(["sample_id", "refusal", "truncated", "tool_schema",
                         "agent_loop"]).to_pydict()
    lines += ["", "## Patterns found (distinct samples, before the drop policy)", ""]
    any_found = False
    for name in ("refusal", "truncated", "tool_schema", "agent_loop"):
        hits = [(sid, d) for sid, d in zip(f["sample_id"], f[name], strict=True) if d]
        if not hits:
            continue
        any_found = True
        policy = "dropped" if name in config.drop else "flagged, kept"
        lines.append(f"### {name}: {len(hits)} samples ({policy})")
        for pat, n in Counter(_pattern(d) for _, d in hits).most_common(5):
            example = next(sid for sid, d in hits if _pattern(d) == pat)
            lines.append(f"- {n} × {_cell(pat)} (e.g. `{example[:12]}`)")
        lines.append("")
    fmt = [d for d in drops if d["reason"] == "format"]
    if fmt:
        any_found = True
        format_section(lines, len(fmt), fmt)
    if decisions.flagged_kept:
        lines.append("Flagged but kept by policy: " + ", ".join(
            f"{k} {v}" for k, v in sorted(decisions.flagged_kept.items())))
    if not any_found:
        lines.append("No refusals, format breaks, truncations or tool failures found.")
    if synthetic:
        lines += ["", *_synthetic_section(decisions, synthetic)]
    return "\n".join(lines).rstrip() + "\n"


def _synthetic_section(decisions: Decisions, synthetic: frozenset[str]) -> list[str]:
    kept = {k.rsplit(":", 1)[0] for k in decisions.kept_rows}
    num_train = sum(1 for s in kept if decisions.side.get(s) == TRAIN)
    num_kept = len(kept & synthetic)
    share = num_kept / num_train if num_train else 0.0
    lines = ["## Synthetic samples", "",
             f"{len(synthetic)} synthetic samples curated, {num_kept} kept: {share:.2%} of the "
             f"{num_train} train samples (never in eval).", ""]
    reasons = Counter(d["reason"] for d in decisions.drops if d.get("origin") == SYNTHETIC)
    if reasons:
        lines += ["| reason | synthetic rows dropped |", "|---|---|"]
        lines += [f"| {r} | {n} |" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return lines


def format_section(lines: list[str], num_rows: int, examples: list[dict[str, Any]]) -> None:
    """The report's section on rows whose JSON breaks the shape their peers answer in."""
    lines.append(f"### format: {num_rows} rows break the JSON their peers answer in")
    for d in examples[:_EXAMPLES]:
        lines.append(f"- `{d['sample_id'][:12]}` {_cell(d['detail'] or '')}")
    lines.append("")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def clean_lost_lines(decisions: Any) -> list[str]:
    """The report's "Clean samples lost" section (both engines'): what each drop reason
    removed of the clean samples (``Decisions.num_clean`` / ``clean_lost``)."""
    lines = ["", "## Clean samples lost", "",
             f"{decisions.num_clean} distinct samples are clean (not empty, renderable, no "
             "detector flag); what each reason removed of them:", "",
             "| reason | clean samples | share of clean |", "|---|---|---|"]
    shares = clean_loss_shares(decisions.clean_lost, decisions.num_clean)
    for reason, share in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"| {reason} | {decisions.clean_lost[reason]} | {share:.2%} |")
    if not shares:
        lines.append("| (none) | 0 | 0.00% |")
    return lines
