"""Printing rows for people (a table) and for scripts (JSON), shared by the CLI commands."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list) and value and isinstance(value[0], tuple):
        return {str(k): _plain(v) for k, v in value}  # Arrow maps come back as key/value pairs
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def to_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """A JSON array of row objects: the contract scripts rely on."""
    return json.dumps([{k: _plain(v) for k, v in row.items()} for row in rows],
                      ensure_ascii=False)


def print_rows(rows: Sequence[Mapping[str, Any]], fmt: str = "table",
               columns: Sequence[str] | None = None, title: str | None = None) -> None:
    if fmt == "json":
        print(to_json(rows))
        return
    # rich (0.1 s): the CLI imports this module; only a table for a terminal needs it
    from rich.console import Console
    from rich.table import Table

    cols = list(columns or (rows[0].keys() if rows else []))
    table = Table(title=title, show_lines=False)
    for col in cols:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*[_cell(row.get(c)) for c in cols])
    Console(file=sys.stdout, width=max(120, Console().width)).print(table)


def _cell(value: Any) -> str:
    value = _plain(value)
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
