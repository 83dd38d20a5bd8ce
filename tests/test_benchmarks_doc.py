"""BENCHMARKS.md stays the present: short, one section per component, each with its command,
machine, date and baseline, the headings the code cites, and every test-split score taken."""

from __future__ import annotations

import re
from pathlib import Path

from bench import splits

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "BENCHMARKS.md"

MAX_LINES = 450
"""Room for a section per component; a figure's earlier runs belong in git history."""

COMMAND = re.compile(r"bench/|make |python")
MACHINE = re.compile(r"dev-cpu|AVX2 host|bf16 host|GPU")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
BASELINE = re.compile(r"baseline", re.IGNORECASE)

CITED = re.compile(r"""BENCHMARKS\.md(?:'s)?,?\s+"([^"]+)\"""")
"""A section cited by name: `BENCHMARKS.md, "CPU sharing"`, `BENCHMARKS.md "Planner time model"`,
`BENCHMARKS.md's "Test-split ledger"`."""
CITED_IN_PROSE = {"The demo", "Agent task"}
"""Cited in other words: the runs ``tests/planner/test_time_model.py`` reads its profiles from."""


def _sections(text: str) -> dict[str, str]:
    """Each `## ` heading's title (before " — ") and its body, up to the next `## `."""
    parts = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {p.split("\n", 1)[0].split(" — ")[0].strip(): p for p in parts}


def _cited_sections() -> set[str]:
    """Section names the code, tests and docs cite, read across line breaks and comment marks."""
    names = set()
    for folder in ("factory", "trainer", "bench", "tests", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if (path.suffix not in {".py", ".md", ".yaml"} or not path.is_file()
                    or path == Path(__file__).resolve()):
                continue
            text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(errors="replace"))
            names.update(CITED.findall(text))
    return names


def test_the_file_is_short_enough_to_be_the_present() -> None:
    num_lines = len(DOC.read_text().splitlines())
    assert num_lines <= MAX_LINES, (
        f"BENCHMARKS.md has {num_lines} lines, over {MAX_LINES}: keep each component's current "
        "figure and drop superseded runs (git keeps them)")


def test_every_section_names_its_command_machine_date_and_baseline() -> None:
    sections = _sections(DOC.read_text())
    assert len(sections) >= 10
    missing = {title: [what for what, pattern in (("a command", COMMAND), ("a machine", MACHINE),
                                                   ("a date", DATE), ("a baseline", BASELINE))
                       if not pattern.search(body)]
               for title, body in sections.items()}
    missing = {title: what for title, what in missing.items() if what}
    assert not missing, (
        f"BENCHMARKS.md sections lacking what reproduces their figure: {missing}; name the "
        "command (bench/..., make ..., python ...), the machine (dev-cpu, AVX2 host, bf16 host), "
        "the date (YYYY-MM-DD) and the baseline")


def test_every_section_the_code_cites_exists() -> None:
    cited = _cited_sections()
    assert {"Planner time model", "CPU sharing", "Test-split ledger"} <= cited
    cited |= CITED_IN_PROSE
    titles = set(_sections(DOC.read_text()))
    assert not cited - titles, (
        f"sections cited in the code but not headed in BENCHMARKS.md: {sorted(cited - titles)}; "
        "keep the heading (`## <name> — <command>`) or change the citation")


def test_the_test_split_ledger_lists_every_score_taken() -> None:
    ledger = _sections(DOC.read_text())["Test-split ledger"]
    table = splits.render(splits.read())
    assert table in ledger, (
        "BENCHMARKS.md's \"Test-split ledger\" differs from bench/test_ledger.jsonl: paste the "
        "output of `.venv/bin/python bench/splits.py` under its heading")
