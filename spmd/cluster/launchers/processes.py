"""The processes of a cluster on this machine: room for them, ending them by handle, and
how one ended."""

from __future__ import annotations

import signal

import psutil

from spmd.cluster.launchers.launch import SpmdCluster


class StartRefused(RuntimeError):
    """This machine cannot hold the ranks asked for; the text says why and what to do."""


# What one rank needs on this machine: its engine with jax imported and initialized.
RANK_MEMORY = 256 * 2**20


def max_local_ranks() -> int:
    """How many ranks this machine has room for now, by free memory."""
    return max(1, int(psutil.virtual_memory().available // RANK_MEMORY))


def check_room(n: int) -> None:
    room = max_local_ranks()
    if n > room:
        free = psutil.virtual_memory().available / 2**30
        raise StartRefused(
            f"-n {n} is more ranks than this machine has room for: each needs about "
            f"{RANK_MEMORY / 2**30:.2f} GiB and {free:.1f} GiB is free, enough for {room}: "
            "start fewer."
        )


def started_by_ranks(cluster: SpmdCluster) -> list[psutil.Process]:
    """What user code started inside the ranks (``subprocess``, DataLoader workers): once its
    engine is gone it would live on, reparented to init."""
    found = []
    for launcher in cluster.rank_launchers().values():
        try:
            found += launcher.process.children(recursive=True)
        except (psutil.Error, AttributeError):
            continue
    return found


def end(processes: list[psutil.Process]) -> None:
    """Kill these processes, by handle (psutil checks it is still the same process)."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(processes, timeout=2)


def exited(process) -> bool:
    """Whether a psutil process handle has ended (a zombie has ended too)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def launcher_ended(launcher) -> bool:
    """Whether a launcher's engine has ended (or its start failed): by its local process
    handle at once, else (over ssh) as its wait saw it."""
    if getattr(launcher, "process", None) is not None:
        return exited(launcher.process)
    return launcher.state == "after" or getattr(launcher, "exited_at", None) is not None


def kill_now(launchers, after: float = 0.0) -> None:
    """SIGKILL the processes of these local launchers still running ``after`` seconds from
    now (by their handles)."""
    procs = [ln.process for ln in launchers if getattr(ln, "process", None) is not None]
    alive = [p for p in procs if not exited(p)]
    if after and alive:
        _, alive = psutil.wait_procs(alive, timeout=after)
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
