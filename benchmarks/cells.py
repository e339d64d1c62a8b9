"""A cell's cost: a trivial cell beside the same through ``%px`` and a bare zmq round trip, on
the same engines; the live panel's cost on a trivial cell and on a one-second one; 10,000
lines of output from 4 ranks, beside ``%px`` (and whether they arrived whole, in rank
order); the notebook process's memory over many cells.

Each function takes the ``Bench`` (bench.py) and records its figures into it; run.py calls
them in turn.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import psutil

from benchmarks.floor import EchoServers


def per_cell(bench, n: int, cells: int) -> None:
    """A trivial cell, %px and a bare zmq round trip, alternated on the same n engines."""
    bench.cell(f"%spmd start -n {n} --backend jax")
    session = bench.magics.session
    view = session.record().client[[r.engine_id for r in session.ranks]]
    view.block = True
    view.activate()  # %px on the very same engines
    echo = EchoServers(n)
    try:
        for _ in range(cells):
            bench.magics.auto.on = True
            t0 = time.perf_counter()
            bench.cell("x = 1")
            bench.record(f"cell_n{n}/spmd", time.perf_counter() - t0)
            if n == 4:  # the live panel's cost: the same cell with it on
                bench.magics.panel = True
                t0 = time.perf_counter()
                bench.cell("x = 1")
                bench.record(f"cell_n{n}/spmd_panel", time.perf_counter() - t0)
                bench.magics.panel = False
            bench.magics.auto.on = False
            t0 = time.perf_counter()
            bench.cell("%px x = 1")
            bench.record(f"cell_n{n}/px", time.perf_counter() - t0)
            bench.record(f"cell_n{n}/zmq", echo.round_trip())
    finally:
        echo.close()
        bench.magics.auto.on = True
        bench.cell("%spmd stop")


def panel_while_running(bench, rounds: int) -> None:
    """A one-second cell with the live panel updating 4 times a second, and without."""
    bench.cell("%spmd start -n 4 --backend none")
    try:
        for _ in range(rounds):
            for name, on in (("sleep_1s_cell/spmd", False), ("sleep_1s_cell/spmd_panel", True)):
                bench.magics.panel = on
                t0 = time.perf_counter()
                bench.cell("import time\ntime.sleep(1.0)")
                bench.record(name, time.perf_counter() - t0)
    finally:
        bench.magics.panel = False
        bench.cell("%spmd stop")


def output(bench, lines: int, rounds: int) -> None:
    """``lines`` lines from each of 4 ranks, all shown (``--max-output all``), beside the same
    through ``%%px``; how each arrived (whole, in rank order) is recorded as a fact."""
    bench.cell("%spmd start -n 4 --backend none")
    session = bench.magics.session
    view = session.record().client[[r.engine_id for r in session.ranks]]
    view.block = True
    view.activate()
    code = f"import os\nr = os.environ['SPMD_RANK']\nfor i in range({lines}): print(r, i)"
    whole = "%%spmd --max-output all\n"  # (%px shows every line: so does this)
    try:
        for _ in range(rounds):
            bench.magics.auto.on = True
            t0 = time.perf_counter()
            shown = bench.cell(whole + code)
            bench.record("output/spmd", time.perf_counter() - t0)
            arrived = _arrival(shown, lines, "[rank {r}]\n")
            if arrived != "whole, in rank order":
                raise RuntimeError(f"spmd output arrived {arrived}")
            bench.facts["10,000 lines x 4 ranks/spmd"] = arrived
            bench.magics.auto.on = False
            t0 = time.perf_counter()
            shown = bench.cell("%%px\n" + code)
            bench.record("output/px", time.perf_counter() - t0)
            bench.facts["10,000 lines x 4 ranks/px"] = _arrival(shown, lines, "[stdout:{r}] ")
    finally:
        bench.magics.auto.on = True
        bench.cell("%spmd stop")


def memory(bench, cells: int) -> None:
    """What ``cells`` trivial cells grow the notebook process's RSS by, after 50 to warm it."""
    bench.cell("%spmd start -n 4 --backend none")
    try:
        for _ in range(50):  # warm caches first
            bench.cell("x = 1")
        before = psutil.Process().memory_info().rss
        for _ in range(cells):
            bench.cell("x = 1")
        growth = (psutil.Process().memory_info().rss - before) / 2**20
        bench.record(f"rss_growth_{cells}_cells_mb/spmd", growth)
    finally:
        bench.cell("%spmd stop")


def _arrival(shown: str, lines: int, label: str) -> str:
    """How a rank-tagged output arrived: 'whole, in rank order', or what went wrong."""
    seen: dict[int, set[int]] = defaultdict(set)
    for line in shown.splitlines():
        m = re.fullmatch(r"(?:\[\w+:\d+\] )?(\d) (\d+)", line)
        if m:
            seen[int(m[1])].add(int(m[2]))
    whole = all(len(seen[r]) == lines for r in range(4))
    at = [shown.find(label.format(r=r)) for r in range(4)]
    ordered = -1 not in at and at == sorted(at)
    return f"{'whole' if whole else 'lines missing or garbled'}, {'in' if ordered else 'not in'} rank order"
