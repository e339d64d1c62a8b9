"""Ranks over SSH: ipyparallel's SSH engine set, with ranks, one connection per host, and
its per-engine commands run side by side."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher, _ssh_outputs
from ipyparallel.cluster.shellcmd import ShellCommandSend

from spmd.cluster.launchers.profiles import owned_folder
from spmd.engine.join import placement


class _Once:
    """A step that one engine of a host runs and the others wait for."""

    def __init__(self) -> None:
        self.lock, self.done = threading.Lock(), False


class _Sender(ShellCommandSend):
    """ipyparallel's ssh command runner, keeping what the host prints on stderr in the error
    it raises (for the start's one-sentence error), not in the notebook's terminal.

    ipyparallel creates the (shared) profile folder on the host once per engine, an IPython
    start each (~1 s of CPU): here the first engine of each host creates it, private (0700:
    it will hold the ranks' output), and the others wait for that.

    The Python's path goes into a remote shell's command line: it is quoted (a space in it
    would split it, a ``;`` would run what follows), a ``~/`` in front expanded there
    (python_there).
    """

    profile_made: _Once | None = None

    def __init__(self, shell, args, python_path, **kwargs) -> None:
        super().__init__(shell, args, shlex.join(python_there(python_path)), **kwargs)

    def _check_output(self, cmd, **kwargs):
        kwargs.setdefault("stderr", subprocess.PIPE)
        return super()._check_output(cmd, **kwargs)

    def check_output_python_module(self, module_params, **kwargs):
        once = self.profile_made
        if once is None or list(module_params[:3]) != ["IPython", "profile", "create"]:
            return super().check_output_python_module(module_params, **kwargs)
        with once.lock:
            if once.done:
                return ""
            folder = module_params[module_params.index("--profile-dir") + 1]
            self.check_output_python_code(
                f"import os; os.makedirs({folder!r}, mode=0o700, exist_ok=True); "
                f"os.chmod({folder!r}, 0o700)"
            )
            out = super().check_output_python_module(module_params, **kwargs)
            once.done = True
            return out


class RankedSSHEngineLauncher(SSHEngineLauncher):
    """One engine over SSH that knows its rank and its place on its host, from the start."""

    @property
    def ssh_sender(self) -> ShellCommandSend:
        if self._ssh_sender is None:
            self._ssh_sender = _Sender(
                self.ssh_cmd, [*self.ssh_args, self.location], self.remote_python, log=self.log
            )
            made = self.parent.__dict__.setdefault("_profiles_made", {})
            self._ssh_sender.profile_made = made.setdefault(self.location, _Once())
        return self._ssh_sender

    @property
    def rank_place(self) -> tuple[int, int, int]:
        host, index = self.identifier.rsplit("/", 1)
        offset = 0
        for name, count in self.parent.engines.items():
            if name == host:
                return offset + int(index), int(index), count
            offset += count
        raise KeyError(host)

    @property
    def rank(self) -> int:
        return self.rank_place[0]

    # ipyparallel runs each engine's ssh commands on the event loop's thread, one engine
    # after the other (~1.5 s per engine to start, ~0.5 s to signal). Here they run on the
    # engine set's threads, all engines at once.

    def start(self, hostname=None, user=None, port=None):
        self.loop  # noqa: B018 (bound here, on the loop's thread, where the wait thread reports)
        self.parent.in_parallel(super().start, hostname, user, port)

    # Set when the engine confirmed a SIGTERM on its control channel (Session.stop): it is
    # ending, and the wait that runs since its start (a long poll over ssh) sees it end.
    ended_by_control = False
    # Set when its host stopped answering (the wait's connection ended): no more commands
    # go there, so that a stop returns (each would wait for the connect timeout).
    lost = False

    def signal(self, sig) -> None:
        if self.lost or (sig == signal.SIGTERM and self.ended_by_control):
            return
        # (its wait, in ``join``, polls the host until the process has ended)
        self.parent.in_parallel(super().signal, sig)

    exit_code: int | None = None
    exited_at: float | None = None  # time.monotonic(), as RankedEngineLauncher has them

    def _wait(self) -> None:
        """ipyparallel's wait (a long poll of the host over ssh), keeping the exit code where
        the notebook reads it in the middle of a cell, as RankedEngineLauncher does."""
        exit_code = None
        failures = 0
        while not self._stop_waiting.is_set() and self.state == "running":
            try:
                exit_code = self.wait_one(timeout=self.poll_seconds)
            except TimeoutError:
                failures = 0
                continue
            except Exception:
                # The connection ended (ssh gives a silent host up after ServerAlive*): once
                # more, on a connection of its own (a network hiccup passes); twice, and the
                # host is lost. (The controller's heartbeat reports the rank sooner.)
                failures += 1
                if failures < 2:
                    continue
                if not self._stop_waiting.is_set():
                    self.lost, self.exited_at = True, time.monotonic()
                break
            else:
                break
        if exit_code is not None and not self._stop_waiting.is_set():
            # (ipyparallel's remote wait cannot know the code of a process it did not start:
            # it says -1, which is not a signal)
            self.exit_code = None if exit_code == -1 else exit_code
            self.exited_at = time.monotonic()
        stop_data = dict(exit_code=exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def wait_one(self, timeout) -> int:
        """ipyparallel's remote wait, with ours on the host, which sees a zombie as ended
        (see ``spmd.engine.life.hostwait``)."""
        out = self.ssh_sender.check_output_python_code(
            f"from spmd.engine.life.hostwait import wait; wait({self.pid}, timeout={timeout})"
        )
        values = _ssh_outputs(out)
        if "process_running" not in values:
            raise RuntimeError(out)
        if int(values["process_running"]):
            raise TimeoutError("still running")
        return int(values.get("exit_code", -1))

    async def join(self, timeout=None) -> None:
        if self.state != "running" or self.lost:  # (nothing there to wait for, or to ask)
            return
        waiting = getattr(self, "_wait_thread", None)
        if self.ended_by_control and waiting is not None:
            # no new ssh command: the running wait returns when the process has ended
            await asyncio.get_running_loop().run_in_executor(None, waiting.join, 5)
            if not waiting.is_alive():
                return
        try:
            await super().join(timeout)
        except subprocess.CalledProcessError:  # the host, or its Python, is gone
            pass

    def get_output(self, remove=False) -> str:
        """What the engine wrote, as far as fetched (ipyparallel fetches it at every stop:
        one more ssh command per engine; the notebook needs it only for a death report)."""
        return self._output or ""

    def fetch_output(self) -> str:
        """What the engine wrote, fetched from its host now ('' from a lost host)."""
        if self.lost:
            return self._output or ""
        self._output = None
        return super().get_output(remove=False)

    def get_env(self) -> dict[str, str]:
        rank, local, size = self.rank_place
        return dict(
            super().get_env(),
            **{
                placement.RANK_ENV: str(rank),
                placement.LOCAL_RANK_ENV: str(local),
                placement.LOCAL_SIZE_ENV: str(size),
            },
        )


class RankedSSHEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's SSH engine set, over one ssh connection per host.

    The launchers run several ssh commands per engine (checks, the start, signals, the wait,
    fetching its output); each would log in afresh (~0.3 s). One master connection per host,
    which this launcher starts and ends by its own handle, carries them all.
    """

    launcher_class = RankedSSHEngineLauncher

    def start(self, n):
        # An awaitable (ipyparallel awaits it): logging in and each engine's ssh commands
        # run on threads, so the cluster's event loop stays free meanwhile, for the
        # controller's start beside it.
        return self._start(n)

    async def _start(self, n):
        await asyncio.get_running_loop().run_in_executor(None, self._connect)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="spmd-ssh")
        self._starting: list[Future] = []
        started = super().start(n)  # (on the loop's thread, where the launchers bind it)
        for future in self._starting:
            # the first failure, if any, as ipyparallel would raise it
            await asyncio.wrap_future(future)
        return started

    def in_parallel(self, fn, *args) -> Future:
        try:
            future = self._pool.submit(fn, *args)
        except RuntimeError:  # the set is stopping (its pool is shut down): here, then
            future = Future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)
        self._starting.append(future)
        return future

    async def stop(self):
        try:
            return await super().stop()
        finally:
            if getattr(self, "_pool", None) is not None:
                self._pool.shutdown(wait=True)
            self._disconnect()

    def _connect(self) -> None:
        self._masters = Masters(self.ssh_cmd, self.ssh_args, list(self.engines))
        self._masters.connect()
        self._use(self._masters)

    def _use(self, masters: Masters) -> None:
        """Every ssh and scp command of this set goes through these master connections."""
        self.ssh_args = [*self.ssh_args, *masters.args]
        self.scp_args = [*self.scp_args, *masters.args]

    def _disconnect(self) -> None:
        if getattr(self, "_masters", None) is not None:
            self._masters.close()
            self._masters = None

    def _notice_engine_stopped(self, data) -> None:
        # Kept for the death report, as RankedEngineSetLauncher does for local ranks.
        self.__dict__.setdefault("ended", {})[data["identifier"]] = self.launchers.get(
            data["identifier"]
        )
        super()._notice_engine_stopped(data)


