"""ipyparallel's Cluster, configured for short-lived SPMD jobs on 127.0.0.1.

Process management stays ipyparallel's (its launchers start, signal and stop every process);
this module only chooses the settings that make start and stop fast, and adds one coroutine
that starts the controller and the engines at the same time.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import time

import psutil
from ipyparallel import Cluster
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets.config import Config

from spmd.engine import bootstrap as engine
from spmd.engine.orphans import PARENT_ENV
from spmd.engine.stacks import STACK_FILE_ENV

LOOPBACK = "127.0.0.1"

# The coordinator's port is chosen now and bound a second later, by rank 0, after its jax
# import. In between, the controller binds random ports (zmq: 49152-65535) and every
# connection takes an ephemeral one (Linux: 32768-60999); a port below both is not taken by
# this start itself. A collision with another program is still possible, hence the retry.
_COORDINATOR_PORTS = (20000, 32768)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that is free now, outside the ranges other sockets draw from."""
    for _ in range(100):
        port = random.randrange(*_COORDINATOR_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

# ipyparallel's default heartbeat (3 s) dominates start-up: engines are only "registered"
# after a beat. 300 ms brings a 4-engine start from ~6.6 s to ~2.7 s on 2 cores.
HEARTBEAT_MS = 300


class RankedEngineLauncher(LocalEngineLauncher):
    """One local engine that knows its rank from the start.

    The rank is the engine's position in its set; the engine asks the controller for the
    same id, so sorted engine ids and ranks agree, as MPI launches do with MPI ranks.
    """

    def find_args(self) -> list[str]:
        return super().find_args() + [f"--IPEngine.id={self.identifier}"]

    exit_code: int | None = None  # negative: the signal that ended the process
    exited_at: float | None = None  # time.monotonic()

    @property
    def rank(self) -> int:
        return int(self.identifier)

    @property
    def stack_file(self) -> str:
        return os.path.join(self.profile_dir, "log", f"stacks-rank{self.identifier}.txt")

    def get_env(self) -> dict[str, str]:
        return dict(
            super().get_env(),
            **{engine.RANK_ENV: str(self.identifier), STACK_FILE_ENV: self.stack_file},
        )

    def _wait(self) -> None:
        """ipyparallel's wait thread, keeping the exit code where the notebook can read it.

        ipyparallel hands the exit code to its event loop, which does not turn while a cell
        runs; a death must be seen within a fraction of a second, in the middle of a cell.
        """
        exit_code = None
        while not self._stop_waiting.is_set() and self.state == "running":
            try:
                exit_code = self.process.wait(timeout=self.poll_seconds)
            except psutil.TimeoutExpired:
                continue
            else:
                break
        if exit_code is not None or not self._stop_waiting.is_set():
            self.exit_code, self.exited_at = exit_code, time.monotonic()
        stop_data = dict(exit_code=exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))
        if self._popen_process:
            self._popen_process.wait(0)


class RankedEngineSetLauncher(LocalEngineSetLauncher):
    launcher_class = RankedEngineLauncher

    def _notice_engine_stopped(self, data) -> None:
        # ipyparallel forgets an engine's launcher once it has stopped; the notebook still
        # needs its exit code and log to say which rank died and why.
        self.ended[data["identifier"]] = self.launchers.get(data["identifier"])
        super()._notice_engine_stopped(data)

    @property
    def ended(self) -> dict:
        return self.__dict__.setdefault("_ended", {})


def cluster_config(
    n: int, backend: str, cpu_devices: int | None, coordinator: str, init_timeout: int
) -> Config:
    """The traitlets config of an SPMD cluster of ``n`` local engines."""
    c = Config()
    c.Cluster.engine_launcher_class = RankedEngineSetLauncher
    c.Cluster.controller_ip = LOOPBACK
    c.Cluster.controller_location = LOOPBACK
    # Engines find the controller's connection file themselves (they poll for it every
    # 0.1 s), so they can start, and import jax, while the controller is still starting.
    c.Cluster.send_engines_connection_env = False
    c.Cluster.delay = 0.0
    c.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "spmd.cluster.controller"]
    c.LocalControllerLauncher.environment = {PARENT_ENV: str(os.getpid())}
    c.Cluster.controller_args = [
        f"--HeartMonitor.period={HEARTBEAT_MS}",
        # Schedulers as threads, not processes: on 2 cores every process costs start-up time.
        "--IPController.use_threads=True",
        "--log-level=WARN",
    ]
    env = {
        engine.BACKEND_ENV: backend,
        engine.NUM_PROCESSES_ENV: str(n),
        engine.COORDINATOR_ENV: coordinator,
        engine.INIT_TIMEOUT_ENV: str(init_timeout),
        PARENT_ENV: str(os.getpid()),
    }
    if cpu_devices:
        env[engine.CPU_DEVICES_ENV] = str(cpu_devices)
    for launcher_cls in ("LocalEngineSetLauncher", "LocalEngineLauncher"):
        # (subclasses read their parent class's section of the config too)
        c[launcher_cls].engine_cmd = [sys.executable, "-m", "spmd.engine"]
        c[launcher_cls].environment = env
        c[launcher_cls].engine_args = [
            "--log-level=WARN",
            # The nanny is one more process per engine, for signals sent through the controller;
            # local engines are signalled by their launcher's process handle instead.
            "--IPEngine.enable_nanny=False",
            "--IPEngine.out_stream_factory=spmd.engine.streams.OutStream",
        ]
    c.LocalEngineSetLauncher.delay = 0.0
    # A rank that ignores SIGTERM (blocked in a collective) is killed after this long.
    c.LocalProcessLauncher.stop_seconds_until_kill = 1
    return c


class SpmdCluster(Cluster):
    """A Cluster whose controller and engines start concurrently."""

    async def launch(self, n: int) -> None:
        """Start the controller and ``n`` engines at once."""
        await asyncio.gather(self.start_controller(), self.start_engines(n))

    def rank_launchers(self) -> dict[int, RankedEngineLauncher]:
        """The launcher (process handle) of every rank, by rank."""
        found = {}
        for engine_set in self.engines.values():
            every = {**getattr(engine_set, "ended", {}), **getattr(engine_set, "launchers", {})}
            for identifier, launcher in every.items():
                if launcher is not None:
                    found[int(identifier)] = launcher
        return found

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        launchers = self.rank_launchers()
        for rank in ranks:
            if rank in launchers:
                launchers[rank].signal(signum)
