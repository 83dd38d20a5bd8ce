"""The loop's sensors tick on whole passes of Dagster's sensor daemon: a least interval a second
under a multiple of the pass, so that a pass starting a moment early does not skip a tick (at
exactly 5 s, ``chain_sensor`` ticked 9 s apart, and every step of a chain waited that long)."""

from __future__ import annotations

from dagster._daemon.sensor import MIN_INTERVAL_LOOP_TIME

from factory.dagster_runs import SENSOR_PASS_S, every_passes
from factory.definitions import defs

LOOP_SENSORS = {"chain_sensor": 1, "checkpoint_sensor": 1, "rollover_sensor": 1,
                "recovery_sensor": 3, "experiments_sensor": 3, "uploads_sensor": 3}
"""The sensors a chain waits on, and the passes between their ticks (those every pass skip at
the cost of a snapshot id or two when nothing changed: tests/control/test_sensors.py)."""


def test_the_pass_is_the_one_dagsters_sensor_daemon_makes() -> None:
    assert SENSOR_PASS_S == MIN_INTERVAL_LOOP_TIME


def test_the_loop_sensors_tick_every_so_many_whole_passes() -> None:
    intervals = {s.name: s.minimum_interval_seconds for s in defs.sensors or []}
    for name, passes in LOOP_SENSORS.items():
        assert intervals[name] == every_passes(passes), name
