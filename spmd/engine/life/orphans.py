"""No orphans: a process we start ends when the notebook process that started it is gone,
or once its linger is over.

The notebook kernel ends its cluster at exit (atexit), but a kernel killed with SIGKILL runs
no atexit. Each engine and the controller therefore watch their parent: when it is gone, they
exit. This is a thread in the child, not a signal, so it works on every POSIX system.

A cluster started with a linger (``%spmd start --linger 10m``) outlives a notebook process
that died for that long: its processes then watch the cluster folder's ``owner.json``, which
names the notebook process that holds the cluster now (``%spmd attach`` in a new one writes
its own there), and end once no live process has held it for the whole linger. A forked rank
still ends with its rank server, which lingers in its stead.

A process whose linger is over ends holding a lock on the cluster's folder (``folder_lock``, a
POSIX lock on its ``LOCK_FILE``: a process's own, which a child it forks, a DataLoader worker,
does not inherit and so cannot keep after it; it goes when the process closes any descriptor
of that file, so nothing else opens it),
and an attach writes the owner file holding the same lock: a process that read the old owner
just before an attach reads the new one before it ends (and stays), or has ended before the
attach looks whether the cluster's processes still run (and the attach is refused).

The controller notes when it found the notebook gone (``GONE_FILE``, ``note_gone``): that is
when the linger began, which ``python -m spmd list`` counts from.

Threads: the watch thread reads the owner file and ends the process; ``on_gone`` callbacks
run on it once, when it first finds the notebook gone.
"""

from __future__ import annotations

import json
import os
import threading
import time

PARENT_ENV = "SPMD_PARENT_PID"
# Seconds a cluster outlives its notebook process (unset or 0: none), and the file that names
# the notebook process holding the cluster now (profiles.OWNER_FILE in its folder).
LINGER_ENV = "SPMD_LINGER"
OWNER_ENV = "SPMD_OWNER_FILE"
# The linger's seconds, for a rank server on another host of a cluster with a linger (server.py).
REMOTE_LINGER_ENV = "SPMD_LINGER_REMOTE"
# Paths the controller removes when its linger is over (os.pathsep between them): the
# cluster's folders and its record.
REMOVE_ENV = "SPMD_LINGER_REMOVE"
# In the cluster's folder, beside the owner file: when the controller found the notebook gone
# ({"at": time.time()}), while no notebook holds the cluster.
GONE_FILE = "gone.json"
# In the cluster's folder, made with it (launchers/profiles.owned_folder): what ``folder_lock``
# locks.
LOCK_FILE = "folder.lock"


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


_AT_EXIT_NOW: list = []  # (main thread: registered once, run at exit_now)


def at_exit_now(fn) -> None:
    """Run ``fn`` when this process ends with ``exit_now`` (which runs no atexit)."""
    _AT_EXIT_NOW.append(fn)


def exit_now(signum: int) -> None:
    """End what this process started (its cells' subprocesses, DataLoader workers: they would
    outlive it, reparented to init), then this process, as a signal ``signum`` would."""
    end_children()
    for fn in _AT_EXIT_NOW:
        try:
            fn()
        except Exception:  # (what is left of it stays; the process ends all the same)
            pass
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


def started_at(pid: int) -> float | None:
    """When process ``pid`` started, as a number that names it with its pid (a pid is reused)
    and that no clock change moves: Linux's clock ticks since boot (/proc/PID/stat), else
    psutil's start time. None where it does not run, or is a zombie (it ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else float(fields[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        import psutil

        try:
            process = psutil.Process(pid)
            return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
        except psutil.Error:
            return None


def read_owner(path: str) -> dict:
    """The owner file's contents ({} where it cannot be read)."""
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def runs(who: dict | None) -> bool:
    """Whether the process ``who`` ({"pid", "started"}) still runs: the same one."""
    try:
        if who is not None and "started" not in who and "create_time" in who:
            import psutil  # (a file an earlier version wrote)

            return psutil.Process(int(who["pid"])).create_time() == who["create_time"]
        return who is not None and started_at(int(who["pid"])) == who["started"]
    except Exception:  # (KeyError, TypeError, ValueError, psutil.Error: not running)
        return False


def owner_alive(path: str) -> bool:
    """Whether the notebook process ``path`` (an owner.json) names still runs."""
    return runs(read_owner(path))


def owner_pid(path: str) -> int:
    try:
        return int(read_owner(path).get("pid", 0))
    except (TypeError, ValueError):
        return 0


