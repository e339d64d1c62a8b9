"""A Session: one SPMD cluster's life, its rank table, and cells run on it in lockstep."""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from spmd.kernel import engine
from spmd.kernel.cluster import LOOPBACK, SpmdCluster, cluster_config
from spmd.kernel.lockstep import CellRun, rank_set
from spmd.kernel.outputs import Output


class OutOfStep(RuntimeError):
    """A cell was refused because an earlier one left the ranks out of step."""


class StartError(RuntimeError):
    """The cluster could not be started; nothing is left running. The text says why."""


@dataclass(frozen=True)
class Settings:
    """What ``%spmd start`` was asked for; a restart reuses it."""

    n: int
    cpu_devices: int | None = None
    backend: str = "jax"
    cell_timeout: float | None = None
    start_timeout: float = 120.0


@dataclass
class Rank:
    """One row of the rank table."""

    rank: int
    engine_id: int
    pid: int = 0
    host: str = ""
    local_devices: int = 0
    global_devices: int = 0
    state: str = "idle"  # idle | busy | dead
    last_seconds: float | None = None


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exited(process) -> bool:
    """Whether a psutil process handle has ended (a zombie has ended too)."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _init_failure(rank: int, exc: Exception) -> StartError:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    if ename == "BackendMissing":
        return StartError(
            f"{evalue.split(': ')[0]}: install it there, or start with --backend none."
        )
    return StartError(f"Rank {rank} failed to initialize: {ename}: {evalue}")


@dataclass
class Session:
    settings: Settings
    ranks: list[Rank] = field(default_factory=list)
    start_seconds: float = 0.0
    cluster: SpmdCluster | None = None
    client: object | None = None
    out_of_step: str = ""
    _profile_dir: str | None = None

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engines and join them into one distributed job. Raises StartError."""
        t0 = time.perf_counter()
        self._profile_dir = tempfile.mkdtemp(prefix="spmd-")
        atexit.register(self.stop)
        try:
            self._init_cluster()
            self._init_client()
            self._init_distributed()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0

    def _init_cluster(self) -> None:
        s = self.settings
        self.cluster = SpmdCluster(
            n=s.n,
            profile_dir=self._profile_dir,
            config=cluster_config(
                s.n,
                s.backend,
                s.cpu_devices,
                coordinator=f"{LOOPBACK}:{free_port()}",
                init_timeout=int(s.start_timeout),
            ),
            engine_timeout=int(s.start_timeout),
            log_level=40,  # errors only: the notebook is not ipyparallel's log
            shutdown_atexit=False,  # Session.start registers its own, faster, stop
        )
        self.cluster.launch_sync(s.n)

    def _init_client(self) -> None:
        s = self.settings
        client = self.client = self.cluster.connect_client_sync()
        deadline = time.monotonic() + s.start_timeout
        # Poll rather than wait_for_engines(timeout): an engine that crashes at start should
        # fail the start at once, not after the whole timeout.
        while len(client.ids) < s.n:
            exited = self._exited_engines()
            if exited:
                raise StartError(f"An engine process exited during start-up{exited}")
            if time.monotonic() > deadline:
                raise StartError(
                    f"Only {len(client.ids)} of {s.n} engines registered within "
                    f"{s.start_timeout:.0f} s: check the engines' Python environment."
                )
            time.sleep(0.01)
        # Rank = position in the sorted engine ids at start (ids change after a restart).
        self.ranks = [Rank(rank=r, engine_id=eid) for r, eid in enumerate(sorted(client.ids))]

    def _init_distributed(self) -> None:
        s = self.settings
        pending = {r.rank: self.client[r.engine_id].apply_async(engine.joined) for r in self.ranks}
        deadline = time.monotonic() + s.start_timeout
        while pending:
            for rank, ar in list(pending.items()):
                if not ar.ready():
                    continue
                del pending[rank]
                try:
                    facts = ar.get()
                except Exception as exc:  # a RemoteError carries the engine's exception
                    raise _init_failure(rank, exc) from None
                row = self.ranks[rank]
                assert facts["rank"] == rank, "an engine did not get the id it asked for"
                row.pid, row.host = facts["pid"], facts["host"]
                row.local_devices = facts["local_devices"]
                row.global_devices = facts["global_devices"]
            if pending and time.monotonic() > deadline:
                raise StartError(
                    f"Ranks {sorted(pending)} did not initialize within {s.start_timeout:.0f} s."
                )
            time.sleep(0.005)

    def _exited_engines(self) -> str:
        """'' while every engine runs; else which exited, and the end of one's log."""
        exited = {r: p for r, p in self.cluster.rank_launchers().items() if _exited(p.process)}
        if not exited:
            return ""
        rank, launcher = min(exited.items())
        with open(launcher.output_file, errors="replace") as log:
            tail = "\n".join(log.read().strip().splitlines()[-5:]) or "(nothing)"
        return f" (rank {rank}); the last lines it wrote:\n{tail}"

    @property
    def running(self) -> bool:
        return self.cluster is not None

    def stop(self) -> None:
        """End every engine and the controller. Safe to call twice, and at exit."""
        atexit.unregister(self.stop)
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        if client is not None:
            client.close(linger=0)
        if cluster is not None:
            # Engines exit on SIGTERM at once (engine.initialize installs that); one that is
            # stuck in C++ is killed after LocalProcessLauncher.stop_seconds_until_kill.
            cluster.stop_cluster_sync()
        for r in self.ranks:
            r.state = "dead"
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None

    def signal(self, signum: int = signal.SIGINT, ranks: list[int] | None = None) -> None:
        """Send a signal to the processes of some ranks (default: all)."""
        if self.cluster is not None:
            all_ranks = [r.rank for r in self.ranks]
            self.cluster.signal_ranks(all_ranks if ranks is None else ranks, signum)

    # -- cells --------------------------------------------------------------------------

    def run_cell(
        self,
        code: str,
        ranks: list[int] | None = None,
        timeout: float | None = None,
        on_output: Callable[[int, Output], None] | None = None,
        tick: Callable[[CellRun], None] | None = None,
    ) -> CellRun:
        """Send ``code`` to the ranks and wait until every one has finished (lockstep).

        On a timeout, or when the notebook is interrupted, the ranks still busy get SIGINT
        and a short grace to finish; ``run.stopped_by`` then says why the wait ended early.
        """
        if self.out_of_step:
            raise OutOfStep(self.out_of_step)
        targets = {r.rank: r.engine_id for r in self.ranks if ranks is None or r.rank in ranks}
        run = CellRun(self.client, targets, code, on_output=on_output)
        for rank in targets:
            self.ranks[rank].state = "busy"
        run.send()
        timeout = timeout or self.settings.cell_timeout
        until = None if timeout is None else run.started + timeout
        try:
            if not run.wait(until=until, tick=tick):
                run.stopped_by = f"timed out after {timeout:g} s"
                self._interrupt(run)
        except KeyboardInterrupt:
            run.stopped_by = "interrupted"
            self._interrupt(run)
        finally:
            for rank, cell in run.cells.items():
                if cell.done:
                    self.ranks[rank].state = "idle"
                    self.ranks[rank].last_seconds = cell.seconds
        return run

    def _interrupt(self, run: CellRun, grace: float = 2.0) -> None:
        busy = run.busy_ranks
        self.signal(signal.SIGINT, busy)
        run.wait(until=time.monotonic() + grace)
        # Ranks that were stopped inside a collective are out of step with the others: the
        # next collective would hang. Only a restart brings them back together.
        self.out_of_step = (
            f"ranks {rank_set(busy)} were interrupted in the middle of a cell "
            f"({run.stopped_by}), so the ranks are out of step: %spmd restart before going on."
        )
