"""Many ranks (``--backend none``, forked by the rank server), side by side in one run:

- a trivial cell on 4 and on 64 ranks (medians of ``cells`` cells), and where its CPU goes
  at 64: the notebook's process, the controller's, and the ranks' own, per cell and rank
  (psutil's CPU times of each process over the cells); the ranks' own CPU over this
  machine's cores (the least time a cell can take here); the same cell through ``%px``
  (plain ipyparallel) on the same 64 ranks;
- a restart of 64 ranks until a cell has run on every rank;
- 128 ranks: the start until a cell has run on every rank;
- 256 ranks: the same, and one cell.

Each part first asks the start's own room check (``Bench.fits``, which asks
spmd.cluster.launchers.processes) whether this machine has the free memory for its ranks now; a
part that does not fit is left out, with the check's sentence, into ``bench.left_out``, and the
bench goes on: ``make bench`` then prints its tables, and what it left out and why, below them.

On this 2-core machine the ranks' own CPU is on the same cores as the notebook's: on a real
cluster each host's ranks have their own, and what the notebook and the controller spend per
rank is what a person waits for.

``python -m benchmarks.many`` runs it alone; ``make bench`` runs it with the rest.
"""

from __future__ import annotations

import statistics
import sys
import time

import psutil


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def cells(bench, n: int, count: int) -> None:
    """A trivial cell on ``n`` ranks, ``count`` times; at 64 ranks or more, the CPU each
    process spent on them."""
    what = (f"{n} ranks: trivial cells" + (" and %px" if n >= 64 else "")
            + (", a restart" if n == 64 else ""))
    if not bench.fits(n, "none", what):
        return
    bench.cell(f"%spmd start -n {n} --backend none")
    try:
        session = bench.magics.session
        notebook = psutil.Process()
        controller = psutil.Process(session.record().cluster.controller.process.pid)
        ranks = [psutil.Process(r.pid) for r in session.ranks]
        for _ in range(5):
            bench.cell("x = 1")
        before = (_cpu(notebook), _cpu(controller), sum(map(_cpu, ranks)))
        for _ in range(count):
            t0 = time.perf_counter()
            bench.cell("x = 1")
            bench.record(f"cell_n{n}/none", time.perf_counter() - t0)
        after = (_cpu(notebook), _cpu(controller), sum(map(_cpu, ranks)))
        if n >= 64:
            spent = [b - a for a, b in zip(before, after)]
            for name, cpu in zip(("notebook", "controller", "ranks"), spent):
                bench.record(f"cpu_per_cell_and_rank_n{n}/{name}", cpu / count / n)
            # (the least time the ranks' own work takes on this machine's cores: a cell can
            # be no faster here, whatever the notebook and the controller do)
            bench.record(f"cell_n{n}/ranks_cpu_over_cores", spent[2] / count / psutil.cpu_count())
            px(bench, session, n, count)
        if n == 64:
            t0 = time.perf_counter()
            bench.cell("%spmd restart")
            bench.cell("x = 1")
            bench.record(f"restart/spmd_n{n}_none_forked", time.perf_counter() - t0)
    finally:
        bench.cell("%spmd stop")


def px(bench, session, n: int, count: int) -> None:
    """The same trivial cell through plain ipyparallel (``%px``) on the very same ranks."""
    view = session.record().client[[r.engine_id for r in session.ranks]]
    view.block = True
    view.activate()
    auto, bench.magics.auto.on = bench.magics.auto.on, False
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            bench.cell("%px x = 1")
            bench.record(f"cell_n{n}/px", time.perf_counter() - t0)
    finally:
        bench.magics.auto.on = auto


def start(bench, n: int) -> None:
    """``n`` ranks: the start until a cell has run on every rank, then one cell."""
    if not bench.fits(n, "none", f"{n} ranks: a start and a cell"):
        return
    t0 = time.perf_counter()
    bench.cell(f"%spmd start -n {n} --backend none")
    try:
        bench.cell("x = 1")
        bench.record(f"start_and_cell/spmd_n{n}_none", time.perf_counter() - t0)
        t0 = time.perf_counter()
        bench.cell("x = 1")
        bench.record(f"cell_n{n}/none", time.perf_counter() - t0)
    finally:
        bench.cell("%spmd stop")


def measure(bench, count: int = 30, cells_on: tuple = (4, 64),
            starts: tuple = (128, 256)) -> None:
    """Record the many-ranks figures into ``bench`` (benchmarks.bench.Bench): ``count`` trivial
    cells on each of ``cells_on`` ranks, a start of each of ``starts``; what does not fit here
    is left out."""
    for n in cells_on:
        cells(bench, n, count)
    for n in starts:
        start(bench, n)


if __name__ == "__main__":
    from benchmarks.bench import Bench

    bench = Bench()
    measure(bench, count=int(sys.argv[1]) if len(sys.argv) > 1 else 30)
    for name, xs in sorted(bench.samples.items()):
        print(f"{name}: median {statistics.median(xs) * 1000:.3f} ms "
              f"({min(xs) * 1000:.3f}-{max(xs) * 1000:.3f}), {len(xs)} runs")
    if "cell_n64/none" in bench.samples and "cell_n4/none" in bench.samples:
        ratio = (statistics.median(bench.samples["cell_n64/none"])
                 / statistics.median(bench.samples["cell_n4/none"]))
        print(f"trivial cell, 64 ranks over 4: {ratio:.1f}x")
    for what, why in bench.left_out.items():
        print(f"left out, {what}: {why}")
