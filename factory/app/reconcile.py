"""What killed processes left recorded as running, ended with the reason.

``python -m factory.app.reconcile`` is the ``finally`` command of the lifeline of ``factory
run`` and ``factory ui`` (``factory.lifeline``): it runs after the lifeline stopped the groups of
an owner that was killed outright, so the Dagster daemon, the code servers and their run workers
of that owner are gone.

- The lake: the control plane observes once. A training run whose following step died
  (``TrainerJob.owner``) is failed with the reason ``owner gone`` and its live segments stopped (the
  trainer checkpoints the step it is at); a trainer that noticed first ended the run the same way.
- Dagster: a run still ``STARTED``, ``STARTING`` or ``CANCELING`` whose code server no longer
  answers had its run worker in that code server's group, stopped with it; it is reported failed
  with that reason, as Dagster's code server does for a run worker that dies under it. Only on an
  instance of this node (no ``FACTORY_DATABASE_URL``): on a shared one another node's code
  server may use the same port, and run monitoring is the deployment's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from factory.app.instance import code_server_answers, control_plane, instance
from factory.control.plane import observe_once
from factory.settings import get_settings


def reconcile_lake() -> list[str]:
    """Observe the control plane once; the runs it ended (run ids)."""
    return observe_once(control_plane())


def dead_dagster_runs(inst: Any) -> list[Any]:
    """Unfinished runs of ``inst`` whose code server on this machine no longer answers."""
    import dagster as dg
    from dagster._core.storage.tags import GRPC_INFO_TAG

    dead = []
    statuses = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.CANCELING]
    for run in inst.get_runs(filters=dg.RunsFilter(statuses=statuses)):
        info = json.loads(run.tags.get(GRPC_INFO_TAG) or "{}")
        if info.get("host") in ("localhost", "127.0.0.1") and info.get("port") \
                and not code_server_answers(int(info["port"])):
            dead.append(run)
    return dead


def reconcile_dagster() -> list[str]:
    """Report failed the runs ``dead_dagster_runs`` finds; their ids."""
    if get_settings().database_url:
        return []
    inst = instance()
    ended = []
    for run in dead_dagster_runs(inst):
        inst.report_engine_event("its run worker was stopped with the process that started "
                                 "its code server, which was killed", run)
        inst.report_run_failed(run)
        ended.append(run.run_id)
    return ended


def main() -> int:
    log = get_settings().ensure().home / "logs" / "reconcile.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        lake = reconcile_lake()
        runs = reconcile_dagster()
        print(json.dumps({"training_runs_ended": lake, "dagster_runs_failed": runs}),
              file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
