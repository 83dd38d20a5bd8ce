"""Run the Triton kernels on CPU through Triton's interpreter when no GPU is present.

Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``triton.jit``, its own
``tl.sum``/``tl.max`` included, i.e. when triton is first imported. So it is set here at conftest
import time, before these tests import anything. Importing a transformers model class imports
triton too: if a test module collected earlier did that, the interpreter cannot be switched on
any more, and the ``device`` fixture fails with that explanation instead of a Triton traceback.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_NEEDS_INTERPRETER = not torch.cuda.is_available()
_TRITON_TOO_EARLY = (_NEEDS_INTERPRETER and "triton" in sys.modules
                     and os.environ.get("TRITON_INTERPRET") != "1")
if _NEEDS_INTERPRETER:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture()
def device() -> torch.device:
    """Where the kernels run: the GPU if there is one, else the CPU interpreter."""
    if _TRITON_TOO_EARLY:
        pytest.fail("triton was imported before tests/kernels/conftest.py could set "
                    "TRITON_INTERPRET=1 (importing a transformers model imports triton); set it "
                    "at the top of tests/conftest.py when no CUDA device is present")
    return DEVICE
