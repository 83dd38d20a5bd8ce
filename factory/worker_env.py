"""The main module of the spawned ingest worker processes, in place of their parent's.
(Forked workers, ``factory.ingest.workers.worker_context``, run nothing again and keep their
parent's environment.)

A spawned child first runs its parent's main module again: for an ingest that is the
``dagster`` or ``factory`` command (seconds of imports per worker), or a user's script, which
without an ``if __name__ == "__main__"`` guard would start an ingest of its own in every
worker. ``factory.ingest.workers.WorkerContext`` names this module instead. It runs before
anything loads numpy or pyarrow, so it also sets the workers' environment, which those
libraries read as they load. It imports nothing else.
"""

from __future__ import annotations

import os

WORKER_ENV = {
    # Arrow's allocator (mimalloc) hands freed pages back to the kernel at once, and the next
    # block's buffers fault them in again, zeroed: page faults are dear on a virtual machine.
    "MIMALLOC_PURGE_DELAY": "-1",
    # numpy's OpenBLAS starts a thread per core that spins for work; workers never use BLAS.
    "OPENBLAS_NUM_THREADS": "1",
}
"""Environment of the worker processes (a variable already set wins)."""

if __name__ == "__mp_main__":  # run by multiprocessing in a worker, not when imported
    for _name, _value in WORKER_ENV.items():
        os.environ.setdefault(_name, _value)
