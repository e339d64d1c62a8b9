"""The rank server: one process per host that imports what every rank needs, once, and then
forks the ranks.

A fresh Python per rank imports IPython, ipyparallel's engine, zmq and jax on its own (most of
a start on a small machine, and once more per rank). Here the import is paid once per host:
the children start warm and share the imported pages until they write. What we took from the
anchors: multiprocessing's forkserver (a preload list imported before any thread exists, a
child forked per request), gunicorn's ``--preload`` and its arbiter (signals handled in one
loop woken through a pipe, never where they land), Ray's prestarted workers (the server waits
ready before anyone asks).

``python -m spmd.engine.server [MODULE ...]`` imports the modules, then speaks JSON lines: it
writes ``{"ready": pid}`` (or ``{"failed": "why"}`` and exits) on stdout, then reads requests
on stdin:

- ``{"fork": id, "env": {...}, "argv": [...], "output": path, "cwd": path}``: fork a rank;
  answered ``{"forked": id, "pid": pid}`` (or ``{"forked": id, "error": "why"}``). The rank's
  environment is ``env`` (this machine's notebook gives its whole own), or with
  ``"keep_env": true`` the server's own plus ``env`` (another host's, where the login made
  it); ``cwd`` '' stays in the server's folder; the output's folders are made private; with
  ``"controller": "host:port"`` (another host's), the controller it watches while it lingers;
- ``{"signal": pid, "sig": n}``: send a rank (with ``"group": true``, its process group)
  a signal; not answered (its end is);
- ``{"read": id, "path": path, "tail": n}``: the last ``n`` characters of a rank's output
  file, answered ``{"read": id, "text": "..."}`` (on another host: no login to fetch it);
- ``{"remove": path}``: remove this folder (the cluster's files there) when the server ends,
  if it is not there yet (one that is was made by another: the notebook, on this machine);
- ``{"end": true}``: end (a stop);
- and for every child that ended, ``{"exited": pid, "code": code}`` (negative: the signal).

Nothing of the user's runs here: no backend, device, socket or Python thread is started before
a fork (jax starts none at import). When stdin closes (the notebook ended, even by SIGKILL, or
its ssh connection dropped), when asked to end, or on SIGTERM, the server kills every rank it
forked (each in its own process group, with what it started) and exits. A cluster with a
linger is the exception: when stdin closes, the server and its ranks run on, with nobody to
tell, until the linger is over (orphans.Linger, on the notebook's machine) or, on another host
(``$SPMD_LINGER_REMOTE``: the linger's seconds), which cannot see the notebook's processes,
until the cluster's controller is gone (it ends at the linger's end): the server tries its
registration port every few seconds, and ends its ranks itself once the connection is refused
twice in a row, or has found no answer for the linger's length. (The ranks cannot be left to
end by themselves: they miss the controller's heartbeats on their event loop, which does not
turn while a cell runs, so a training loop would run for ever.) On either, the server also
ends once no rank is left. A notebook that attaches ends it by SIGTERM, or by ending its ranks.

Threads: one. Children are forked from the only Python thread there is.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time

from spmd.engine.life.orphans import REMOTE_LINGER_ENV, Linger

# How often another host's lingering server tries its controller's port (seconds), and how
# long one try waits for an answer.
CONTROLLER_CHECK_SECONDS = 2.0
CONTROLLER_CONNECT_SECONDS = 1.0

# What every rank imports before its first cell, whatever its backend.
ENGINE_MODULES = ("zmq", "IPython", "ipykernel.ipkernel", "ipyparallel.engine.app",
                  "spmd.engine.bootstrap", "spmd.engine.rank_kernel")
BACKEND_MODULES = {"jax": ("jax", "jax.numpy"), "torch": ("torch", "torch.distributed")}
# Imported once here too where they are installed: ipyparallel imports numpy in each rank at
# its first request (its serializer's type table), 100 ms of CPU a rank, most of a 64-rank
# --backend none restart's CPU if each rank did it after its fork. The rest is what every
# rank imports after its fork otherwise (about 10 ms a rank).
OPTIONAL_MODULES = ("numpy", "sqlite3", "tornado.platform.asyncio", "tornado.gen",
                    "tornado.queues", "tornado.locks", "IPython.core.oinspect",
                    "IPython.core.completerlib", "IPython.extensions.storemagic",
                    "IPython.utils.wildcard", "spmd.engine.shell.streams")


def modules_for(backend: str, preload: list[str]) -> list[str]:
    """What a rank server imports for ranks of this backend ("jax", "torch", "jax,torch",
    "none"), and the user's own ``preload`` (flax, optax...)."""
    found = list(ENGINE_MODULES)
    for name in backend.split(","):
        found += BACKEND_MODULES.get(name, ())
    return found + [m for m in preload if m not in found]


