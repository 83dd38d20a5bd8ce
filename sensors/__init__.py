"""Sensors, schedules and jobs; each module lists its own in ``SENSORS``, ``JOBS``, ``SCHEDULES``."""
