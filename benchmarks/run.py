"""``make bench``: jupyter-spmd's start, stop, restart, per-cell and output costs, side by side
with the bare floor and with plain ipyparallel, alternated within one run.

Absolute times on a shared 2-core machine drift; the ratios between figures taken in the same
round hold. Every figure is the median of its rounds, with the min-max. Results go to
``benchmarks/results.json``. ``--quick`` runs a one-minute subset.

The parts: bench.py (the notebook they drive and what they record), lifecycle.py (start,
restart, stop), faults.py, cells.py (a cell's cost, output), arrays.py (a global array as a
value and in print), many.py, census_cost.py, attach.py, debugger.py, debugger_server.py (beside
jupyter-distributed, where it is installed), flood.py, kernel_start.py and
floor.py (the floors); table.py sums up and shows what they recorded. This module only runs
them in order and writes the results; it is the one module that imports the parts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

from benchmarks import (
    arrays,
    attach,
    cells,
    census_cost,
    debugger,
    debugger_server,
    faults,
    flood,
    lifecycle,
    many,
)
from benchmarks.bench import PSUM, Bench
from benchmarks.floor import bare_processes, bare_torch_processes
from benchmarks.kernel_start import KernelBench
from benchmarks.table import RESULTS, carry_over, machine, summarize, summary

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from hosts import Hosts, why_not  # noqa: E402 (the tests' namespace hosts)


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def run_all(bench: Bench, rounds: int, quick: bool, hosts) -> None:
    for i in range(rounds):
        print(f"round {i + 1}/{rounds}: start, restart, stop", file=sys.stderr, flush=True)
        bench.record("start_to_ready/floor", bare_processes())
        lifecycle.spmd_lifecycle(bench)
        print(f"round {i + 1}/{rounds}: 16 and 64 ranks", file=sys.stderr, flush=True)
        bench.record("start_to_ready/floor_n16", bare_processes(16, 1))
        lifecycle.many_ranks(bench, 16, "jax")
        if not quick:
            lifecycle.many_ranks(bench, 64, "none")
        if not quick:
            lifecycle.ipyparallel_lifecycle(bench)
        if _has_torch():
            print(f"round {i + 1}/{rounds}: torch", file=sys.stderr, flush=True)
            bench.record("start_to_ready/torch_floor", bare_torch_processes())
            lifecycle.torch_lifecycle(bench)
        if hosts is not None:
            print(f"round {i + 1}/{rounds}: ssh and mpi", file=sys.stderr, flush=True)
            lifecycle.remote_lifecycle(bench, hosts)
        print(f"round {i + 1}/{rounds}: faults", file=sys.stderr, flush=True)
        faults.measure(bench)
        print(f"round {i + 1}/{rounds}: kernel", file=sys.stderr, flush=True)
        with KernelBench() as kernels:
            bench.record("first_result/kernel", kernels.spmd_kernel(PSUM))
            bench.record("first_result/magic", kernels.magic_in_python3(PSUM))
    sizes = (4,) if quick else (2, 4, 8)
    count = 30 if quick else 100  # trivial cells per size, and cells of the debugger
    for n in sizes:
        print(f"per-cell overhead, {n} ranks", file=sys.stderr, flush=True)
        cells.per_cell(bench, n, count)
    print("JupyterLab's debugger, 4 ranks", file=sys.stderr, flush=True)
    for name, xs in debugger.measure(cells=count, stops=5 if quick else 10).items():
        for x in xs:
            bench.record(name, x)
    print("JupyterLab's debugger through one Jupyter Server, beside jupyter-distributed",
          file=sys.stderr, flush=True)
    samples, said = debugger_server.measure(rounds=3 if quick else 10)
    print(f"  {said}", file=sys.stderr, flush=True)
    for name, xs in samples.items():
        for x in xs:
            bench.record(name, x)
    print("many ranks: 4 and 64, a restart of 64, 128 and 256", file=sys.stderr, flush=True)
    many.measure(bench, count=10 if quick else 30, starts=(128,) if quick else (128, 256))
    print("attach to a lingering cluster: 4 and 64 ranks", file=sys.stderr, flush=True)
    attach.measure(bench, rounds=1 if quick else 3)
    print("the census, 2 ranks", file=sys.stderr, flush=True)
    census_cost.measure(bench, blocks=4 if quick else 10)
    print("a global array as a cell's value", file=sys.stderr, flush=True)
    arrays.value_cells(bench, cells=20 if quick else 50)
    if _has_torch():
        arrays.dtensor_value_cells(bench, cells=20 if quick else 50)
    print("print() of a global array in a loop", file=sys.stderr, flush=True)
    arrays.printed_loops(bench, rounds=1 if quick else 3)
    print("the panel on a one-second cell", file=sys.stderr, flush=True)
    cells.panel_while_running(bench, rounds=2 if quick else 5)
    print("a million lines", file=sys.stderr, flush=True)
    flood.measure(bench, lines=100_000 if quick else 1_000_000)
    print("output, 4 ranks", file=sys.stderr, flush=True)
    cells.output(bench, lines=10_000, rounds=1 if quick else 3)
    print("memory", file=sys.stderr, flush=True)
    cells.memory(bench, cells=200 if quick else 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a one-minute subset")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    # A benchmark stopped with SIGTERM still ends the clusters it started (atexit runs).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # Two SSH hosts in network namespaces, where this machine can make them (root).
        hosts = None if why_not() else stack.enter_context(Hosts(2))
        run_all(bench, rounds, args.quick, hosts)
    figures = summarize(bench.samples)
    carried = carry_over(figures, bench.left_out_ranks, RESULTS)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine(),
                "date": time.strftime("%Y-%m-%d"),
                "quick": args.quick,
                "rounds": rounds,
                "seconds": round(time.perf_counter() - started, 1),
                "figures": figures,
                "facts": bench.facts,
                "left_out": bench.left_out,
            },
            indent=2,
        )
    )
    print(summary(bench))
    if carried:
        print(f"\ncarried over from the earlier run, for the parts left out: {', '.join(carried)}")
    print(f"\nwritten to {RESULTS} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
