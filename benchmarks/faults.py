"""Faults: how soon the notebook says what went wrong, and how fast the cluster recovers. A rank
that raises before a psum (the divergence report, with and without the watchdog's grace), a
rank killed in a collective (rank 0, then the last rank: the death report), and the restart
after each.

Threads: a ``threading.Timer`` kills the rank while the main thread waits in the cell. The
timer's thread touches only the rank's pid and its own ``killed_at`` list (it appends the
moment of the kill); the main thread reads that list after the failed cell has returned,
which is after the kill, and joins the timer before the restart. The ``Bench`` (bench.py) is
touched on the main thread only.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from benchmarks.bench import GRACE, PSUM


def measure(bench) -> None:
    """A rank that raises before a psum, a rank killed in a collective (rank 0, then the
    last rank); each report is timed, and so is the restart after it."""
    setup = "import os, time, jax\nrank = jax.process_index()\n" + PSUM
    bench.cell("%spmd start -n 4 -d 2")
    bench.cell(setup)
    t0 = time.perf_counter()
    bench.failing_cell(f"if rank == 0:\n    raise ValueError('diverge')\n{PSUM}")
    total = time.perf_counter() - t0
    bench.record("divergence_report/spmd", total)
    bench.record("divergence_report_beyond_grace/spmd", total - GRACE)
    _restart(bench, setup)
    for victim, sleeper in ((0, 3), (3, 0)):
        pid = bench.magics.session.ranks[victim].pid
        killed_at: list[float] = []

        def kill(pid: int = pid, killed_at: list[float] = killed_at) -> None:
            killed_at.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)

        timer = threading.Timer(1.0, kill)
        timer.start()
        bench.failing_cell(
            f"%%spmd --grace off\nif rank == {sleeper}:\n    time.sleep(60)\n{PSUM}"
        )
        bench.record(f"death_report_rank{victim}/spmd", time.perf_counter() - killed_at[0])
        timer.join()
        _restart(bench, setup)
    bench.cell("%spmd stop")


def _restart(bench, setup: str) -> None:
    t0 = time.perf_counter()
    bench.cell("%spmd restart")
    bench.cell(setup)
    bench.record("restart_after_fault/spmd", time.perf_counter() - t0)
