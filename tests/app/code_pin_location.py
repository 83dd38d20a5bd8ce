"""A code location of two assets for ``tests/app/test_code_pin.py``: ``first`` opens the lake
(the step's code check) and then blocks until the test has done what it does mid-run; ``second``
opens the lake after it. It pins the factory's code as ``factory/definitions.py`` does."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from factory import codepin
from factory.resources.lake import LakeResource

GATE_ENV = "CODE_PIN_GATE"
"""A named pipe: ``first`` reads it to its end after its check; the test writes it."""


@dg.asset
def first(lake: LakeResource) -> None:
    lake.lake()
    Path(os.environ[GATE_ENV]).read_bytes()  # blocks until the test writes and closes it


@dg.asset(deps=[first])
def second(lake: LakeResource) -> None:
    lake.lake()


CODE = codepin.pin()
defs = dg.Definitions(assets=[first, second], resources={"lake": LakeResource()},
                      jobs=[dg.define_asset_job("pinned_job", selection=[first, second])],
                      executor=dg.in_process_executor)