class Masters:
    """One ssh master connection per host, started and ended by its own handle: every other
    ssh command to that host goes through it (``args``) instead of logging in afresh."""

    def __init__(self, ssh_cmd: list[str], ssh_args: list[str], hosts: list[str]) -> None:
        self.ssh_cmd, self.ssh_args, self.hosts = ssh_cmd, ssh_args, hosts
        self.folder = ""
        self.processes: dict[str, subprocess.Popen] = {}

    @property
    def args(self) -> list[str]:
        """ssh's arguments that use the master connections."""
        return ["-o", f"ControlPath={self.folder}/%C", "-o", "ControlMaster=no"]

    def connect(self) -> None:
        """Log in to every host. Raises CalledProcessError, with what ssh said, for a host
        that cannot be reached within 30 s."""
        # A short folder: the control socket's path must fit in 108 bytes.
        self.folder = owned_folder("spmd-ssh-")
        path = ["-o", f"ControlPath={self.folder}/%C"]
        # (what a master says goes to a file: a pipe nobody reads fills up, with -v, and then
        # every command on that connection waits)
        for host in self.hosts:
            with open(self._said(host), "wb") as said:
                self.processes[host] = subprocess.Popen(
                    [*self.ssh_cmd, *self.ssh_args, *path, "-o", "ControlMaster=yes", "-N", host],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=said,
                    preexec_fn=_end_with_parent,
                )
        for host, master in self.processes.items():
            check = [*self.ssh_cmd, *self.ssh_args, *path, "-O", "check", host]
            deadline = time.monotonic() + 30
            while subprocess.run(check, capture_output=True).returncode != 0:
                if master.poll() is not None:  # it could not connect: say why
                    with open(self._said(host), errors="replace") as said:
                        raise subprocess.CalledProcessError(
                            master.returncode, ["ssh", host], stderr=said.read()
                        )
                if time.monotonic() > deadline:
                    raise subprocess.CalledProcessError(
                        255, ["ssh", host], stderr=f"{host} did not answer within 30 s"
                    )
                time.sleep(0.02)

    def lost(self, host: str) -> bool:
        """Whether the connection to ``host`` has ended (ssh gave the host up)."""
        master = self.processes.get(host)
        return master is not None and master.poll() is not None

    def _said(self, host: str) -> str:
        return f"{self.folder}/{host.replace('/', '_')}.err"

    def close(self) -> None:
        for master in self.processes.values():
            master.kill()
            master.wait()
        self.processes = {}
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""


