"""ipyparallel's Cluster, configured for short-lived SPMD jobs on 127.0.0.1.

Process management stays ipyparallel's (its launchers start, signal and stop every process);
this module only chooses the settings that make start and stop fast, and adds one coroutine
that starts the controller and the engines at the same time.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import time

import psutil
from ipyparallel import Cluster
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets.config import Config

from spmd.cluster.channel.client import SpmdClient
from spmd.cluster.launchers import remote, ssh
from spmd.engine import bootstrap as engine
from spmd.engine.join import placement
from spmd.engine.life.orphans import PARENT_ENV
from spmd.engine.watch.stacks import STACK_FILE_ENV

LOOPBACK = remote.LOOPBACK
# A rank whose controller is gone (the notebook was killed: its controller ends with it)
# exits after this many missed checks (~12-16 s), not ipyparallel's 50: a batch job or an
# mpiexec whose ranks nothing watches then ends instead of holding its nodes.
RANK_HEARTBEAT_MISSES = 20

# How much of a rank's output ``output_of`` reads by default (the death reports' last lines
# come from its end), as a rank server reads another host's (servers.RankServer.read).
OUTPUT_TAIL = 1 << 16


def heartbeat_ms(n: int) -> int:
    """The controller's heartbeat for ``n`` engines. ipyparallel's default (3 s) dominates
    start-up: engines are only "registered" after a beat. 300 ms brought a 4-engine start
    from ~6.6 s to ~2.7 s on 2 cores; 100 ms takes another ~0.1 s off a restart by fork. The
    controller answers every engine's beat in Python, so many engines get a slower one (at
    100 ms, 64 engines starting on 2 cores starved it, and registrations stalled)."""
    return min(300, max(100, 17 * n))


class RankedEngineLauncher(LocalEngineLauncher):
    """One local engine that knows its rank from the start.

    The rank is the engine's position in its set (the engine asks the controller for the
    same id, see ``spmd.engine.bootstrap.main``).
    """

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
            **{
                placement.RANK_ENV: str(self.identifier),
                placement.LOCAL_RANK_ENV: str(self.identifier),
                placement.LOCAL_SIZE_ENV: str(self.parent.n),
                STACK_FILE_ENV: self.stack_file,
            },
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


# --check-collectives: torch's own check, which wraps every process group in one that compares
# each collective's op, shapes and dtypes across the ranks before running it.
CHECK_COLLECTIVES_ENV = "TORCH_DISTRIBUTED_DEBUG"
# The user's settings for torch's backends that ranks on other hosts get too.
PASSED_THROUGH = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


def cluster_config(
    n: int,
    backend: str,
    cpu_devices: int | None,
    coordinators: dict[str, str],
    init_timeout: int,
    where: remote.Placement | None = None,
    address: str = LOOPBACK,
    gpus_per_process: int | None = None,
    torch_backend: str = "gloo",
    torch_init: str = "tcp",
    cache_dir: str | None = None,
    check_collectives: bool = False,
) -> Config:
    """The traitlets config of an SPMD cluster of ``n`` engines, placed as ``where`` says;
    the controller listens on ``address`` only. ``coordinators``: rank 0's address for each
    backend (jax, torch), or {} where rank 0 picks them."""
    where = where or remote.Placement()
    c = Config()
    c.Cluster.controller_ip = address
    c.Cluster.controller_location = address
    c.Cluster.delay = 0.0
    c.LocalControllerLauncher.controller_cmd = [sys.executable, "-m", "spmd.controller"]
    c.LocalControllerLauncher.environment = {PARENT_ENV: str(os.getpid())}
    c.Cluster.controller_args = [
        f"--HeartMonitor.period={heartbeat_ms(n)}",
        # An engine that misses beats for 3 s is unregistered, as ipyparallel's 10 misses of
        # 300 ms did (its heart answers from a C thread, even while a cell holds the GIL).
        f"--HeartMonitor.max_heartmonitor_misses={3000 // heartbeat_ms(n)}",
        # A registration waits for the engine's first beat; on a busy machine that can
        # take longer than ipyparallel's 30 s, and a purged one never completes.
        f"--IPController.registration_timeout={max(30, init_timeout)}",
        # Schedulers as threads, not processes: on 2 cores every process costs start-up time.
        "--IPController.use_threads=True",
        # No task database: nothing asks the hub for a request's record (controller/hub.py).
        "--IPController.db_class=NoDB",
        "--log-level=WARN",
    ]
    env = {
        engine.BACKEND_ENV: backend,
        engine.NUM_PROCESSES_ENV: str(n),
        engine.COORDINATOR_ENV: coordinators.get("jax", ""),
        engine.TORCH_MASTER_ENV: coordinators.get("torch", ""),
        engine.TORCH_BACKEND_ENV: torch_backend,
        engine.TORCH_INIT_ENV: torch_init,
        engine.INIT_TIMEOUT_ENV: str(init_timeout),
    }
    # Which network interface gloo and NCCL use: the user's choice reaches every host.
    env.update({k: os.environ[k] for k in PASSED_THROUGH if k in os.environ})
    if cpu_devices:
        env[engine.CPU_DEVICES_ENV] = str(cpu_devices)
    if cache_dir:
        env[engine.CACHE_DIR_ENV] = cache_dir
    if check_collectives:  # (read when torch.distributed is imported: the server's import)
        env[CHECK_COLLECTIVES_ENV] = "DETAIL"
    if gpus_per_process is not None:
        env[placement.GPUS_PER_PROCESS_ENV] = str(gpus_per_process)
    engine_args = [
        "--log-level=WARN",
        # The nanny is one more process per engine, for signals sent through the controller;
        # ranks take signals on their own control channel instead (spmd.engine.watch.answers).
        "--IPEngine.enable_nanny=False",
        f"--IPEngine.max_heartbeat_misses={RANK_HEARTBEAT_MISSES}",
        "--IPEngine.out_stream_factory=spmd.engine.shell.streams.OutStream",
    ]
    python = where.python or sys.executable
    engine_cmd = [*(ssh.python_there(python) if where.launcher != "local" else [python]),
                  "-m", "spmd.engine"]
    # A rank that ignores SIGTERM (blocked in a collective) is killed after this long.
    c.LocalProcessLauncher.stop_seconds_until_kill = 1
    if where.launcher != "local":
        c.Cluster.engine_launcher_class = remote.configure(c, where, engine_cmd, engine_args, env)
        # Remote engines cannot read this machine's files: the connection info (with the key
        # that signs messages) goes in their environment, through ssh, mpiexec or sbatch.
        c.Cluster.send_engines_connection_env = True
        return c
    c.Cluster.engine_launcher_class = RankedEngineSetLauncher
    # Engines find the controller's connection file themselves (they poll for it every
    # 0.1 s), so they can start, and import jax, while the controller is still starting.
    c.Cluster.send_engines_connection_env = False
    env[PARENT_ENV] = str(os.getpid())
    for launcher_cls in ("LocalEngineSetLauncher", "LocalEngineLauncher"):
        # (subclasses read their parent class's section of the config too)
        c[launcher_cls].engine_cmd = engine_cmd
        c[launcher_cls].environment = env
        c[launcher_cls].engine_args = engine_args
    c.LocalEngineSetLauncher.delay = 0.0
    return c


class SpmdCluster(Cluster):
    """A Cluster whose controller and engines start concurrently."""

    # The engine set whose engines are the ranks; None before the start.
    rank_set: str | None = None
    # The rank servers (servers.py) that fork the ranks; None without them.
    rank_server = None

    async def launch(self, n: int) -> None:
        """Start the controller and ``n`` engines at once."""
        _, self.rank_set = await asyncio.gather(self.start_controller(), self.start_engines(n))

    def engine_environment(self) -> dict[str, str]:
        """The environment this cluster's engine sets give their engines (from the config)."""
        for cls in self.engine_launcher_class.mro():
            section = self.config.get(cls.__name__) if cls.__name__ in self.config else None
            if section is not None and "environment" in section:
                return dict(section.environment)
        return {}

    async def connect_client(self, **client_kwargs):
        """ipyparallel's connect_client, with the client that keeps late outputs (client.py)."""
        connection_info = self.controller.get_connection_info()
        if inspect.isawaitable(connection_info):
            connection_info = await connection_info
        return SpmdClient(
            connection_info["client"],
            cluster=self,
            profile_dir=self.profile_dir,
            cluster_id=self.cluster_id,
            **client_kwargs,
        )

    async def replace_ranks(self, n: int, environment: dict[str, str]) -> None:
        """The ranks' engine set is stopped (if it is still there) and ``n`` new engines
        become the ranks."""
        if self.rank_set in self.engines:
            await self.stop_engines(self.rank_set)
        self.rank_set = await self.start_engines(n, environment=environment)

    def rank_launchers(self) -> dict[int, RankedEngineLauncher]:
        """The launcher (local process handle) of every local rank, by rank."""
        return {
            launcher.rank: launcher
            for launcher in self._engine_launchers()
            if isinstance(launcher, RankedEngineLauncher)
        }

    def ssh_launchers(self) -> dict[int, ssh.RankedSSHEngineLauncher]:
        """The launcher of every rank started over SSH, by rank."""
        return {
            launcher.rank: launcher
            for launcher in self._engine_launchers()
            if isinstance(launcher, ssh.RankedSSHEngineLauncher)
        }

    def launcher_process(self):
        """The one local process (mpiexec, sbatch's job) that runs ranks for a whole engine
        set, or None."""
        for engine_set in self.engines.copy().values():  # (a copy: the event-loop thread adds sets)
            if getattr(engine_set, "process", None) is not None:
                return engine_set
        return None

    def output_of(self, rank: int, tail: int = OUTPUT_TAIL) -> str:
        """What a rank's process wrote (for mpiexec and srun: every rank's, interleaved): on
        this machine its last ``tail`` bytes, read now. (ipyparallel keeps a launcher's whole
        file from its first read on: a death report after an attach, which read the logs,
        showed the lines from before it; and a log is as long as the rank printed.)"""
        launchers = self.rank_launchers()
        if rank in launchers:
            text = file_tail(launchers[rank].output_file, tail)
            # (a stop read and removed the file: ipyparallel's copy)
            return text if text is not None else launchers[rank].get_output()[-tail:]
        if rank in self.ssh_launchers():
            try:
                return self.ssh_launchers()[rank].fetch_output()
            except Exception:  # the host cannot be reached any more
                return ""
        for engine_set in self.engines.copy().values():
            try:
                return engine_set.get_output(remove=False)
            except Exception:
                continue
        return ""

    def _engine_launchers(self) -> list:
        """The launchers of the ranks' engines, those that ended included."""
        found = []
        for engine_set in self.engines.copy().values():  # (copies: see above)
            ended = getattr(engine_set, "ended", {}).copy()
            every = {**ended, **getattr(engine_set, "launchers", {}).copy()}
            found += [launcher for launcher in every.values() if launcher is not None]
        return found

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        launchers = self.rank_launchers()
        for rank in ranks:
            if rank in launchers:
                launchers[rank].signal(signum)


def cluster_log() -> logging.Logger:
    log = logging.getLogger("spmd.cluster")
    if not log.handlers:
        log.setLevel(logging.ERROR)
        log.addHandler(logging.StreamHandler(sys.stdout))
        log.propagate = False
    return log


def file_tail(path: str, size: int) -> str | None:
    """The last ``size`` bytes of a file, as text (None where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read(size).decode(errors="replace")
    except (OSError, TypeError):
        return None
