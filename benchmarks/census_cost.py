"""The census's cost, measured inside the ranks (2 ranks, 1 CPU device each):

- 1,000 launches of a small jitted cross-process program (a sum over a global array of 4),
  through the census's wrapper and through jax's own jitted function under it (the census
  off), alternated in blocks in one cell, so that drift hits both alike;
- the same for 1,000 ``torch.distributed.all_reduce`` of 4 floats (gloo), wrapped and not,
  and wrapped under torch's own check (``--check-collectives``, a second cluster);
- the same launches through an empty Python wrapper (one that only calls through): the
  floor of any hook here. On this 2-core machine each rank's Python thread shares the cores
  with its own and the other rank's XLA and gloo threads, and the partner waits for it in
  every collective: a few microseconds of extra work a launch, even two attribute reads,
  moved a small launch by 5-15% in plain processes;
- the census's own work in one launch (is its result cross-process? then the record),
  without the launch: the figure that says what it costs;
- the hooks every cell pays (a record started and ended, no launch), per cell.

``python -m benchmarks.census_cost`` runs it alone; ``make bench`` runs it with the rest.
"""

from __future__ import annotations

import json
import statistics
import sys

JAX_SETUP = """import jax, numpy as np, time, json
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ('i',))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('i')), np.ones((2,), np.float32))
total = jax.jit(lambda x: x.sum())
bare = total._jitted  # (jax's own jitted function: what runs with the census off)
class Empty:  # (the floor of any hook: a Python call that only calls through)
    def __init__(self, f):
        self.f = f
    def __call__(self, *args, **kwargs):
        return self.f(*args, **kwargs)
empty = Empty(bare)
total(x).block_until_ready(); bare(x).block_until_ready(); empty(x).block_until_ready()"""

JAX_BLOCK = """def launches(f, n={n}):
    t0 = time.perf_counter()
    for _ in range(n):
        y = f(x)
    y.block_until_ready()
    return time.perf_counter() - t0
launched = {{'on': total, 'off': bare, 'empty': empty}}
times = {{mode: [] for mode in launched}}
modes = list(launched)
for block in range({blocks}):  # (each mode first in turn: no order favours one)
    for mode in modes[block % 3:] + modes[:block % 3]:
        times[mode].append(launches(launched[mode]))
if jax.process_index() == 0:
    print(json.dumps(times))"""

TORCH_BLOCK = """import torch, torch.distributed as dist, time, json
t = torch.ones(4)
wrapped, bare = dist.all_reduce, dist.all_reduce.__wrapped__
def launches(f, n={n}):
    t0 = time.perf_counter()
    for _ in range(n):
        f(t)
    return time.perf_counter() - t0
launches(wrapped, 10); launches(bare, 10)
times = {{'on': [], 'off': []}}
for block in range({blocks}):
    for mode in (('on', 'off') if block % 2 else ('off', 'on')):
        times[mode].append(launches(wrapped if mode == 'on' else bare))
if dist.get_rank() == 0:
    print(json.dumps(times))"""

# The census's own work in one launch: is the result cross-process, then the record (on a
# result already there: the launch itself left out).
RECORD = """import timeit
y = total(x); y.block_until_ready()
args, kwargs = (x,), {}
print(timeit.timeit(lambda: total.recorded(y, args, kwargs), number=20000) / 20000)"""

HOOKS = """import time
census = get_ipython().kernel.launches  # (the rank's census: spmd/engine/watch/launches.py)
t0 = time.perf_counter()
for i in range(10000):
    census.start_cell(f'bench-{i}')
    census.end_cell()
hooks = (time.perf_counter() - t0) / 10000
census.start_cell('bench-last')
print(hooks)"""


def _rank0(stdout: str) -> str:
    """The text rank 0 printed (its label taken off)."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith(("[rank 0] ", "[ranks 0")))
    return line.split("] ", 1)[1]


def measure(bench, launches: int = 1000, blocks: int = 10) -> None:
    """Record the census's figures into ``bench`` (benchmarks.bench.Bench)."""
    # (one CPU device per process: with two, jax's own queue of a thousand asynchronous
    # cross-process launches hangs here, with or without the census; seen in plain processes)
    bench.cell("%spmd start -n 2 -d 1")
    try:
        bench.cell(JAX_SETUP)
        said = json.loads(_rank0(bench.cell(JAX_BLOCK.format(n=launches, blocks=blocks))))
        for mode, xs in said.items():
            for x in xs:
                bench.record(f"census_jit_{launches}/{mode}", x)
        for _ in range(3):
            bench.record("census_cell_hooks/per_cell", float(_rank0(bench.cell(HOOKS))))
            bench.record("census_jit_record/per_launch", float(_rank0(bench.cell(RECORD))))
    finally:
        bench.cell("%spmd stop")
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    for checked in ("", " --check-collectives"):
        bench.cell(f"%spmd start -n 2 --backend torch{checked}")
        try:
            said = json.loads(_rank0(bench.cell(TORCH_BLOCK.format(n=launches, blocks=blocks))))
        finally:
            bench.cell("%spmd stop")
        for mode, xs in said.items():
            if checked:  # (torch's own check, with the census: against "off" of the first)
                mode = {"on": "checked"}.get(mode)
            for x in xs if mode else ():
                bench.record(f"census_torch_all_reduce_{launches}/{mode}", x)


if __name__ == "__main__":
    from benchmarks.bench import Bench

    bench = Bench()
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    measure(bench, launches=launches)
    for name, xs in bench.samples.items():
        print(f"{name}: median {statistics.median(xs) * 1000:.3f} ms "
              f"({min(xs) * 1000:.3f}-{max(xs) * 1000:.3f}), {len(xs)} runs")
    for kind in ("jit", "torch_all_reduce"):
        off = bench.samples.get(f"census_{kind}_{launches}/off")
        for mode in ("on", "empty", "checked"):
            xs = bench.samples.get(f"census_{kind}_{launches}/{mode}")
            if xs and off:
                print(f"{kind}: {mode} / off = {statistics.median(xs) / statistics.median(off):.3f}")