def python_there(python: str) -> list[str]:
    """The argv that runs ``python`` on another host, where the command line is quoted word
    by word (ours, ipyparallel's): a ``~/...`` path becomes its home's there, through a shell
    (quoted whole, the ``~`` would stay a ``~``)."""
    if python.startswith("~/"):
        return ["sh", "-c", f'exec "$HOME"/{shlex.quote(python[2:])} "$@"', "python"]
    return [python]


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (``user@name``) names this machine itself."""
    return host.rsplit("@", 1)[-1] in ("localhost", "127.0.0.1", "::1")


def host_folder(profile_dir: str) -> str:
    """Where the hosts keep the cluster's files (the ranks' output): as ipyparallel's ssh
    launchers place them, relative to the login's home where ``profile_dir`` is under ours."""
    home = os.path.expanduser("~").rstrip("/") + "/"
    return profile_dir[len(home):] if profile_dir.startswith(home) else profile_dir


def remove_folder(hosts, ssh_cmd: list[str], ssh_args: list[str], folder: str) -> None:
    """Remove ``folder`` (the cluster's profile folder there: the ranks' output files) on
    each host, all at once. A host that does not answer within seconds keeps it."""
    runs = [
        subprocess.Popen(
            [*ssh_cmd, *ssh_args, "-o", "ConnectTimeout=5", host,
             f"rm -rf -- {shlex.quote(folder)}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for host in hosts
    ]
    for run in runs:
        try:
            run.wait(timeout=10)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()


def _end_with_parent() -> None:
    """In a child, before exec: the kernel sends it SIGTERM when this process ends, even by
    SIGKILL, so a connection never outlives the notebook (Linux; elsewhere a no-op). Linux
    sends it when the *thread* that started the child ends: start it from a thread that
    lives as long as the connection should."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
