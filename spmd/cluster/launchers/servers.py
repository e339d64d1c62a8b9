"""Handles on rank servers (spmd/engine/server.py): the process per host that imports what
ranks need once and forks them. This machine's is the notebook's child; another host's runs
under one ssh command through the master connection to that host (ssh.Masters).

Threads: the session's thread starts and closes the servers (they live from the start to the
stop, across restarts); ipyparallel's event-loop thread asks them for forks and signals; one
reader thread per server reads its replies and is the only writer of ``_replies`` and
``_exits`` (each reply notifies ``_replied``, which the others wait on; a rank's end sets
that rank's Event). ``_send`` is under a
lock: requests come from the event-loop thread and, at the end, the session's. An ssh cluster's
servers are opened on a thread of their own while the controller starts (``SSHRankServers``),
which the engine set waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from spmd.cluster.launchers import ssh
from spmd.cluster.launchers.processes import how_it_ended
from spmd.engine.life.orphans import PARENT_ENV, REMOTE_LINGER_ENV


class ServerUnavailable(RuntimeError):
    """The rank server cannot fork ranks; the text says why."""


class ServerSlow(RuntimeError):
    """A rank server was not ready within the start's timeout (its host is slow)."""


class RankServer:
    """One host's rank server, started by this notebook (``command`` runs it: here, or
    through ssh on another host)."""

    def __init__(self, command: list[str], log_path: str, kill=None,
                 env: dict[str, str] | None = None) -> None:
        self.command = command
        self.env = env or {}  # (besides the notebook's own, for a server on this machine)
        self.log_path = log_path
        # Over ssh: ends the server's process on its host by pid (for a server that does not
        # read its stdin yet: still importing, or a Python that hangs); None here.
        self.kill = kill
        self.host_pid = 0  # its pid on its host, as soon as its shell said it
        self.why_not = ""  # why it cannot be used ('' while it can)
        self.pid = 0  # the server's own pid, on its host
        self._ready = threading.Event()
        self._replies: dict[str, dict] = {}
        self._replied = threading.Condition()
        self._exits: dict[int, int] = {}  # pid of a rank: its exit code (negative: signal)
        # One Event per rank whose end someone waits for (its wait thread): a reply wakes
        # only the thread it is for, not every rank's (with 64 ranks, each fork's reply
        # woke 64 threads).
        self._exit_events: dict[int, threading.Event] = {}
        self._said_all = False  # its replies ended (the server, or its connection, ended)
        self._send_lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.closed = False  # (close() was called: a start waiting on it starts nothing)

    def start(self) -> None:
        """Start the server (it imports on its own while the caller goes on)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                # (its parent, for the ranks it forks: they watch it, and it watches us
                # through its stdin)
                env=dict(os.environ, **self.env, **{PARENT_ENV: str(os.getpid())}),
                start_new_session=True,  # (the notebook's ^C is not for it)
            )
        threading.Thread(target=self._read, name="spmd-rank-server", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server is ready to fork (waiting up to ``timeout`` for its imports);
        when it is not, ``why_not`` says why. Raises ServerSlow past the timeout (the start's:
        ranks started without it would be too late as well)."""
        if not self._ready.wait(timeout):
            raise ServerSlow(f"its imports took more than {timeout:.0f} s")
        return not self.why_not

    def fork(self, key: str, env: dict[str, str], argv: list[str], output: str, cwd: str,
             keep_env: bool = False, timeout: float = 30.0, controller: str = "") -> int:
        """Fork one rank; its pid. Raises ServerUnavailable (the start then fails)."""
        self.ask_fork(key, env, argv, output, cwd, keep_env, controller)
        return self.forked(key, timeout)

    def ask_fork(self, key: str, env: dict[str, str], argv: list[str], output: str, cwd: str,
                 keep_env: bool = False, controller: str = "") -> None:
        """Ask for one rank's fork, without waiting for it (``forked`` waits): the forks of
        many ranks are asked for in one go, and the server forks them one after the other
        without a round trip each (64 round trips took 1.3 s). ``controller``: its
        "host:port", which another host's lingering server watches (server.py)."""
        request = {"fork": key, "env": env, "argv": argv, "output": output, "cwd": cwd,
                   "keep_env": keep_env}
        self._send({**request, "controller": controller} if controller else request)

    def forked(self, key: str, timeout: float = 30.0) -> int:
        """The pid of the rank asked for as ``key``, once forked; ServerUnavailable if it
        could not be."""
        deadline = time.monotonic() + timeout
        with self._replied:
            while key not in self._replies:
                left = deadline - time.monotonic()
                if self.why_not or left <= 0:
                    raise ServerUnavailable(self.why_not or "it did not answer a fork")
                self._replied.wait(min(left, 0.5))
            reply = self._replies.pop(key)
        if "error" in reply:
            raise ServerUnavailable(f"it could not fork: {reply['error']}")
        return reply["pid"]

    def signal(self, pid: int, sig: int, group: bool = False) -> None:
        """Send a rank (``group``: its process group) a signal; nothing if the server ended."""
        try:
            self._send({"signal": pid, "sig": int(sig), "group": group})
        except ServerUnavailable:
            pass

    def read(self, path: str, tail: int = 1 << 16, timeout: float = 10.0) -> str:
        """The end of a file on the server's host (a rank's output), '' if it cannot say."""
        key = f"read/{path}/{time.monotonic()}"
        try:
            self._send({"read": key, "path": path, "tail": tail})
        except ServerUnavailable:
            return ""
        deadline = time.monotonic() + timeout
        with self._replied:
            while key not in self._replies:
                left = deadline - time.monotonic()
                if self._gone() or left <= 0:
                    return ""
                self._replied.wait(min(left, 0.5))
            return self._replies.pop(key)["text"]

    def exit_code(self, pid: int, timeout: float) -> tuple[bool, int | None]:
        """(whether the rank ``pid`` has ended, its exit code), waiting up to ``timeout``."""
        with self._replied:
            if pid in self._exits or self._said_all:
                return True, self._exits.get(pid)
            event = self._exit_events.setdefault(pid, threading.Event())
        if not event.wait(timeout):
            return False, None
        with self._replied:
            return True, self._exits.get(pid)

    def remove_at_end(self, folder: str) -> None:
        """Have the server remove ``folder`` on its host when it ends, however the notebook
        ended (sent at once: it reads it once its imports are done)."""
        try:
            self._send({"remove": folder})
        except ServerUnavailable:
            pass

    def close(self) -> bool:
        """End the server and every rank it forked (it kills them when its stdin closes).
        Whether it ended by itself (so did what it was asked to do at its end)."""
        self.closed = True
        process = self.process
        if process is None:
            return False
        with self._send_lock:
            try:  # (asked, since a server of a cluster with a linger outlives its stdin)
                process.stdin.write(b'{"end": true}\n')
                process.stdin.flush()
            except (OSError, ValueError):
                pass
            try:
                process.stdin.close()
            except OSError:
                pass
        by_itself = True
        try:
            process.wait(timeout=6 if self.kill is None else 4)
        except subprocess.TimeoutExpired:
            by_itself = False
            if self.kill is not None and self.host_pid:
                self.kill(self.host_pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=3)
            process.kill()
            process.wait()
        return process.returncode == 0 and by_itself

    @property
    def usable(self) -> bool:
        """Whether it runs and can fork."""
        return not self.why_not and not self._gone()

    def describe(self) -> str:
        return f"rank server: pid {self.pid}"

    def ended_how(self) -> str:
        """How the server ended, in words ('' while it runs)."""
        return how_it_ended(self.process.returncode) if self._gone() else ""

    def _gone(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _send(self, message: dict) -> None:
        with self._send_lock:
            try:
                self.process.stdin.write((json.dumps(message) + "\n").encode())
                self.process.stdin.flush()
            except (OSError, ValueError) as exc:  # (closed: the server ended)
                raise ServerUnavailable(f"it has ended ({exc})") from None

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._replied:
                if "started" in message:
                    self.host_pid = message["started"]
                elif "ready" in message:
                    self.pid = message["ready"]
                    self._ready.set()
                elif "failed" in message:
                    self.why_not = message["failed"]
                    self._ready.set()
                elif "forked" in message:
                    self._replies[message["forked"]] = message
                    # (a pid the system gave again: an earlier rank's end is not this one's)
                    self._exits.pop(message.get("pid"), None)
                    self._exit_events.pop(message.get("pid"), None)
                elif "read" in message:
                    self._replies[message["read"]] = message
                elif "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                    self._exit_events.pop(message["exited"], threading.Event()).set()
                    continue
                self._replied.notify_all()
        self.process.stdout.close()  # (its end: the pipe is this thread's to close)
        said = _last_line(self.log_path)
        with self._replied:
            self.why_not = self.why_not or ("it ended" + (f": {said}" if said else ""))
            self._said_all = True
            self._ready.set()
            for event in self._exit_events.values():
                event.set()
            self._replied.notify_all()


def _last_line(path: str) -> str:
    """The last line a server wrote to its log (ssh's own complaint, over ssh)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    return next((ln for ln in reversed(lines) if ln), "")


def local_server(python: str, modules: list[str], log_path: str,
                 hash_seed: str = "", env: dict[str, str] | None = None) -> RankServer:
    """This machine's rank server, importing ``modules``, started; its ranks' string-hash
    secret is ``hash_seed``'s (PYTHONHASHSEED; '' for a random one); ``env``: more of its
    environment (a linger's)."""
    env = dict(env or {}, **({"PYTHONHASHSEED": hash_seed} if hash_seed else {}))
    server = RankServer([python, "-m", "spmd.engine.server", *modules], log_path, env=env)
    server.start()
    return server


class LingeringServer:
    """The rank server of a cluster a notebook attached to (linger.py): another notebook
    process started it, so this one has no pipe to it. It forks nothing more (a restart
    starts afresh); the stop ends it, and its ranks, by SIGTERM."""

    why_not = "it was started by the notebook process before this one"
    usable = False

    def __init__(self, pid: int) -> None:  # (the attach checked that it is still the one)
        self.pid = pid
        try:
            self.process = psutil.Process(pid)
        except psutil.Error:
            self.process = None

    def describe(self) -> str:
        return f"the rank server (pid {self.pid}, started by an earlier notebook process)"

    def close(self) -> bool:
        if self.process is None:
            return False
        with contextlib.suppress(psutil.Error):
            self.process.terminate()
            try:
                self.process.wait(6)
            except psutil.TimeoutExpired:
                self.process.kill()
                self.process.wait(3)
        return True


class SSHRankServers:
    """One rank server per host, each under an ssh command through that host's master
    connection, which this object also owns (the ranks' engine sets come and go at restarts;
    the connections and servers stay until the stop)."""

    def __init__(self, hosts: list[str], ssh_cmd: list[str], ssh_args: list[str], python: str,
                 modules: list[str], log_dir: str, folder: str, hash_seed: str = "",
                 linger: float = 0.0) -> None:
        self.hash_seed = hash_seed  # (every host's ranks get the same string-hash secret)
        # Seconds the cluster lingers (0: none): each server outlives its connection while
        # the cluster's controller runs (spmd/engine/server.py).
        self.linger = linger
        self.masters = ssh.Masters(ssh_cmd, ssh_args, hosts)
        self.folder = folder  # the cluster's folder on the hosts, removed as each server ends
        self.python, self.modules, self.log_dir = python, modules, log_dir
        self.servers: dict[str, RankServer] = {}
        # why the opening failed: a host that refused us (CalledProcessError), or another
        self.error: BaseException | None = None
        self._opened = threading.Event()
        self._closing = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # (the opening thread and a close, at a cancel)

    def start(self) -> None:
        """Log in and start the servers, on a thread: the caller goes on (the controller)."""
        threading.Thread(target=self._open, name="spmd-ssh-rank-servers", daemon=True).start()

    def _open(self) -> None:
        try:
            self._connect_and_start()
        except BaseException as exc:  # (said by wait_ready, in the start's own words)
            self.error = exc
        finally:
            self._opened.set()
            # The master connections end when the thread that started them ends (their
            # parent-death signal is per thread, see ssh._end_with_parent): this one stays,
            # idle, until the close.
            self._closing.wait()

    def _connect_and_start(self) -> None:
        with self._lock:
            if self._closed:
                return
            self.masters.connect()
            # (its shell says its pid first, which the exec keeps: see RankServer.kill)
            seed = [f"PYTHONHASHSEED={self.hash_seed}"] if self.hash_seed else []
            seed += [f"{REMOTE_LINGER_ENV}={self.linger!r}"] if self.linger else []
            seed = ["env", *seed] if seed else []
            remote = "printf '{\"started\": %d}\\n' $$ && exec " + shlex.join(
                [*seed, *ssh.python_there(self.python), "-m", "spmd.engine.server",
                 *self.modules]
            )
            for host in self.masters.hosts:
                log = os.path.join(self.log_dir, f"rank-server-{host.replace('/', '_')}.log")
                self.servers[host] = RankServer(
                    [*self._ssh(), "-T", host, remote], log,
                    kill=lambda pid, host=host: self._kill(host, pid),
                )
                self.servers[host].start()
                if not ssh.is_this_machine(host):  # (here, the folder is the notebook's own)
                    self.servers[host].remove_at_end(self.folder)

    def _ssh(self) -> list[str]:
        """ssh, for a command through a master connection."""
        return [*self.masters.ssh_cmd, *self.masters.ssh_args, *self.masters.args]

    def _kill(self, host: str, pid: int) -> None:
        if not self.lost(host):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([*self._ssh(), host, f"kill -KILL {int(pid)}"],
                               capture_output=True, timeout=10)

    def wait_ready(self, timeout: float) -> bool:
        """Whether every host's server is ready to fork; ``why_not`` says why one is not.
        Raises CalledProcessError for a host that could not be reached."""
        deadline = time.monotonic() + timeout
        self._opened.wait(timeout)
        if isinstance(self.error, subprocess.CalledProcessError):
            raise self.error
        if self.error is not None:
            raise ServerUnavailable(f"{type(self.error).__name__}: {self.error}")
        if not self._opened.is_set():
            raise ServerSlow(f"logging in took more than {timeout:.0f} s")
        if self._closed or len(self.servers) < len(self.masters.hosts):
            raise ServerUnavailable("the cluster was stopped during its start")
        for host, server in self.servers.items():
            if not server.wait_ready(max(0.0, deadline - time.monotonic())):
                self.why_not = f"on {host}, {server.why_not}"
                return False
        return True

    why_not = ""

    def of(self, host: str) -> RankServer:
        return self.servers[host]

    def lost(self, host: str) -> bool:
        """Whether ``host`` stopped answering (its connection ended)."""
        return self.masters.lost(host)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def usable(self) -> bool:
        return bool(self.servers) and all(s.usable for s in self.servers.values())

    def close(self) -> set[str]:
        """End every host's server (and the ranks they forked), then the connections. The
        hosts whose server ended by itself, removing the cluster's folder there."""
        with self._lock:
            self._closed = True
            hosts = list(self.servers)
            asked = []
            if hosts:
                with ThreadPoolExecutor(len(hosts)) as pool:
                    asked = list(pool.map(lambda h: self.servers[h].close(), hosts))
            self.masters.close()
        self._closing.set()
        return {host for host, yes in zip(hosts, asked) if yes}

    def describe(self) -> str:
        pids = ", ".join(f"{host} pid {s.pid}" for host, s in self.servers.items())
        return f"rank servers: {pids}"


