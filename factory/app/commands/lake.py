"""``factory tables``, ``factory sql`` and ``factory lineage``: looking into the lake."""

from __future__ import annotations

import argparse
import json
from typing import Any

from factory.errors import FactoryError
from factory.lake import Lake, walk_lineage
from factory.output import print_rows
from factory.tables import schema_of


def register(sub: Any) -> None:
    p = sub.add_parser("tables", help="list the lake's tables: rows, snapshot, last writer")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=_tables)

    p = sub.add_parser("sql", help="run DuckDB SQL over the lake tables (bare names)")
    p.add_argument("query")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=_sql)

    p = sub.add_parser("lineage", help="walk a table snapshot back to its sources")
    p.add_argument("target", metavar="TABLE[@SNAPSHOT]")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=_lineage)


def _tables(args: argparse.Namespace) -> int:
    print_rows(Lake().describe(), args.format,
               columns=["table", "rows", "snapshot_id", "committed_at", "last_writer", "run_id"])
    return 0


def _sql(args: argparse.Namespace) -> int:
    result = Lake().sql(args.query)
    print_rows(result.to_pylist(), args.format, columns=result.column_names)
    return 0


def _lineage(args: argparse.Namespace) -> int:
    name, _, snap = args.target.partition("@")
    schema_of(name)  # unknown table -> one clear line
    lake = Lake()
    if not lake.exists(name):
        raise FactoryError(f"table {name!r} has not been written yet")
    try:
        snapshot_id = int(snap) if snap else None
    except ValueError:
        raise FactoryError(f"snapshot must be an integer id, got {snap!r}") from None
    tree = walk_lineage(lake, name, snapshot_id)
    if args.format == "json":
        print(json.dumps(tree, indent=2))
    else:
        _print_tree(tree, 0)
    return 0


def _print_tree(node: dict[str, Any], depth: int) -> None:
    pad = "  " * depth + ("└─ " if depth else "")
    if node.get("missing"):
        print(f"{pad}{node['table']}@{node['snapshot_id']}  (snapshot expired)")
        return
    writer = node["asset_key"] or "(no asset)"
    print(f"{pad}{node['table']}@{node['snapshot_id']}  {node['committed_at']}  "
          f"rows={node['rows']}  by {writer}  run={node['run_id'] or '-'}  "
          f"code={node['code_version'][:12] or '-'}  (+{node['earlier_snapshots']} earlier)"
          + ("  (its sources are shown above)" if node.get("cycle") else ""))
    for child in node["upstream"]:
        _print_tree(child, depth + 1)
