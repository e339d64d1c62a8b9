"""Start, restart and stop: the cluster's life timed until a cell returns on every rank, beside
plain ipyparallel's (its engines initialized by hand through ``%px``, as a user does without
jupyter-spmd), and the memory the cluster's processes take beside the ranks' own.

Each function takes the ``Bench`` (bench.py) and records its figures into it; run.py calls
them in turn, a few rounds alternated with the floors (floor.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time

import psutil
from ipyparallel import Cluster

from benchmarks.bench import PSUM
from spmd.engine.join.address import free_port

# A jitted computation across every device of every process, compiled for ~1-2 s on 2 cores.
JIT_SETUP = (
    "import jax, jax.numpy as jnp\n"
    "from jax.sharding import NamedSharding, PartitionSpec as P\n"
    "mesh = jax.make_mesh((jax.device_count(),), ('x',), axis_types=(jax.sharding.AxisType.Auto,))\n"
    "xs = jax.device_put(jnp.ones((jax.device_count() * 8, 64)), NamedSharding(mesh, P('x')))"
)
JIT_CELL = (
    "@jax.jit\n"
    "def steps(x):\n"
    "    for i in range(40):\n"
    "        x = jnp.tanh(x @ (x.T @ x) / x.shape[0] + i)\n"
    "    return x.sum()\n"
    "steps(xs).block_until_ready()"
)
ALL_REDUCE = (
    "import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)"
)


def spmd_lifecycle(bench) -> None:
    """4 ranks of 2 devices: start until a psum returns, the processes' memory, a
    compile-heavy jitted cell before and after a restart, the restart itself, and stop."""
    t0 = time.perf_counter()
    bench.cell("%spmd start -n 4 -d 2")
    bench.cell(PSUM)
    bench.record("start_to_ready/spmd", time.perf_counter() - t0)
    _memory(bench)
    # A compile-heavy jitted cell over all 8 devices of the 4 processes, first run.
    bench.cell(JIT_SETUP)
    t0 = time.perf_counter()
    bench.cell(JIT_CELL)
    bench.record("jit_cell_first/spmd", time.perf_counter() - t0)
    t0 = time.perf_counter()
    bench.cell("%spmd restart")
    bench.cell(PSUM)
    bench.record("restart/spmd", time.perf_counter() - t0)
    # The same cell after the restart: compiled again, or read from the shared cache.
    bench.cell(JIT_SETUP)
    t0 = time.perf_counter()
    bench.cell(JIT_CELL)
    bench.record("jit_cell_after_restart/spmd", time.perf_counter() - t0)
    t0 = time.perf_counter()
    bench.cell("%spmd stop")
    bench.record("stop/spmd", time.perf_counter() - t0)


def _memory(bench) -> None:
    """The proportional set size of every process the cluster holds (controller, rank
    server, ranks), and of the ranks alone: what the rest costs on top of the ranks."""
    session = bench.magics.session
    ranks = [psutil.Process(r.pid) for r in session.ranks]
    others = [session.record().cluster.controller.process]
    if session.record().rank_server is not None:
        others.append(psutil.Process(session.record().rank_server.process.pid))
    others += session.record().cluster.controller.process.children(recursive=True)

    def pss(processes) -> float:
        return sum(p.memory_full_info().pss for p in processes) / 2**20

    own = pss(ranks)
    bench.record("memory_pss_mb/ranks", own)
    bench.record("memory_pss_mb/cluster", own + pss(others))


def many_ranks(bench, n: int, backend: str) -> None:
    """``n`` ranks on this machine: start until a cell returns on every rank, restart
    until the same, stop."""
    if not bench.fits(n, backend, f"{n} ranks ({backend}): a start and a restart"):
        return
    cell = PSUM if backend == "jax" else "import os"
    t0 = time.perf_counter()
    bench.cell(f"%spmd start -n {n} --backend {backend}")
    bench.cell(cell)
    bench.record(f"start_to_ready/spmd_n{n}_{backend}", time.perf_counter() - t0)
    t0 = time.perf_counter()
    bench.cell("%spmd restart")
    bench.cell(cell)
    bench.record(f"restart/spmd_n{n}_{backend}", time.perf_counter() - t0)
    bench.cell("%spmd stop")


def torch_lifecycle(bench) -> None:
    """4 ranks with --backend torch (gloo, tcp): start until an all_reduce returns, stop."""
    t0 = time.perf_counter()
    bench.cell("%spmd start -n 4 --backend torch")
    bench.cell(ALL_REDUCE)
    bench.record("start_to_ready/torch", time.perf_counter() - t0)
    t0 = time.perf_counter()
    bench.cell("%spmd stop")
    bench.record("stop/torch", time.perf_counter() - t0)


def ipyparallel_lifecycle(bench) -> None:
    """The same with plain ipyparallel: 4 engines started and initialized by hand until a
    psum returns, restarted the same way, stopped."""
    with tempfile.TemporaryDirectory(prefix="ipp-bench-") as profile:
        t0 = time.perf_counter()
        cluster = Cluster(n=4, profile_dir=profile, log_level=40, shutdown_atexit=True)
        client = cluster.start_and_connect_sync()
        _init_by_hand(client)
        bench.record("start_to_ready/ipyparallel", time.perf_counter() - t0)
        t0 = time.perf_counter()
        old = set(client.ids)
        cluster.restart_engines_sync()
        deadline = time.monotonic() + 120
        while len(set(client.ids) - old) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the restarted engines register with new ids
        _init_by_hand(client, ids=sorted(set(client.ids) - old))
        bench.record("restart/ipyparallel", time.perf_counter() - t0)
        client.close()
        t0 = time.perf_counter()
        cluster.stop_cluster_sync()
        bench.record("stop/ipyparallel", time.perf_counter() - t0)


def remote_lifecycle(bench, hosts) -> None:
    """4 ranks over SSH into two hosts (network namespaces on this machine), and 4 ranks
    through mpiexec: start until a psum returns, a restart (ssh: forked by the hosts'
    rank servers), and stop."""
    for name, start in (
        (
            "ssh",
            f"%spmd start -n 4 -d 2 --hosts {','.join(hosts.names)} "
            f"--python {hosts.python} {hosts.launcher_arg}",
        ),
        ("mpi", "%spmd start -n 4 -d 2 --launcher mpi"),
    ):
        if name == "mpi" and shutil.which("mpiexec") is None:
            continue
        t0 = time.perf_counter()
        bench.cell(start)
        bench.cell(PSUM)
        bench.record(f"start_to_ready/{name}", time.perf_counter() - t0)
        if name == "ssh":  # forked by each host's rank server
            t0 = time.perf_counter()
            bench.cell("%spmd restart")
            bench.cell(PSUM)
            bench.record("restart/ssh", time.perf_counter() - t0)
        t0 = time.perf_counter()
        bench.cell("%spmd stop")
        bench.record(f"stop/{name}", time.perf_counter() - t0)


def _init_by_hand(client, ids=None) -> None:
    """What a user does without us: jax.distributed.initialize through %px, then a psum."""
    ids = sorted(client.ids) if ids is None else ids
    addr = f"127.0.0.1:{free_port()}"
    pending = [
        client[eid].execute(
            "import jax\njax.config.update('jax_num_cpu_devices', 2)\n"
            f"jax.distributed.initialize('{addr}', {len(ids)}, {rank}, coordinator_bind_address='{addr}')",
            block=False,
        )
        for rank, eid in enumerate(ids)
    ]
    for ar in pending:
        ar.get(timeout=120)
    client[ids].execute(PSUM, block=True)
