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

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


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
