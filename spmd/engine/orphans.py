"""No orphans: a process we start ends when the notebook process that started it is gone.

The notebook kernel ends its cluster at exit (atexit), but a kernel killed with SIGKILL runs
no atexit. Each engine and the controller therefore watch their parent: when it is gone, they
exit. This is a thread in the child, not a signal, so it works on every POSIX system.
"""

from __future__ import annotations

import os
import threading
import time

PARENT_ENV = "SPMD_PARENT_PID"


def end_children() -> None:
    """Kill every descendant of this process (before it exits with os._exit, which ends
    nothing else: the controller's heartbeat process, what a rank's cells started)."""
    import psutil

    descendants = _descendants_from_proc(os.getpid())
    if descendants is None:  # (no /proc/<pid>/task/<tid>/children here)
        descendants = psutil.Process().children(recursive=True)
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass


def exit_now(signum: int) -> None:
    """End what this process started (its cells' subprocesses, DataLoader workers: they would
    outlive it, reparented to init), then this process, as a signal ``signum`` would."""
    end_children()
    os._exit(128 + signum)


def _descendants_from_proc(pid: int) -> list | None:
    """psutil handles on ``pid``'s descendants, from Linux's list of each thread's children
    (None where there is none). psutil's own way reads every process on the machine: at a
    64-rank restart each old rank did, 5 ms of CPU each, while the new ranks started. A child
    read here is ours until we reap it, so its pid cannot have been reused."""
    import psutil

    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
            pids = []
            for task in tasks:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    pids += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            if parent == pid:
                return None
            continue  # (a descendant that ended meanwhile)
        except OSError:
            continue
        for child in pids:
            try:
                found.append(psutil.Process(child))
            except psutil.Error:
                continue
            todo.append(child)
    return found


def watch_parent(period: float = 1.0) -> None:
    """Exit this process soon after the notebook process (``$SPMD_PARENT_PID``) ends."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    parent_pid = int(parent)

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent_pid:
                end_children()
                os._exit(1)

    threading.Thread(target=watch, name="spmd-parent-watch", daemon=True).start()
