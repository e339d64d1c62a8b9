"""The ipyparallel launchers whose ranks a rank server forks (servers.py): on this machine,
and on other hosts over ssh.

Threads: ipyparallel's event-loop thread starts, signals and stops the launchers; each rank's
wait thread (ipyparallel's ``_wait``) reads its end from its server's replies.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil

from spmd.cluster.launchers import ssh
from spmd.cluster.launchers.launch import (
    RankedEngineLauncher,
    RankedEngineSetLauncher,
    file_tail,
)
from spmd.cluster.launchers.processes import Ended
from spmd.cluster.launchers.servers import RankServer, ServerUnavailable, SSHRankServers


class ForkedEngineLauncher(RankedEngineLauncher):
    """One local rank, forked by the rank server instead of started as a new Python."""

    @property
    def server(self) -> RankServer:
        return self.parent.server

    def start(self) -> None:
        """Ask the server for this rank's fork; ``started`` (called by the set once every
        rank's fork is asked for) waits for it."""
        env = dict(os.environ, **self.get_env())
        # Its folder is the notebook's now, as a fresh start's is: the server's own is the
        # notebook's at the cluster's start, and so is the engine app's default folder,
        # which it changes to (ipyparallel read the folder when the server imported it).
        folder = os.path.abspath(self.work_dir)
        argv = [*_engine_argv(self.args), f"--IPEngine.work_dir={folder}"]
        self.server.ask_fork(self.fork_key, env, argv, self.output_file, folder)

    @property
    def fork_key(self) -> str:
        """This rank's name in its server's replies and log (engine set/rank)."""
        return f"{self.parent.engine_set_id}/{self.identifier}"

    def fork_failure(self) -> str:
        """What the server wrote of this rank's fork failing before the rank's output was its
        own file (server.py: a line naming the fork, then the traceback's end); ''."""
        marker = f"The fork for {self.fork_key} failed:"
        text = file_tail(getattr(self.server, "log_path", ""), 20000) or ""
        if marker not in text:
            return ""
        section = text[text.rindex(marker):].split("\nThe fork for ")[0].splitlines()
        return "\n".join([section[0], *section[1:][-4:]])

    def started(self) -> None:
        self.pid = self.server.forked(self.fork_key)
        try:
            self.process = psutil.Process(self.pid)
        except psutil.NoSuchProcess:  # (it ended at once: the start or restart says so)
            self.process = Ended(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()

    def _wait(self) -> None:
        """Until the server reports the rank's end (it is the rank's parent: only it reads
        the exit code), keeping the code where the notebook reads it (see the parent's)."""
        ended, code = False, None
        while not self._stop_waiting.is_set() and self.state == "running" and not ended:
            ended, code = self.server.exit_code(self.pid, timeout=0.5)
        if ended or not self._stop_waiting.is_set():
            self.exit_code, self.exited_at = (code if ended else None), time.monotonic()
        stop_data = dict(exit_code=self.exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class ForkedEngineSetLauncher(RankedEngineSetLauncher):
    """The local ranks, forked by the cluster's rank server; started the usual way (a Python
    each) where the server could not be used, which ``fell_back`` then says."""

    launcher_class = ForkedEngineLauncher
    fell_back = ""

    @property
    def server(self) -> RankServer:
        return self.parent.rank_server

    async def start(self, n: int):
        server = self.server
        if not await _ready(server, self.parent.engine_timeout):
            self.fell_back = server.why_not
            self.launcher_class = RankedEngineLauncher
        started = super().start(n)  # (every rank's fork asked for, in one go)
        if not self.fell_back:
            for launcher in self.launchers.values():
                launcher.started()
        return started


async def _ready(server: RankServer | SSHRankServers, timeout: float) -> bool:
    """Whether the server(s) can fork, waited for on a thread (their imports, logins), so
    the event loop starts the controller meanwhile. ServerUnavailable when the cluster was
    stopped in the meantime: nothing starts then."""
    ready = await asyncio.get_running_loop().run_in_executor(None, server.wait_ready, timeout)
    if server.closed:
        raise ServerUnavailable("the cluster was stopped during its start")
    return ready


def _controller_of(env: dict[str, str]) -> str:
    """The controller's registration port as "host:port", from the connection info the
    engines get in their environment (ipyparallel's $IPP_CONNECTION_INFO): what another
    host's server watches while the cluster lingers ('' where it is not there)."""
    try:
        info = json.loads(env.get("IPP_CONNECTION_INFO") or "{}")
        host = str(info["interface"]).split("://", 1)[-1]
        if host in ("*", "0.0.0.0", ""):  # (bound to every interface: where it runs)
            host = str(info["location"])
        return f"{host}:{int(info['registration'])}"
    except (KeyError, TypeError, ValueError):
        return ""


def _engine_argv(args: list[str]) -> list[str]:
    """The engine's command line as the forked rank sees it (what follows ``-m spmd.engine``)."""
    return [args[0], *args[args.index("spmd.engine") + 1:]]


class ForkedSSHEngineLauncher(ssh.RankedSSHEngineLauncher):
    """One rank on another host, forked by that host's rank server: its start, signals, end
    and output go over the server's one ssh command, not a login each."""

    @property
    def server(self) -> RankServer:
        return self.parent.servers.of(self.location)

    def start(self, hostname=None, user=None, port=None) -> None:
        if hostname is not None:
            self.hostname = hostname
        if user is not None:  # (--hosts alice@node1: the server is that login's)
            self.user = user
        self.loop  # noqa: B018 (bound here, on the loop's thread, where the wait thread reports)
        key = f"{self.parent.engine_set_id}/{self.identifier}"
        # (its environment: the host's own, as a login gives it, and the rank's)
        env = self.get_env()
        self.pid = self.server.fork(
            key, env, _engine_argv(self.program + self.program_args),
            self.remote_output_file, cwd="",
            keep_env=True, controller=_controller_of(env),
        )
        self.notify_start({"host": self.location, "pid": self.pid})
        self._start_waiting()

    def signal(self, sig) -> None:
        if self.lost or self.state != "running" or (
            sig == signal.SIGTERM and self.ended_by_control
        ):
            return
        self.server.signal(self.pid, sig)

    def kill_now(self) -> None:
        if not self.lost and self.state == "running":
            self.server.signal(self.pid, signal.SIGKILL, group=True)

    def _wait(self) -> None:
        """Until the server reports the rank's end; a server gone with its connection means
        the host stopped answering."""
        ended, code = False, None
        while not self._stop_waiting.is_set() and self.state == "running" and not ended:
            ended, code = self.server.exit_code(self.pid, timeout=0.5)
        if ended and code is None:
            # (the server's ssh ends as its master connection does, which may be a moment
            # before that connection's own process has ended)
            deadline = time.monotonic() + 1.0
            while not self.parent.servers.lost(self.location) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.lost = self.parent.servers.lost(self.location)
        if ended or not self._stop_waiting.is_set():
            self.exit_code, self.exited_at = (code if ended else None), time.monotonic()
        stop_data = dict(exit_code=self.exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    async def join(self, timeout=None) -> None:
        if self.state != "running" or self.lost:  # (a lost host says nothing more)
            return
        ended, _ = await asyncio.get_running_loop().run_in_executor(
            None, self.server.exit_code, self.pid, 5.0 if timeout is None else timeout
        )
        if not ended:
            raise TimeoutError(f"rank {self.rank} did not end")

    def fetch_output(self) -> str:
        if not self.lost and self.server.usable:
            self._output = self.server.read(self.remote_output_file)
        return self._output or ""


class ForkedSSHEngineSetLauncher(ssh.RankedSSHEngineSetLauncher):
    """The ranks on other hosts, forked by each host's rank server, through the connections
    the servers keep (``SSHRankServers``); started the usual way (a remote Python each, over
    connections of the set's own) where a server could not be used, which ``fell_back``
    says."""

    launcher_class = ForkedSSHEngineLauncher
    fell_back = ""

    @property
    def servers(self) -> SSHRankServers:
        return self.parent.rank_server

    async def _start(self, n):
        servers = self.servers
        if not await _ready(servers, self.parent.engine_timeout):
            self.fell_back = servers.why_not
            self.launcher_class = ssh.RankedSSHEngineLauncher
            await asyncio.get_running_loop().run_in_executor(None, servers.close)
        return await super()._start(n)

    def _connect(self) -> None:
        if self.fell_back:
            super()._connect()
        else:  # (the servers' connections: they outlive this set, for a restart)
            self._use(self.servers.masters)

    def _disconnect(self) -> None:
        if self.fell_back:
            super()._disconnect()
