"""Writing a table's Parquet data files without the catalog: for worker processes.

``Lake.file_target(name)`` describes how a table's data files are written (the Arrow schema
with the Iceberg field ids, the Parquet writer options from the table's properties) and hands
out new file locations; a process that has only this module and pyarrow writes the files, and
the lake commits them later (``Lake.commit_files``, which reads each file's footer for the
Iceberg statistics). Importing pyiceberg costs a worker process ~0.5 s of CPU at start; this
module imports only pyarrow.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


@dataclass(frozen=True)
class FileTarget:
    """How to write data files of one table (picklable, to hand to a worker process)."""

    table: str
    """The table's name."""
    schema: pa.Schema
    """Its Arrow schema, with the Iceberg field ids in the field metadata."""
    writer_options: dict[str, Any]
    """Keyword arguments of ``pq.ParquetWriter`` (codec, page sizes) from the table's
    properties, as pyiceberg itself would pass them."""

    def write(self, rows: pa.Table, location: str) -> str:
        """Write ``rows`` to ``location`` (a URI or path from ``Lake.new_data_locations``)."""
        fs, path = pafs.FileSystem.from_uri(location) if "://" in location \
            else (pafs.LocalFileSystem(), location)
        fs.create_dir(posixpath.dirname(path), recursive=True)
        with fs.open_output_stream(path) as out, \
                pq.ParquetWriter(out, schema=self.schema, **self.writer_options) as writer:
            writer.write_table(self.shape(rows))
        return location

    def shape(self, rows: pa.Table) -> pa.Table:
        """``rows`` in the file schema: its column order, types and field ids (a column the
        rows lack, say one added to the table since, is null)."""
        names = set(rows.column_names)
        return pa.Table.from_arrays(
            [rows.column(f.name).cast(f.type) if f.name in names
             else pa.nulls(rows.num_rows, f.type) for f in self.schema], schema=self.schema)
