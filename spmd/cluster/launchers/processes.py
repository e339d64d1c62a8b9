"""The processes of a cluster on this machine: room for them, ending them by handle, and
how one ended."""

from __future__ import annotations

import os
import signal
import time

import psutil

from spmd.cluster.launchers.launch import SpmdCluster


class StartRefused(RuntimeError):
    """This machine cannot hold the ranks asked for; the text says why and what to do."""


# What one rank needs on this machine to start and run a first cell, by backend: its own
# memory (PSS: a forked rank shares the pages its rank server imported until it writes them),
# measured on 8 ranks after a trivial cell, twice over for what its first cells add. A rank
# with its own Python (no rank server) holds its imports alone. (MiB; measured: forked
# none 27, jax 36, torch 46, jax,torch 58; own Python none 39, jax 93.)
FORKED_MIB = {"none": 64, "jax": 96, "torch": 128, "jax,torch": 160}
OWN_PYTHON_MIB = {"none": 96, "jax": 256, "torch": 320, "jax,torch": 448}


def rank_mib(backend: str, forked: bool) -> int:
    """The memory one rank is counted for, in MiB."""
    backend = "jax,torch" if set(backend.split(",")) == {"jax", "torch"} else backend
    return (FORKED_MIB if forked else OWN_PYTHON_MIB).get(backend, OWN_PYTHON_MIB["jax,torch"])


def max_local_ranks(backend: str = "jax", forked: bool = False) -> int:
    """How many ranks this machine has room for now, by free memory."""
    return max(1, int(psutil.virtual_memory().available // (rank_mib(backend, forked) << 20)))


def check_room(n: int, backend: str = "jax", forked: bool = False) -> None:
    room = max_local_ranks(backend, forked)
    if n > room:
        free = psutil.virtual_memory().available / 2**30
        how = "forked by the rank server" if forked else "each its own Python"
        raise StartRefused(
            f"-n {n} is more ranks than this machine has room for: each needs about "
            f"{rank_mib(backend, forked)} MiB ({backend}, {how}) and {free:.1f} GiB is free, "
            f"enough for {room}: start fewer."
        )


def started_by_ranks(cluster: SpmdCluster) -> list[psutil.Process]:
    """What user code started inside the ranks (``subprocess``, DataLoader workers): once its
    engine is gone it would live on, reparented to init."""
    todo = []  # (pid, when it started) of the ranks still running, then of what they started
    for launcher in cluster.rank_launchers().values():
        process = getattr(launcher, "process", None)
        try:
            if process is not None and process.is_running():  # (psutil: not a reused pid)
                todo.append((process.pid, process.create_time()))
        except psutil.Error:
            continue
    if not todo:
        return []
    # (one pass over the machine's processes: psutil's children() makes one for each rank,
    # 64 passes at a 64-rank restart)
    children: dict[int, list[psutil.Process]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process)
    found = []
    while todo:
        pid, born = todo.pop()
        for child in children.get(pid, []):
            try:
                child_born = child.create_time()
            except psutil.Error:
                continue
            if child_born >= born:  # (one older had the pid before it: psutil's own check)
                found.append(child)
                todo.append((child.pid, child_born))
    return found


def wait_gone(processes: list, seconds: float) -> list:
    """Those of these processes still running after up to ``seconds`` (a zombie has ended).

    Not psutil.wait_procs, which waits for a zombie as for a running process: where the
    machine's first process reaps nothing (a container started without an init), what a
    rank started and outlived it stays a zombie for good, and each stop would wait its whole
    timeout."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in processes if not exited(p)]
        if not alive or time.monotonic() >= deadline:
            _reap([p for p in processes if p not in alive])
            return alive
        time.sleep(0.02)


def _reap(ended: list) -> None:
    """Those of ``ended`` that are this process's children: reaped, as psutil.wait_procs
    reaps them."""
    me = os.getpid()
    for process in ended:
        try:
            if isinstance(process, psutil.Process) and process.ppid() == me:
                process.wait(0)
        except psutil.Error:
            continue


def end_within(processes: list[psutil.Process], seconds: float) -> None:
    """Kill those of these processes that have not ended ``seconds`` from now (by handle)."""
    end(wait_gone(processes, seconds))


def end(processes: list[psutil.Process]) -> None:
    """Kill these processes, by handle (psutil checks it is still the same process)."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            continue
    wait_gone(processes, 2)


class Ended:
    """The handle of a process that had ended, and been reaped, before a handle could be
    taken: a rank forked by the rank server that exits at once. It answers as psutil's
    handle of a process gone does, so the start reports that rank's exit and its output."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_running(self) -> bool:
        return False

    def status(self) -> str:
        return psutil.STATUS_DEAD

    def send_signal(self, sig: int) -> None:
        raise psutil.NoSuchProcess(self.pid)


def exited(process) -> bool:
    """Whether a psutil process handle has ended (a zombie has ended too)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_now(launchers, after: float = 0.0) -> None:
    """SIGKILL the processes of these local launchers still running ``after`` seconds from
    now (by their handles)."""
    procs = [ln.process for ln in launchers if getattr(ln, "process", None) is not None]
    alive = [p for p in procs if not exited(p)]
    if after and alive:
        alive = wait_gone(alive, after)
    end(alive)


def how_it_ended(code: int) -> str:
    """A process's end from its exit code (negative: the signal): 'killed by SIGKILL',
    'exit code 1'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
