"""Ingest: raw records in, ``raw_traces`` first, then ``samples`` and ``rejected_traces``.

One module per concern:

- ``records``: what goes in and comes out (``RawRecord``, ``IngestSummary``) and the ``Item``
  a record travels as;
- ``rows``: one record to its outcome (parse, content hash, normalize, sample rows): the
  per-record work, which worker processes run on blocks of lines (``process_lines``);
- ``dedupe``: which ids the lake holds already (``KnownIds``);
- ``tables``: the rows of the three tables, built one way (``ingest_tables``);
- ``files``: reading ``.jsonl``/``.json``/``.gz`` files and cutting JSON Lines into blocks;
- ``workers``: the worker processes that turn a block into Parquet data files;
- ``commit``: the commits, ``raw_traces`` first, with their lineage;
- ``pipeline``: ``ingest_records`` and ``ingest_paths``, which put these together.

The names below load their module when first used: a spawned worker process imports
``factory.ingest.workers`` (and so this package) without the lake and pyiceberg, which only the
pipeline needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factory.ingest.files import FILE_SUFFIXES, iter_files, read_file
    from factory.ingest.pipeline import default_workers, ingest_paths, ingest_records
    from factory.ingest.records import (
        SOURCES,
        IngestSummary,
        RawRecord,
        normalize_record,
        raw_trace_id_of,
    )

_MODULE_OF = {
    "FILE_SUFFIXES": "files", "iter_files": "files", "read_file": "files",
    "default_workers": "pipeline", "ingest_paths": "pipeline", "ingest_records": "pipeline",
    "SOURCES": "records", "IngestSummary": "records", "RawRecord": "records",
    "normalize_record": "records", "raw_trace_id_of": "records",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["FILE_SUFFIXES", "SOURCES", "IngestSummary", "RawRecord", "default_workers",
           "ingest_paths", "ingest_records", "iter_files", "normalize_record", "raw_trace_id_of",
           "read_file"]
