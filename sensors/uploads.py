"""``uploads_sensor``: a file dropped into ``$FACTORY_HOME/uploads`` is ingested.

Each new or changed file (by size and modification time) gets one run of
``ingest_uploads_job`` with that file in its config. The run key names the file and its
version, so a re-evaluated tick never launches it twice; the cursor remembers the versions
already requested. Files modified in the last few seconds are left for a later tick, so a file
still being copied is not ingested half-written.
"""

import json
import time
from pathlib import Path
from typing import Any

import dagster as dg

from factory.dagster_runs import every_passes
from factory.ingest import FILE_SUFFIXES
from factory.settings import get_settings

INGEST_OP = "traces"  # the multi-asset in assets/ingest.py that writes the three tables

ingest_uploads_job = dg.define_asset_job(
    "ingest_uploads_job",
    selection=dg.AssetSelection.assets("raw_traces", "samples", "rejected_traces"),
    description="Ingest files from the uploads folder into raw_traces, samples and "
                "rejected_traces.")


def build_uploads_sensor(job: Any = ingest_uploads_job, *, settle_s: float = 2.0,
                         max_files: int = 100) -> dg.SensorDefinition:
    """The sensor, for ``job``; ``settle_s``: how long a file must be unmodified first."""

    @dg.sensor(job=job, name="uploads_sensor", minimum_interval_seconds=every_passes(3),
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Ingests each new or changed file in $FACTORY_HOME/uploads.")
    def uploads_sensor(context: dg.SensorEvaluationContext):
        uploads = get_settings().uploads
        seen: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        if not uploads.exists():
            return dg.SkipReason(f"no uploads folder at {uploads}")
        now = time.time()
        requests: list[dg.RunRequest] = []
        settling = 0
        for path in sorted(p for p in uploads.rglob("*") if p.is_file()
                           and p.name.endswith(FILE_SUFFIXES) and not p.name.startswith(".")):
            stat = path.stat()
            rel = path.relative_to(uploads).as_posix()
            version = f"{stat.st_size}:{stat.st_mtime_ns}"
            if seen.get(rel) == version:
                continue
            if now - stat.st_mtime < settle_s:
                settling += 1
                continue
            if len(requests) >= max_files:
                break
            seen[rel] = version
            requests.append(dg.RunRequest(
                run_key=f"{rel}@{version}",
                run_config={"ops": {INGEST_OP: {"config": {"paths": [str(Path(path))]}}}},
                tags={"factory/upload": rel}))
        if not requests:
            why = f"{settling} file(s) still being written" if settling else "no new files"
            return dg.SkipReason(f"{why} in {uploads}")
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(seen, sort_keys=True))

    return uploads_sensor


uploads_sensor = build_uploads_sensor()

SENSORS = [uploads_sensor]
JOBS = [ingest_uploads_job]