class Server:
    def __init__(self, replies) -> None:
        self.replies = replies  # the protocol's stream (the process's stdout, set apart)
        self.children: set[int] = set()  # the ranks it forked that have not ended
        self.ending = False
        self.remove: list[str] = []  # folders to remove at the end
        self.linger = Linger.from_env()  # (None: the server ends with its notebook)
        # (on another host: the server outlives its stdin while its controller runs)
        self.remote_linger = _seconds(os.environ.get(REMOTE_LINGER_ENV))
        self.lingers = self.linger is not None or self.remote_linger > 0
        self.controller = ""  # "host:port": the controller's port (another host's, to watch)
        self._next_check = 0.0
        self._refused = 0  # tries in a row that the controller's host refused
        self._unanswered_since: float | None = None
        self.reading = True  # stdin is open
        self._wake_read, self._wake_write = os.pipe()
        for fd in (self._wake_read, self._wake_write):
            os.set_blocking(fd, False)

    def say(self, **message) -> None:
        try:
            self.replies.write(json.dumps(message) + "\n")
            self.replies.flush()
        except OSError:  # nobody reads us any more (the notebook, or its connection, ended)
            self.ending = not self.lingers

    def serve(self) -> None:
        # A signal only wakes the loop (its byte in the pipe); the loop reaps and ends.
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._asked_to_end)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the notebook's ^C is not for us)
        try:
            self._loop()
        finally:  # (however the loop ended: its ranks and the cluster's folder go with it)
            self._end_children()

    def _loop(self) -> None:
        pending = b""
        while not self.ending:
            watched = [0, self._wake_read] if self.reading else [self._wake_read]
            try:
                # (with a linger, the owner, or the controller, is looked at every second)
                watching = self.linger is not None or (not self.reading and self.controller)
                ready, _, _ = select.select(watched, [], [], 1.0 if watching else None)
            except InterruptedError:
                continue
            if self._wake_read in ready:
                while _drain(self._wake_read):
                    pass
                self._reap()
            if self.linger is not None and self.linger.over() and self.linger.confirm_over():
                break
            if not self.reading and not self.children:  # (lingering, with no rank left)
                break
            if not self.reading and self.controller and self._controller_gone():
                break  # (another host's linger is over: its ranks end here, now)
            if 0 in ready:
                data = os.read(0, 1 << 16)
                if not data:  # the notebook is gone
                    if not self.lingers:
                        break
                    self.reading = False
                    continue
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._handle(json.loads(line))

    def _controller_gone(self) -> bool:
        """(another host, lingering) Whether the cluster's controller has ended: its port
        refused twice in a row, or unanswered for the linger's length (see the opening
        comment). Looked at every CONTROLLER_CHECK_SECONDS."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + CONTROLLER_CHECK_SECONDS
        answer = _reach(self.controller)
        if answer == "yes":
            self._refused, self._unanswered_since = 0, None
            return False
        if answer == "refused":
            self._refused += 1
            return self._refused >= 2
        self._refused = 0
        if self._unanswered_since is None:
            self._unanswered_since = now
        return now - self._unanswered_since >= self.remote_linger

    def _asked_to_end(self, *_) -> None:
        self.ending = True

    def _handle(self, request: dict) -> None:
        if request.get("end"):
            self.ending = True
        elif "signal" in request:
            pid = request["signal"]
            if pid in self.children:  # (only its own ranks: a pid may be reused once reaped)
                try:
                    kill = os.killpg if request.get("group") else os.kill
                    kill(pid, request["sig"])
                except OSError:
                    pass
        elif "read" in request:
            self.say(read=request["read"], text=_tail(request["path"], request["tail"]))
        elif "remove" in request:
            # Only a folder the cluster will make here: one there already is another's (the
            # notebook's own, where this host is the notebook's machine by a name the
            # notebook did not know as its own, or on storage the hosts share).
            if not os.path.exists(request["remove"]):
                self.remove.append(request["remove"])
        elif "fork" in request:
            self.controller = request.get("controller") or self.controller
            try:
                pid = os.fork()
            except OSError as exc:
                self.say(forked=request["fork"], error=f"{type(exc).__name__}: {exc}")
                return
            if pid == 0:
                self._run_rank(request)  # never returns
            self.children.add(pid)
            self.say(forked=request["fork"], pid=pid)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.say(exited=pid, code=os.waitstatus_to_exitcode(status))

    def _end_children(self) -> None:
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)  # (its group: what the rank's cells started)
            except OSError:  # (one forked a moment ago may not lead its group yet)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)
            self.children.discard(pid)
        for folder in self.remove:
            shutil.rmtree(folder, ignore_errors=True)

    def _run_rank(self, request: dict) -> None:
        """In the child: become the rank the request describes, run its engine, and exit."""
        code = 1
        try:
            os.setsid()  # its own group: the notebook's ^C and the server's end are not its
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.close(self._wake_read)
            os.close(self._wake_write)
            self.replies.close()
            _private_folders(os.path.dirname(request["output"]))
            output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(output)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            if not request.get("keep_env"):
                os.environ.clear()
            os.environ.update(request["env"])
            from spmd.engine.life.orphans import PARENT_ENV

            os.environ[PARENT_ENV] = str(os.getppid())  # (it watches this server)
            if request.get("cwd"):
                os.chdir(request["cwd"])
            _name_process(f"spmd-rank{os.environ.get('SPMD_RANK', '')}")
            sys.argv = list(request["argv"])
            _fresh_randomness()
            from spmd.engine import bootstrap

            bootstrap.forked()
            bootstrap.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, int | None):  # (as Python says it at its own exit;
                # on fd 2: the engine's sys.stderr is a cell's stream by now)
                os.write(2, f"{exc.code}\n".encode(errors="replace"))
        except BaseException:
            import traceback

            # (before its output was its own file, this is the server's log: say whose, as
            # startup.py looks for it)
            print(f"The fork for {request.get('fork')} failed:", file=sys.stderr)
            traceback.print_exc()
        finally:
            import atexit

            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # (a closed stream at the very end)
                    pass
            os._exit(code)


def _seconds(text: str | None) -> float:
    try:
        return max(0.0, float(text or 0))
    except ValueError:
        return 0.0


def _reach(address: str) -> str:
    """Whether a TCP connection to ``address`` ("host:port") is made: "yes", "refused" (the
    host answered that nothing listens there), or "no answer"."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=CONTROLLER_CONNECT_SECONDS):
            return "yes"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "no answer"


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _tail(path: str, size: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _private_folders(path: str) -> None:
    """Make ``path`` and the folders above it that are missing, readable by their owner only
    (they will hold what the ranks print)."""
    if not path or os.path.isdir(path):
        return
    _private_folders(os.path.dirname(path))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _name_process(name: str) -> None:
    """The name ps and top show (its command line stays the server's: fork keeps it)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:  # (not Linux)
        pass


def _fresh_randomness() -> None:
    """A forked child starts with its server's random state: every rank would draw the same
    numbers (and every restart the same again), where fresh processes draw their own. Each
    generator the server's imports made is seeded afresh from the system's entropy."""
    import random

    random.seed()
    # (only where the server imported them: numpy imports numpy.random lazily, and importing
    # it here cost each rank 8 ms of CPU at its start; a later import seeds itself afresh)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        # torch seeds its CPU generator once, at import. Its CUDA generators start from one
        # fixed seed in every process; they are seeded with the CPU's new one when CUDA
        # starts (torch.seed's own way: a queued call, which costs 1-2 ms, so only in a
        # build that has CUDA or ROCm).
        seed = torch.default_generator.seed()
        if torch.version.cuda or torch.version.hip:
            torch.cuda.manual_seed_all(seed)


def _check_internals() -> None:
    """What every rank checks when it joins, done here once for the ranks to inherit. One
    that moved is left for each rank to report in its own words."""
    from spmd import internals

    try:
        internals.check("rank")
    except internals.InternalsChanged:
        pass


def main(modules: list[str]) -> None:
    # The protocol gets stdout to itself; anything an import prints goes to stderr (the
    # server's log).
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    t0 = time.perf_counter()
    server = Server(replies)
    try:
        if not hasattr(os, "fork"):
            raise OSError("this system cannot fork")
        for name in modules:
            importlib.import_module(name)
        for name in OPTIONAL_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        _check_internals()
        if threading.active_count() > 1:
            # a fork keeps only the forking thread: a lock another one held stays held
            names = ", ".join(t.name for t in threading.enumerate()[1:])
            raise RuntimeError(f"its imports started a thread ({names}), and a fork is unsafe")
    except BaseException as exc:  # (an import can fail in any way, SystemExit included)
        server.say(failed=f"{type(exc).__name__}: {exc}")
        return
    server.say(ready=os.getpid(), imported=time.perf_counter() - t0)
    server.serve()
    # (its ranks are gone and it holds nothing: no need for the interpreter's slow
    # finalization of what jax imported, which a stop would wait for)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