class Linger:
    """The clock of a cluster whose notebook process may die: ``over`` once no live notebook
    process has held the cluster for ``seconds``. Until its start has finished (the owner
    file names a keeper, linger.keep), a cluster does not linger: it ends with its notebook."""

    def __init__(self, seconds: float, owner_file: str) -> None:
        self.seconds = seconds
        self.owner_file = owner_file
        self.notebook_pid = owner_pid(owner_file)  # (the one that started this process)
        self.gone_since: float | None = None
        self.on_gone: list = []  # called once, when the notebook is first found gone
        self.on_back: list = []  # called when a notebook holds it again (an attach)

    @classmethod
    def from_env(cls) -> Linger | None:
        try:
            seconds = float(os.environ.get(LINGER_ENV) or 0)
        except ValueError:
            seconds = 0.0
        path = os.environ.get(OWNER_ENV)
        return cls(seconds, path) if seconds > 0 and path else None

    def over(self) -> bool:
        owner = read_owner(self.owner_file)
        if runs(owner):
            if self.gone_since is not None:
                self.gone_since = None
                _call(self.on_back)
            return False
        if "keeper" not in owner:  # (a start that had not finished: nothing to keep)
            return True
        now = time.monotonic()
        if self.gone_since is None:
            self.gone_since = now
            _call(self.on_gone)
        return now - self.gone_since >= self.seconds

    def confirm_over(self) -> bool:
        """(once ``over``) Whether it is still over with the cluster's folder locked: the
        owner file is read again, under the lock an attach writes it with. True: the lock is
        kept, and the process must end now (its exit lets go of it); False: a notebook
        attached meanwhile, and the linger goes on."""
        folder = os.path.dirname(self.owner_file)
        fd = folder_lock(folder)
        if runs(read_owner(self.owner_file)):
            if fd is not None:
                os.close(fd)  # (closing it lets go of the lock)
            self.gone_since = None
            _call(self.on_back)
            return False
        return True


def folder_lock(folder: str, wait: float | None = None) -> int | None:
    """An exclusive lock on the cluster's folder, waited for (``wait``: that many seconds at
    most, then TimeoutError): its descriptor (closing it, or the process's end, lets go), or
    None where the folder is gone (nothing to attach to)."""
    import fcntl

    path = os.path.join(folder, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # (gone, or being removed: never made again here, which would lock a
        return None  # file the ending controller does not hold)
    until = None if wait is None else time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | (0 if until is None else fcntl.LOCK_NB))
                return fd
            except (BlockingIOError, PermissionError):  # (held: EAGAIN or EACCES)
                if until is None:
                    raise
                if time.monotonic() >= until:
                    raise TimeoutError(f"{folder} stayed locked for {wait:g} s") from None
                time.sleep(0.05)
    except TimeoutError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise


def note_gone(linger: Linger | None) -> None:
    """(the controller) Keep, beside the owner file, when the linger began (``GONE_FILE``),
    for ``python -m spmd list`` to count from; removed when a notebook holds it again."""
    if linger is None:
        return
    path = os.path.join(os.path.dirname(linger.owner_file), GONE_FILE)

    def gone() -> None:
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w") as f:
            json.dump({"at": time.time()}, f)
        os.replace(partial, path)

    def back() -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    linger.on_gone.append(gone)
    linger.on_back.append(back)


def _call(callbacks: list) -> None:
    for call in callbacks:
        try:
            call()
        except Exception:  # (a note in a log: never worth the watch itself)
            pass


def _remove_what_was_kept() -> None:
    """The linger is over: the controller removes the cluster's folders and its record."""
    import shutil

    for path in filter(None, os.environ.get(REMOVE_ENV, "").split(os.pathsep)):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass


def _say(line: str) -> None:
    """A line in this process's output file (its fd 2: a rank's sys.stderr is a cell's
    stream)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def watch_parent(period: float = 1.0, linger: Linger | None = None) -> Linger | None:
    """Exit this process soon after the notebook process (``$SPMD_PARENT_PID``) ends, or,
    for a cluster with a linger, once the linger is over (see the opening comment). The
    linger's clock, for callbacks; None without one."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return None
    parent_pid = int(parent)
    linger = linger or Linger.from_env()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent_pid and (
                linger is None or parent_pid != linger.notebook_pid
            ):  # (no linger, or the parent was a rank server, which lingers in our stead)
                _say(f"spmd: the parent process (pid {parent_pid}) ended; this one ends too.")
                end_children()
                os._exit(1)
            if linger is not None and linger.over() and linger.confirm_over():
                end_children()
                _remove_what_was_kept()
                os._exit(1)

    threading.Thread(target=watch, name="spmd-parent-watch", daemon=True).start()
    return linger
