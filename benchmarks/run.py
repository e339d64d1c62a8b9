"""``make bench``: jupyter-spmd's start, stop, restart, per-cell and output costs, side by side
with the bare floor and with plain ipyparallel, alternated within one run.

Absolute times on a shared 2-core machine drift; the ratios between figures taken in the same
round hold. Every figure is the median of its rounds, with the min-max. Results go to
``benchmarks/results.json``. ``--quick`` runs a one-minute subset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
from ipyparallel import Cluster
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from benchmarks import attach, census, debugger, many
from benchmarks.flood import flood
from benchmarks.floor import EchoServers, bare_processes, bare_torch_processes
from benchmarks.kernel import KernelBench
from spmd.engine.address import free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from hosts import Hosts, why_not  # noqa: E402 (the tests' namespace hosts)

PSUM = (
    "import jax\nxs = jax.numpy.ones(jax.local_device_count())\n"
    "jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs).block_until_ready()"
)
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
RESULTS = Path(__file__).with_name("results.json")
GRACE = 2.0  # the watchdog's default grace (spmd.cluster.session.Settings.grace)


class Bench:
    def __init__(self) -> None:
        self.shell = InteractiveShell.instance()
        self.shell.run_line_magic("load_ext", "spmd")
        self.magics = self.shell.magics_manager.registry["SpmdMagics"]
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.facts: dict[str, object] = {}
        self.left_out: dict[str, str] = {}  # a part not measured here -> why (many.fits)
        self.left_out_ranks: set[int] = set()  # the numbers of ranks of those parts

    def cell(self, code: str) -> str:
        with capture_output() as cap:
            result = self.shell.run_cell(code)
        if not result.success:
            raise RuntimeError(
                f"benchmark cell failed: {code!r}: {cap.stderr}{result.error_in_exec}"
            )
        return cap.stdout

    def record(self, name: str, seconds: float) -> None:
        self.samples[name].append(seconds)

    # -- start, stop, restart -----------------------------------------------------------

    def spmd_lifecycle(self) -> None:
        t0 = time.perf_counter()
        self.cell("%spmd start -n 4 -d 2")
        self.cell(PSUM)
        self.record("start_to_ready/spmd", time.perf_counter() - t0)
        self._memory()
        # A compile-heavy jitted cell over all 8 devices of the 4 processes, first run.
        self.cell(JIT_SETUP)
        t0 = time.perf_counter()
        self.cell(JIT_CELL)
        self.record("jit_cell_first/spmd", time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.cell("%spmd restart")
        self.cell(PSUM)
        self.record("restart/spmd", time.perf_counter() - t0)
        # The same cell after the restart: compiled again, or read from the shared cache.
        self.cell(JIT_SETUP)
        t0 = time.perf_counter()
        self.cell(JIT_CELL)
        self.record("jit_cell_after_restart/spmd", time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.cell("%spmd stop")
        self.record("stop/spmd", time.perf_counter() - t0)

    def _memory(self) -> None:
        """The proportional set size of every process the cluster holds (controller, rank
        server, ranks), and of the ranks alone: what the rest costs on top of the ranks."""
        session = self.magics.session
        ranks = [psutil.Process(r.pid) for r in session.ranks]
        others = [session.cluster.controller.process]
        if session.rank_server is not None:
            others.append(psutil.Process(session.rank_server.process.pid))
        others += session.cluster.controller.process.children(recursive=True)

        def pss(processes) -> float:
            return sum(p.memory_full_info().pss for p in processes) / 2**20

        own = pss(ranks)
        self.record("memory_pss_mb/ranks", own)
        self.record("memory_pss_mb/cluster", own + pss(others))

    def many_ranks(self, n: int, backend: str) -> None:
        """``n`` ranks on this machine: start until a cell returns on every rank, restart
        until the same, stop."""
        if not many.fits(self, n, backend, f"{n} ranks ({backend}): a start and a restart"):
            return
        cell = PSUM if backend == "jax" else "import os"
        t0 = time.perf_counter()
        self.cell(f"%spmd start -n {n} --backend {backend}")
        self.cell(cell)
        self.record(f"start_to_ready/spmd_n{n}_{backend}", time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.cell("%spmd restart")
        self.cell(cell)
        self.record(f"restart/spmd_n{n}_{backend}", time.perf_counter() - t0)
        self.cell("%spmd stop")

    def torch_lifecycle(self) -> None:
        """4 ranks with --backend torch (gloo, tcp): start until an all_reduce returns, stop."""
        t0 = time.perf_counter()
        self.cell("%spmd start -n 4 --backend torch")
        self.cell(ALL_REDUCE)
        self.record("start_to_ready/torch", time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.cell("%spmd stop")
        self.record("stop/torch", time.perf_counter() - t0)

    def ipyparallel_lifecycle(self) -> None:
        with tempfile.TemporaryDirectory(prefix="ipp-bench-") as profile:
            t0 = time.perf_counter()
            cluster = Cluster(n=4, profile_dir=profile, log_level=40, shutdown_atexit=True)
            client = cluster.start_and_connect_sync()
            _init_by_hand(client)
            self.record("start_to_ready/ipyparallel", time.perf_counter() - t0)
            t0 = time.perf_counter()
            old = set(client.ids)
            cluster.restart_engines_sync()
            deadline = time.monotonic() + 120
            while len(set(client.ids) - old) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)  # the restarted engines register with new ids
            _init_by_hand(client, ids=sorted(set(client.ids) - old))
            self.record("restart/ipyparallel", time.perf_counter() - t0)
            client.close()
            t0 = time.perf_counter()
            cluster.stop_cluster_sync()
            self.record("stop/ipyparallel", time.perf_counter() - t0)

    def remote_lifecycle(self, hosts) -> None:
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
            self.cell(start)
            self.cell(PSUM)
            self.record(f"start_to_ready/{name}", time.perf_counter() - t0)
            if name == "ssh":  # forked by each host's rank server
                t0 = time.perf_counter()
                self.cell("%spmd restart")
                self.cell(PSUM)
                self.record("restart/ssh", time.perf_counter() - t0)
            t0 = time.perf_counter()
            self.cell("%spmd stop")
            self.record(f"stop/{name}", time.perf_counter() - t0)

    # -- faults: how soon the notebook says what went wrong, and how fast it recovers ------

    def faults(self) -> None:
        """A rank that raises before a psum, a rank killed in a collective (rank 0, then the
        last rank); each report is timed, and so is the restart after it."""
        setup = "import os, time, jax\nrank = jax.process_index()\n" + PSUM
        self.cell("%spmd start -n 4 -d 2")
        self.cell(setup)
        t0 = time.perf_counter()
        self._failing_cell(f"if rank == 0:\n    raise ValueError('diverge')\n{PSUM}")
        total = time.perf_counter() - t0
        self.record("divergence_report/spmd", total)
        self.record("divergence_report_beyond_grace/spmd", total - GRACE)
        self._restart(setup)
        for victim, sleeper in ((0, 3), (3, 0)):
            pid = self.magics.session.ranks[victim].pid
            killed_at: list[float] = []

            def kill(pid: int = pid, killed_at: list[float] = killed_at) -> None:
                killed_at.append(time.perf_counter())
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(1.0, kill)
            timer.start()
            self._failing_cell(
                f"%%spmd --grace off\nif rank == {sleeper}:\n    time.sleep(60)\n{PSUM}"
            )
            self.record(f"death_report_rank{victim}/spmd", time.perf_counter() - killed_at[0])
            timer.join()
            self._restart(setup)
        self.cell("%spmd stop")

    def _failing_cell(self, code: str) -> None:
        with capture_output():
            result = self.shell.run_cell(code)
        if result.success:
            raise RuntimeError(f"benchmark cell was meant to fail: {code!r}")

    def _restart(self, setup: str) -> None:
        t0 = time.perf_counter()
        self.cell("%spmd restart")
        self.cell(setup)
        self.record("restart_after_fault/spmd", time.perf_counter() - t0)

    # -- per cell -----------------------------------------------------------------------

    def per_cell(self, n: int, cells: int) -> None:
        """A trivial cell, %px and a bare zmq round trip, alternated on the same n engines."""
        self.cell(f"%spmd start -n {n} --backend jax")
        session = self.magics.session
        view = session.client[[r.engine_id for r in session.ranks]]
        view.block = True
        view.activate()  # %px on the very same engines
        echo = EchoServers(n)
        try:
            for _ in range(cells):
                self.magics.auto.on = True
                t0 = time.perf_counter()
                self.cell("x = 1")
                self.record(f"cell_n{n}/spmd", time.perf_counter() - t0)
                if n == 4:  # the live panel's cost: the same cell with it on
                    self.magics.panel = True
                    t0 = time.perf_counter()
                    self.cell("x = 1")
                    self.record(f"cell_n{n}/spmd_panel", time.perf_counter() - t0)
                    self.magics.panel = False
                self.magics.auto.on = False
                t0 = time.perf_counter()
                self.cell("%px x = 1")
                self.record(f"cell_n{n}/px", time.perf_counter() - t0)
                self.record(f"cell_n{n}/zmq", echo.round_trip())
        finally:
            echo.close()
            self.magics.auto.on = True
            self.cell("%spmd stop")

    def value_cells(self, cells: int) -> None:
        """A cell whose value is one jax.Array over 4 processes (8x4, and 8192x8192: only its
        printed corners travel), beside the same cell ending in None."""
        self.cell("%spmd start -n 4 -d 2")
        self.cell(
            "import jax, jax.numpy as jnp\n"
            "from jax.sharding import NamedSharding, PartitionSpec as P\n"
            "mesh = jax.make_mesh((4, 2), ('x', 'y'))\n"
            "small = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P('x', 'y')))\n"
            "big = jax.jit(lambda: jnp.arange(8192 * 8192, dtype=jnp.float32).reshape(8192, 8192), "
            "out_shardings=NamedSharding(mesh, P('x', 'y')))()"
        )
        try:
            for _ in range(cells):
                for name, code in (("none", "small; None"), ("global_8x4", "small"),
                                   ("global_8192sq", "big")):
                    t0 = time.perf_counter()
                    self.cell(code)
                    self.record(f"value_cell/{name}", time.perf_counter() - t0)
        finally:
            self.cell("%spmd stop")

    def printed_loops(self, rounds: int) -> None:
        """A loop that prints an array over 4 processes 1,000 times (the same one, and a new
        one each step: past the 100 a cell rebuilds), one that prints an array processes 0-1
        hold (the others print its holders' text), and one that displays it 1,000 times,
        beside the same loops with an array each process holds whole."""
        self.cell("%spmd start -n 4 -d 2")
        self.cell(
            "import jax, jax.numpy as jnp\n"
            "from jax.sharding import NamedSharding, PartitionSpec as P\n"
            "mesh = jax.make_mesh((8,), ('x',))\n"
            "spread = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('x')))\n"
            "local = jnp.arange(8.0)\n"
            "import numpy as np\n"  # (copied on processes 0-1's devices: the others hold none)
            "first4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('x',))\n"
            "held = jax.device_put(jnp.arange(8.0), NamedSharding(first4, P()))"
        )
        try:
            for _ in range(rounds):
                for name, code in (("local", "for i in range(1000):\n    print(local)"),
                                   ("global_same", "for i in range(1000):\n    print(spread)"),
                                   ("global_new", "for i in range(1000):\n    print(spread + i)"),
                                   ("local_new", "for i in range(1000):\n    print(local + i)"),
                                   ("held_same", "for i in range(1000):\n    print(held)"),
                                   ("display_local", "for i in range(1000):\n    display(local)"),
                                   ("display_global", "for i in range(1000):\n    display(spread)")):
                    t0 = time.perf_counter()
                    self.cell(code)
                    self.record(f"print_loop_1000/{name}", time.perf_counter() - t0)
        finally:
            self.cell("%spmd stop")

    def dtensor_value_cells(self, cells: int) -> None:
        """A cell whose value is one torch DTensor over 4 processes (8x4, and 2048x2048:
        only its printed corners travel), beside the same cell ending in None; and a loop
        printing the 8x4 one 1,000 times, beside one printing a tensor each process holds."""
        self.cell("%spmd start -n 4 --backend torch")
        self.cell(
            "import torch\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import distribute_tensor, Shard\n"
            "mesh = init_device_mesh('cpu', (4,))\n"
            "small = distribute_tensor(torch.arange(32.).reshape(8, 4), mesh, [Shard(0)])\n"
            "big = distribute_tensor(torch.ones(2048, 2048), mesh, [Shard(1)])\n"
            "whole = torch.arange(32.).reshape(8, 4)"
        )
        try:
            for _ in range(cells):
                for name, code in (("dtensor_none", "small; None"), ("dtensor_8x4", "small"),
                                   ("dtensor_2048sq", "big")):
                    t0 = time.perf_counter()
                    self.cell(code)
                    self.record(f"value_cell/{name}", time.perf_counter() - t0)
            for _ in range(3):  # (print of a DTensor 1,000 times, beside a tensor each holds)
                for name, code in (("tensor", "for i in range(1000):\n    print(whole)"),
                                   ("dtensor", "for i in range(1000):\n    print(small)")):
                    t0 = time.perf_counter()
                    self.cell(code)
                    self.record(f"print_loop_1000/{name}", time.perf_counter() - t0)
        finally:
            self.cell("%spmd stop")

    def panel_while_running(self, rounds: int) -> None:
        """A one-second cell with the live panel updating 4 times a second, and without."""
        self.cell("%spmd start -n 4 --backend none")
        try:
            for _ in range(rounds):
                for name, on in (("sleep_1s_cell/spmd", False), ("sleep_1s_cell/spmd_panel", True)):
                    self.magics.panel = on
                    t0 = time.perf_counter()
                    self.cell("import time\ntime.sleep(1.0)")
                    self.record(name, time.perf_counter() - t0)
        finally:
            self.magics.panel = False
            self.cell("%spmd stop")

    def flood(self, lines: int) -> None:
        """A million lines from every rank, and from a plain kernel, executed as notebooks."""
        for name, ranks in (("spmd", 2), ("plain_kernel", None)):
            got = flood(lines, ranks)
            self.record(f"flood_1M_lines/{name}", got["seconds"])
            self.record(f"flood_memory_mb/{name}", got["memory_mb"])
            self.record(f"flood_saved_mb/{name}", got["saved_mb"])

    def output(self, lines: int, rounds: int) -> None:
        self.cell("%spmd start -n 4 --backend none")
        session = self.magics.session
        view = session.client[[r.engine_id for r in session.ranks]]
        view.block = True
        view.activate()
        code = f"import os\nr = os.environ['SPMD_RANK']\nfor i in range({lines}): print(r, i)"
        whole = "%%spmd --max-output all\n"  # (%px shows every line: so does this)
        try:
            for _ in range(rounds):
                self.magics.auto.on = True
                t0 = time.perf_counter()
                shown = self.cell(whole + code)
                self.record("output/spmd", time.perf_counter() - t0)
                arrived = _arrival(shown, lines, "[rank {r}]\n")
                if arrived != "whole, in rank order":
                    raise RuntimeError(f"spmd output arrived {arrived}")
                self.facts["10,000 lines x 4 ranks/spmd"] = arrived
                self.magics.auto.on = False
                t0 = time.perf_counter()
                shown = self.cell("%%px\n" + code)
                self.record("output/px", time.perf_counter() - t0)
                self.facts["10,000 lines x 4 ranks/px"] = _arrival(shown, lines, "[stdout:{r}] ")
        finally:
            self.magics.auto.on = True
            self.cell("%spmd stop")

    def memory(self, cells: int) -> None:
        self.cell("%spmd start -n 4 --backend none")
        try:
            for _ in range(50):  # warm caches first
                self.cell("x = 1")
            before = psutil.Process().memory_info().rss
            for _ in range(cells):
                self.cell("x = 1")
            growth = (psutil.Process().memory_info().rss - before) / 2**20
            self.record(f"rss_growth_{cells}_cells_mb/spmd", growth)
        finally:
            self.cell("%spmd stop")


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


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def summarize(samples: dict[str, list[float]]) -> dict[str, dict]:
    return {
        name: {
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "runs": len(xs),
        }
        for name, xs in samples.items()
    }


TARGETS = [
    # (figure, anchor, target ratio or None, what the target says)
    ("start_to_ready/spmd", "start_to_ready/floor", 0.6, "≤ 0.6 × floor"),
    ("start_to_ready/spmd_n16_jax", "start_to_ready/floor_n16", 0.6, "≤ 0.6 × floor"),
    ("restart/spmd_n16_jax", "start_to_ready/floor_n16", 0.3, "≤ 0.3 × floor"),
    ("memory_pss_mb/cluster", "memory_pss_mb/ranks", 1.45, "≤ 1.45 × the ranks' own"),
    ("start_to_ready/spmd", "start_to_ready/ipyparallel", None, ""),
    ("stop/spmd", "stop/ipyparallel", None, "≤ 1 s"),
    ("restart/spmd", "start_to_ready/floor", 0.3, "≤ 0.3 × floor"),
    ("restart/spmd", "restart/ipyparallel", None, ""),
    ("jit_cell_after_restart/spmd", "jit_cell_first/spmd", 0.3, "≤ 0.3 × first run"),
    ("cell_n4/spmd_panel", "cell_n4/spmd", None, ""),
    ("sleep_1s_cell/spmd_panel", "sleep_1s_cell/spmd", 1.02, "≤ 1.02 × without the panel"),
    ("flood_1M_lines/spmd", "flood_1M_lines/plain_kernel", None, ""),
    ("cell_n2/spmd", "cell_n2/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n4/spmd", "cell_n4/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n8/spmd", "cell_n8/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n4/spmd", "cell_n4/zmq", None, ""),
    ("debugger_cell_n4/attached", "debugger_cell_n4/detached", 1.2, "≤ 1.2 × detached"),
    ("debugger_cell_n4/attached", "debugger_cell_n4/never_attached", None, ""),
    ("census_jit_1000/on", "census_jit_1000/off", 1.03, "≤ 1.03 × without the census"),
    ("cell_n64/none", "cell_n4/none", 6.0, "≤ 6 × 4 ranks"),
    ("cell_n64/none", "cell_n64/ranks_cpu_over_cores", None, ""),
    ("cell_n64/none", "cell_n64/px", 1.0, "≤ 1.0 × %px"),
    ("census_jit_1000/empty", "census_jit_1000/off", None, ""),
    ("census_torch_all_reduce_1000/on", "census_torch_all_reduce_1000/off", None, ""),
    ("census_torch_all_reduce_1000/checked", "census_torch_all_reduce_1000/off", None, ""),
    ("value_cell/global_8x4", "value_cell/none", None, ""),
    ("value_cell/global_8192sq", "value_cell/none", None, ""),
    ("value_cell/dtensor_8x4", "value_cell/dtensor_none", None, ""),
    ("value_cell/dtensor_2048sq", "value_cell/dtensor_none", None, ""),
    ("output/spmd", "output/px", 1.0, "≤ 1.0 × %px"),
    ("print_loop_1000/global_same", "print_loop_1000/local", None, ""),
    ("print_loop_1000/global_new", "print_loop_1000/local_new", None, ""),
    ("print_loop_1000/held_same", "print_loop_1000/local", None, ""),
    ("print_loop_1000/display_global", "print_loop_1000/display_local", None, ""),
    ("print_loop_1000/dtensor", "print_loop_1000/tensor", None, ""),
    ("restart_after_fault/spmd", "start_to_ready/spmd", 1.5, "≤ 1.5 × a fresh start"),
    ("first_result/kernel", "first_result/magic", 1.0, "≤ 1.0 × the magic"),
    ("first_result/kernel", "start_to_ready/floor", 0.8, "≤ 0.8 × floor"),
    ("start_to_ready/ssh", "start_to_ready/spmd", 1.2, "≤ 1.2 × local"),
    ("restart/ssh", "start_to_ready/ssh", 0.3, "≤ 0.3 × an ssh start"),
    ("stop/ssh", "stop/spmd", None, ""),
    ("start_to_ready/mpi", "start_to_ready/spmd", None, ""),
    ("start_to_ready/torch", "start_to_ready/torch_floor", 0.6, "≤ 0.6 × floor"),
    ("stop/torch", "stop/spmd", None, ""),
    ("stop/mpi", "stop/spmd", None, ""),
    ("attach_to_first_result/spmd_n4", "attach_to_first_result/fresh_start_n4", None,
     "< 1 s"),
    ("attach_to_first_result/spmd_n4", "attach_to_first_result/cell_alone_n4", None, ""),
    ("attach_to_first_result/spmd_n64", "attach_to_first_result/fresh_start_n64", None, ""),
    ("attach_to_first_result/spmd_n64", "attach_to_first_result/cell_alone_n64", None, ""),
]

# Detection times: absolute, from the fault to the failed cell in the notebook. Plain
# ipyparallel has no figure here: its cells wait for ever.
DETECTION = [
    ("divergence_report/spmd", GRACE + 2.0, "≤ grace (2 s) + 2 s"),
    ("divergence_report_beyond_grace/spmd", 2.0, "≤ 2 s"),
    ("death_report_rank0/spmd", 2.0, "≤ 2 s"),
    ("death_report_rank3/spmd", 2.0, "≤ 2 s"),
    ("debugger_stop_n4/execute_to_stopped", 1.0, "≤ 1 s"),
    ("start_to_ready/spmd_n64_none", 5.0, "≤ 5 s"),
    ("restart/spmd_n64_none", 2.0, "≤ 2 s"),
    ("restart/spmd_n64_none_forked", 2.0, "≤ 2 s"),
    ("start_and_cell/spmd_n128_none", 10.0, "≤ 10 s"),
    ("start_and_cell/spmd_n256_none", None, "runs"),
    ("cpu_per_cell_and_rank_n64/notebook", 0.00025, "≤ 0.25 ms"),
    ("cpu_per_cell_and_rank_n64/controller", 0.00025, "≤ 0.25 ms"),
    ("cpu_per_cell_and_rank_n64/ranks", None, ""),
]


# The table's rows that compare memory: their figures are shown to 3 digits, without min-max,
# and their ratio to 3 places.
MEMORY = [("flood_memory_mb/spmd", "flood_memory_mb/plain_kernel"),
          ("flood_saved_mb/spmd", "flood_saved_mb/plain_kernel")]


def median_text(name: str, s: dict) -> str:
    """A figure's median as the table shows it: "1.15 s", "9.56 ms", "318 MB"."""
    m = s["median"]
    if name.startswith(("flood_memory_mb/", "flood_saved_mb/")):
        return f"{m:.3g} MB"
    if name.startswith("rss_growth"):
        return f"{m:.1f} MB"
    if "_mb/" in name:
        return f"{m:.0f} MB"
    unit, k = ("ms", 1000) if m < 0.5 else ("s", 1)
    return f"{m * k:.3g} {unit}"


def figure_text(name: str, s: dict) -> str:
    """A figure as the table's columns of figures show it: the median and (min-max)."""
    if "_mb/" in name:
        said = f"{median_text(name, s)} ({s['min']:.0f}-{s['max']:.0f})"
    else:
        k = 1000 if s["median"] < 0.5 else 1
        said = f"{median_text(name, s)} ({s['min'] * k:.3g}-{s['max'] * k:.3g})"
    # (a part this run left out: the earlier run's figure, carry_over)
    return said + (f", from the run of {s['carried_over']}" if s.get("carried_over") else "")


def ratio_text(fig: str, anchor: str, stats: dict[str, dict]) -> str:
    """The table's ratio of ``fig``'s median to ``anchor``'s: "0.44"."""
    ratio = stats[fig]["median"] / stats[anchor]["median"]
    return f"{ratio:.3f}" if (fig, anchor) in MEMORY else f"{ratio:.2f}"


def ratio_rows(stats: dict[str, dict]) -> list[tuple[str, str]]:
    """The (figure, anchor) of every row of the table that has a ratio, in its order."""
    pairs = [(fig, anchor) for fig, anchor, *_ in TARGETS] + MEMORY
    return [(fig, anchor) for fig, anchor in pairs if fig in stats and anchor in stats]


def table(stats: dict[str, dict]) -> str:
    def fmt(name: str) -> str:
        return figure_text(name, stats[name])

    rows = [("figure", "median (min-max)", "anchor", "anchor median", "ratio", "target")]
    for fig, anchor, limit, says in TARGETS:
        if fig not in stats or anchor not in stats:
            continue
        ratio = stats[fig]["median"] / stats[anchor]["median"]
        if fig == "stop/spmd":
            verdict = "met" if stats[fig]["median"] <= 1.0 else "missed"
        elif limit is not None:
            verdict = "met" if ratio <= limit else "missed"
        else:
            verdict = ""
        rows.append((fig, fmt(fig), anchor, fmt(anchor), ratio_text(fig, anchor, stats),
                     f"{says} {verdict}".strip()))
    for name, limit, says in DETECTION:
        if name in stats:
            verdict = "" if limit is None else (
                "met" if stats[name]["median"] <= limit else "missed")
            rows.append((name, fmt(name), "", "", "", f"{says} {verdict}".strip()))
    for ours, plain in MEMORY:
        if ours in stats and plain in stats:
            rows.append((ours, median_text(ours, stats[ours]), plain,
                         median_text(plain, stats[plain]), ratio_text(ours, plain, stats), ""))
    for name in stats:
        if name.startswith("rss_growth"):
            mb = stats[name]["median"]
            rows.append((name, median_text(name, stats[name]), "", "", "",
                         f"< 20 MB {'met' if mb < 20 else 'missed'}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def run_all(bench: Bench, rounds: int, quick: bool, hosts) -> None:
    for i in range(rounds):
        print(f"round {i + 1}/{rounds}: start, restart, stop", file=sys.stderr, flush=True)
        bench.record("start_to_ready/floor", bare_processes())
        bench.spmd_lifecycle()
        print(f"round {i + 1}/{rounds}: 16 and 64 ranks", file=sys.stderr, flush=True)
        bench.record("start_to_ready/floor_n16", bare_processes(16, 1))
        bench.many_ranks(16, "jax")
        if not quick:
            bench.many_ranks(64, "none")
        if not quick:
            bench.ipyparallel_lifecycle()
        if _has_torch():
            print(f"round {i + 1}/{rounds}: torch", file=sys.stderr, flush=True)
            bench.record("start_to_ready/torch_floor", bare_torch_processes())
            bench.torch_lifecycle()
        if hosts is not None:
            print(f"round {i + 1}/{rounds}: ssh and mpi", file=sys.stderr, flush=True)
            bench.remote_lifecycle(hosts)
        print(f"round {i + 1}/{rounds}: faults", file=sys.stderr, flush=True)
        bench.faults()
        print(f"round {i + 1}/{rounds}: kernel", file=sys.stderr, flush=True)
        with KernelBench() as kernels:
            bench.record("first_result/kernel", kernels.spmd_kernel(PSUM))
            bench.record("first_result/magic", kernels.magic_in_python3(PSUM))
    sizes = (4,) if quick else (2, 4, 8)
    cells = 30 if quick else 100
    for n in sizes:
        print(f"per-cell overhead, {n} ranks", file=sys.stderr, flush=True)
        bench.per_cell(n, cells)
    print("JupyterLab's debugger, 4 ranks", file=sys.stderr, flush=True)
    for name, xs in debugger.measure(cells=cells, stops=5 if quick else 10).items():
        for x in xs:
            bench.record(name, x)
    print("many ranks: 4 and 64, a restart of 64, 128 and 256", file=sys.stderr, flush=True)
    many.measure(bench, count=10 if quick else 30, starts=(128,) if quick else (128, 256))
    print("attach to a lingering cluster: 4 and 64 ranks", file=sys.stderr, flush=True)
    attach.measure(bench, rounds=1 if quick else 3)
    print("the census, 2 ranks", file=sys.stderr, flush=True)
    census.measure(bench, blocks=4 if quick else 10)
    print("a global array as a cell's value", file=sys.stderr, flush=True)
    bench.value_cells(cells=20 if quick else 50)
    if _has_torch():
        bench.dtensor_value_cells(cells=20 if quick else 50)
    print("print() of a global array in a loop", file=sys.stderr, flush=True)
    bench.printed_loops(rounds=1 if quick else 3)
    print("the panel on a one-second cell", file=sys.stderr, flush=True)
    bench.panel_while_running(rounds=2 if quick else 5)
    print("a million lines", file=sys.stderr, flush=True)
    bench.flood(lines=100_000 if quick else 1_000_000)
    print("output, 4 ranks", file=sys.stderr, flush=True)
    bench.output(lines=10_000, rounds=1 if quick else 3)
    print("memory", file=sys.stderr, flush=True)
    bench.memory(cells=200 if quick else 1000)


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


def carry_over(figures: dict[str, dict], left_out_ranks: set[int], previous: Path) -> list[str]:
    """Add to ``figures`` the earlier run's (``previous``, the results.json it wrote) of the
    parts this run left out for want of room (those of ``left_out_ranks`` ranks: ``_n64`` in
    their names), each marked ``carried_over`` with that run's date, so that the pages that
    quote them still build; their names."""
    try:
        earlier = json.loads(previous.read_text())
        date = earlier.get("date") or time.strftime(
            "%Y-%m-%d", time.localtime(previous.stat().st_mtime))
        old = dict(earlier["figures"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    names = re.compile("|".join(rf"_n{n}(?![0-9])" for n in sorted(left_out_ranks)) or "(?!)")
    carried = []
    for name, s in old.items():
        if name not in figures and names.search(name) and isinstance(s, dict):
            figures[name] = {**s, "carried_over": s.get("carried_over") or date}
            carried.append(name)
    return carried


def machine() -> str:
    return f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, {sys.platform}"


def summary(bench: Bench) -> str:
    """What ``make bench`` prints at its end: the table, the facts, and the parts this machine
    had no room for, each with why."""
    lines = [f"\njupyter-spmd benchmarks on {machine()}; ratios from one run\n",
             table(summarize(bench.samples))]
    lines += [f"{name}: {value}" for name, value in bench.facts.items()]
    if bench.left_out:
        lines += ["", f"Left out ({len(bench.left_out)}): this machine had no room for them "
                  "when their turn came."]
        lines += [f"- {what}: {why}" for what, why in bench.left_out.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
