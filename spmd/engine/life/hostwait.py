"""On a rank's host, over ssh: wait until a rank's process has ended.

ipyparallel's remote wait (``ssh_waitpid``) waits until the pid is gone. An engine started
over ssh is reparented to the host's init once the command that started it returns, and
stays a zombie until init reaps it: at once under systemd, about a second later under some
container inits, never under a container's shell. A zombie has ended: this wait says so at
once. It imports psutil only (ipyparallel's wait imports ipyparallel: ~1 s per call).
"""

from __future__ import annotations

import time

import psutil


def wait(pid: int, timeout: float) -> None:
    """Print ipyparallel's markers: ``__process_running=0__`` once ``pid`` has ended (a
    zombie has), or ``__process_running=1__`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    try:
        process = psutil.Process(pid)
        while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() >= deadline:
                print("__process_running=1__")
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
    except psutil.NoSuchProcess:
        pass
    print("__process_running=0__")
    # (the exit code belongs to the process's parent, which is not this one)
    print("__exit_code=-1__")
