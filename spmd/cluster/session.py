"""A Session: one SPMD cluster's life, its rank table, and cells run on it in lockstep."""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spmd.cluster import control, processes, remote, ssh, where
from spmd.cluster.controller import CURVE_ENV
from spmd.cluster.launch import (
    LOOPBACK,
    RankedEngineLauncher,
    SpmdCluster,
    cluster_config,
)
from spmd.cluster.lockstep import CellRun, rank_words
from spmd.cluster.logs import RankLogs
from spmd.cluster.outputs import Output
from spmd.cluster.profiles import new_profile_dir
from spmd.cluster.watchdog import DIED, DIVERGED, INTERRUPTED, TIMEOUT, Death, Stall, last_lines
from spmd.engine import bootstrap as engine
from spmd.engine.address import coordinator_addresses


def _loopback_ports(backend: str) -> dict[str, str]:
    """A free port on 127.0.0.1 for each backend's coordinator (jax's and torch's differ)."""
    return coordinator_addresses(LOOPBACK, [b for b in backend.split(",") if b != "none"])


def _wait_listening(address: str, rank0, seconds: float) -> None:
    """Until something listens at ``address`` (host:port), rank 0's join ended, or
    ``seconds`` passed."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not rank0.ready():
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.005)


def _cluster_log() -> logging.Logger:
    log = logging.getLogger("spmd.cluster")
    if not log.handlers:
        log.setLevel(logging.ERROR)
        log.addHandler(logging.StreamHandler(sys.stdout))
        log.propagate = False
    return log


# Where a standby set can start beside the ranks: mpiexec and srun start one job step,
# whose ranks all come and go together.
STANDBY_LAUNCHERS = ("local", "ssh")

# How long the other ranks may take to finish their cell once one died (see _stop_waiting).
AFTER_DEATH_SECONDS = 0.5


class OutOfStep(RuntimeError):
    """A cell was refused: an earlier one left the ranks out of step, or a rank died."""


class StartError(RuntimeError):
    """The cluster could not be started; nothing is left running. The text says why."""


@dataclass(frozen=True)
class Settings:
    """What ``%spmd start`` was asked for; a restart reuses it."""

    n: int
    cpu_devices: int | None = None
    backend: str = "jax"  # jax, torch, "jax,torch" or none
    torch_backend: str = "gloo"  # gloo, nccl or mpi
    init_method: str = "tcp"  # torch's: tcp, env, file (in the cluster's folder) or file:///path
    cell_timeout: float | None = None
    # Seconds the other ranks may still run after one finished before the watchdog reports
    # them (None: never). Ranks of one SPMD program finish a cell together, give or take.
    grace: float | None = 2.0
    start_timeout: float = 120.0
    where: remote.Placement = remote.Placement()
    gpus_per_process: int | None = None  # None: an equal share of each host's GPUs
    curve: bool = True  # encrypt (CurveZMQ) when ranks may run on other machines
    # A second set of engines, ready for a restart: None means on where this machine has
    # room for both sets, and on over ssh; False turns them off.
    standby: bool | None = None
    # jax's persistent compilation cache: a folder named by the user (kept), or None for one
    # of the cluster's own (kept across restarts, emptied at stop).
    cache_dir: str | None = None
    # Stream lines of one rank kept in the notebook per cell (the first and last half); the
    # rank's log keeps every line. None keeps them all.
    max_output: int | None = 1000


@dataclass
class Rank:
    """One row of the rank table."""

    rank: int
    engine_id: int
    pid: int = 0
    host: str = ""
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES it was given (None: left alone)
    local_devices: int = 0
    global_devices: int = 0
    state: str = "idle"  # idle | busy | died | stopped
    last_seconds: float | None = None
    main_thread: int | None = None  # the thread ident that runs cells, for stack dumps
    memory: int = 0  # the process's resident memory in bytes, where known (0: not known)


def _init_failure(rank: int, exc: Exception) -> StartError:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    if ename == "BackendMissing":
        return StartError(
            f"{evalue}: install it there, or start with --backend none."
        )
    if ename in ("GpuError", "TorchSetupError"):  # (its text names the host and says what to do)
        return StartError(evalue)
    return StartError(f"Rank {rank} failed to initialize: {ename}: {evalue}")


@dataclass
class Session:
    settings: Settings
    ranks: list[Rank] = field(default_factory=list)
    start_seconds: float = 0.0
    cluster: SpmdCluster | None = None
    client: object | None = None
    out_of_step: str = ""  # why cells are refused until a restart ('' when they are not)
    unfinished: CellRun | None = None  # a cell some ranks still run after the notebook gave up
    death: Death | None = None  # the first rank to die; the cluster was stopped after it
    _launchers: dict[int, RankedEngineLauncher] = field(default_factory=dict)  # local ranks
    _ssh: dict = field(default_factory=dict)  # ranks started over ssh: their launchers
    _vanished: dict[int, float] = field(default_factory=dict)  # other ranks, gone since when
    _address: str = LOOPBACK  # where the controller listens
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _profile_dir: str | None = None
    _cache_dir: str | None = None  # the compilation cache the ranks share
    _generation: int = 0  # engine sets started so far: their engine ids do not overlap
    _torch_method: str = ""  # torch's init method as the ranks got it ('' without torch)
    _settling: dict = field(default_factory=dict)  # standby engine id: its settle() call
    _standby_start: object | None = None  # the standby set's start (a Future), while it runs
    # The text of recent cells, to show the lines of a stack dump (see where.with_sources).
    _cells: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    logs: RankLogs = field(default_factory=RankLogs)  # every line each rank printed
    # Told how a start goes: ("registered" | "joined", how many so far, of how many, the
    # coordinator's address or '').
    progress: Callable[[str, int, int, str], None] | None = None
    coordinator: str = ""  # rank 0's address for the others (jax's, else torch's)

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engines and join them into one distributed job. Raises StartError."""
        t0 = time.perf_counter()
        if self.settings.where.on_this_machine:
            try:
                processes.check_room(self.settings.n)
            except processes.StartRefused as exc:
                raise StartError(str(exc)) from None
        if self._cache_dir is None and "jax" in self.settings.backend:
            self._cache_dir = self.settings.cache_dir or tempfile.mkdtemp(prefix="spmd-jax-cache-")
        for attempt in (1, 2):
            self._profile_dir = new_profile_dir()
            atexit.register(self.stop)
            try:
                self._init_cluster()
                self._init_client()
                self._init_distributed()
                self._start_standby()
                break
            except StartError as exc:
                self.stop()
                # another program took the coordinator's port in the meantime: once more
                cancelled = self._cancelled.is_set()
                if attempt == 2 or cancelled or "Failed to start RPC server" not in str(exc):
                    raise
            except BaseException:
                self.stop()
                raise
        self.start_seconds = time.perf_counter() - t0

    def cancel(self) -> None:
        """Make a ``start`` running on another thread give up soon, stopping what it began."""
        self._cancelled.set()

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise StartError("The start was cancelled.")

    def _init_cluster(self) -> None:
        s, placed = self.settings, self.settings.where
        try:
            self._address = remote.controller_address(placed, placed.ssh_args)
        except remote.HostsError as exc:
            raise StartError(f"{exc}.") from None
        # Local ranks: rank 0 is here. Elsewhere rank 0 proposes its own addresses.
        coordinators = _loopback_ports(s.backend) if placed.launcher == "local" else {}
        self._tell_coordinator(coordinators)
        config = cluster_config(
            s.n,
            s.backend,
            s.cpu_devices,
            coordinators=coordinators,
            init_timeout=int(s.start_timeout),
            where=placed,
            address=self._address,
            gpus_per_process=s.gpus_per_process,
            torch_backend=s.torch_backend,
            torch_init=self._torch_init(),
            # (on other hosts, only a folder the user named: this machine's is not theirs)
            cache_dir=self._cache_dir if placed.on_this_machine else s.cache_dir,
        )
        if s.curve and self._address != LOOPBACK:
            config.LocalControllerLauncher.environment[CURVE_ENV] = "1"
        if placed.launcher == "slurm":  # (ipyparallel writes it in the current folder)
            config.SpmdSlurmEngineSetLauncher.batch_file_name = f"{self._profile_dir}/engines.sbatch"
        self.cluster = SpmdCluster(
            n=s.n,
            profile_dir=self._profile_dir,
            config=config,
            engine_timeout=int(s.start_timeout),
            # Errors only: the notebook is not ipyparallel's log. (Its own choice of logger
            # depends on what runs: a kernel app's, when the SPMD kernel starts its cluster
            # before the kernel is up, would show its warnings in the first cell.)
            log=_cluster_log(),
            shutdown_atexit=False,  # Session.start registers its own, faster, stop
        )
        # Always on the cluster's own event-loop thread (ipyparallel's ``_in_thread``, which
        # its ``_sync`` methods use inside a running loop): the launchers keep the loop they
        # started on, and a kernel starts its cluster from a background thread with no loop.
        try:
            self.cluster._in_thread(self.cluster.launch, s.n)
        except OSError as exc:  # the system refused a process (BlockingIOError, EAGAIN...)
            raise StartError(
                f"The system refused to start the processes ({type(exc).__name__}: {exc}): "
                "start fewer ranks."
            ) from None
        except subprocess.CalledProcessError as exc:  # ssh, sbatch or mpiexec said no
            raise StartError(remote.launch_failure(placed, exc)) from None

    def _torch_init(self) -> str:
        """torch's init method as the ranks get it: ``file`` becomes a file in the cluster's
        folder. A file left by an earlier start would break this one: it is removed first."""
        method = self.settings.init_method
        if method == "file":
            method = f"file://{self._profile_dir}/torch-init"
        self._torch_method = method if "torch" in self.settings.backend else ""
        self._remove_torch_file()
        return method

    def _remove_torch_file(self) -> None:
        if self._torch_method.startswith("file://"):
            with contextlib.suppress(OSError):
                os.remove(self._torch_method[len("file://"):])

    def _init_client(self) -> None:
        s = self.settings
        client = self.client = self.cluster._in_thread(self.cluster.connect_client)
        deadline = time.monotonic() + s.start_timeout
        # Poll rather than wait_for_engines(timeout): an engine that crashes at start should
        # fail the start at once, not after the whole timeout.
        registered = -1
        while len(client.ids) < s.n:
            if len(client.ids) != registered:
                registered = len(client.ids)
                self._tell("registered", registered, s.n)
            self._check_cancelled()
            exited = self._exited_engines()
            if exited:
                raise StartError(f"An engine process exited during start-up{exited}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(s.n)) - set(client.ids))  # (engine id = rank)
                hosts = remote.hosts_of(s.where, missing)
                where_ = f" (on {', '.join(hosts)})" if hosts else ""
                raise StartError(
                    f"Only {len(client.ids)} of {s.n} engines registered within "
                    f"{s.start_timeout:.0f} s; {rank_words(missing)}{where_} did not: check the "
                    "engines' Python environment there, or give them more time with "
                    "--start-timeout."
                )
            time.sleep(0.01)
        self._tell("registered", s.n, s.n)
        # Rank = position in the sorted engine ids at start (ids change after a restart).
        self.ranks = [Rank(rank=r, engine_id=eid) for r, eid in enumerate(sorted(client.ids))]
        self._launchers = self.cluster.rank_launchers()
        self._ssh = self.cluster.ssh_launchers()

    def _init_distributed(self, coordinators: dict[str, str] | None = None) -> None:
        """Wait until every rank has joined; ``coordinators`` go to ranks that were not given
        them at launch (promoted standbys; remote ranks get rank 0's proposal)."""
        s = self.settings
        if coordinators is None and s.where.launcher != "local" and s.backend != "none":
            try:
                coordinators = self.call(
                    0, engine.propose_coordinators, self._address, timeout=s.start_timeout
                )
            except Exception as exc:
                raise _init_failure(0, exc) from None
        self._tell_coordinator(coordinators or {})
        self._tell("joined", 0, s.n)
        pending = {0: self.client[self.ranks[0].engine_id].apply_async(engine.joined, coordinators)}
        if coordinators:
            # Rank 0 first, until its coordinator listens: a rank that connects earlier is
            # refused and retries after gRPC's back-off (about a second, seen in 1 of 2
            # promotions), which is most of a restart from standbys. (Rank 0 proposed an
            # address that this machine reaches.)
            _wait_listening(next(iter(coordinators.values())), pending[0], seconds=5.0)
        pending.update(
            {
                r.rank: self.client[r.engine_id].apply_async(engine.joined, coordinators)
                for r in self.ranks[1:]
            }
        )
        deadline = time.monotonic() + s.start_timeout
        while pending:
            self._check_cancelled()
            for rank, ar in list(pending.items()):
                if not ar.ready():
                    continue
                del pending[rank]
                try:
                    facts = ar.get()
                except Exception as exc:  # a RemoteError carries the engine's exception
                    raise _init_failure(rank, exc) from None
                row = self.ranks[rank]
                if facts["rank"] != rank:  # it asked the controller for id = rank, and got another
                    raise StartError(
                        f"Rank {rank}'s engine registered as rank {facts['rank']}, so the ranks "
                        "would be mixed up: start again."
                    )
                row.pid, row.host, row.gpus = facts["pid"], facts["host"], facts.get("gpus")
                row.local_devices = facts["local_devices"]
                row.global_devices = facts["global_devices"]
                row.main_thread = facts["main_thread"]
                self._tell("joined", s.n - len(pending), s.n)
            if pending and time.monotonic() > deadline:
                raise StartError(
                    f"Ranks {sorted(pending)} did not initialize within {s.start_timeout:.0f} s."
                )
            time.sleep(0.005)

    def _tell_coordinator(self, coordinators: dict[str, str]) -> None:
        if coordinators:
            self.coordinator = coordinators.get("jax") or next(iter(coordinators.values()))

    def _tell(self, stage: str, done: int, of: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, of, self.coordinator)

    # -- standby engines ----------------------------------------------------------------

    def _standby_wanted(self) -> bool:
        s = self.settings
        if s.standby is False or s.where.launcher not in STANDBY_LAUNCHERS:
            return False
        if not s.where.on_this_machine:
            # Other hosts: standbys hold no GPU memory (jax and torch only start their
            # devices when a rank joins), and the hosts' memory is theirs to judge.
            return True
        # on by default where both sets fit; asked for (True), where the one more set fits
        return processes.max_local_ranks() >= (2 * s.n if s.standby is None else s.n)

    def _start_standby(self) -> None:
        """Start a set of standby engines behind the ranks: jax (or torch) imported at low
        priority, waiting to be promoted by a restart. Returns once the processes are
        started (locally), or at once (over ssh); they import alone."""
        if self.cluster is None or not self._standby_wanted():
            return
        self._generation += 1
        environment = dict(
            self.cluster.engine_environment(),
            **{
                engine.STANDBY_ENV: "1",
                engine.ENGINE_ID_OFFSET_ENV: str(self._generation * self.settings.n),
                # their coordinators come with the promotion
                engine.COORDINATOR_ENV: "",
                engine.TORCH_MASTER_ENV: "",
            },
        )
        self._settling = {}
        self._standby_start = self.cluster.in_background(
            self.cluster.start_standby, self.settings.n, environment
        )
        if self.settings.where.launcher == "local":
            # Local processes start in milliseconds: a start returns with every process it
            # began. Over ssh that takes a second or more, which a restart does not wait for.
            self._standby_started(self.settings.start_timeout)

    def _standby_started(self, seconds: float) -> bool:
        """Wait until the standby set's start returned; whether it started."""
        starting, self._standby_start = self._standby_start, None
        if starting is None:
            return True
        try:
            starting.result(timeout=seconds)
        except Exception:  # a host refused, or it did not finish in time: no standbys
            self._standby_start = starting if not starting.done() else None
            return False
        return True

    def standbys(self) -> list[Rank]:
        """The standby engines, as rows (rank = the rank each would become); [] if none.
        state: ready (backends imported), starting, or failed (exited, or its import did)."""
        if self.cluster is None:
            return []
        rows = []
        offset = self._generation * self.settings.n
        registered = set(self.client.ids) if self.client is not None else set()
        for rank, launcher in sorted(self.cluster.standby_launchers().items()):
            engine_id = offset + rank
            settling = self._settling.get(engine_id)
            if settling is None and engine_id in registered:
                settling = self._settling[engine_id] = self.client[engine_id].apply_async(
                    engine.settle
                )
            done = settling is not None and settling.ready()
            settled = settling.get() if done and settling.successful() else {}
            if processes.launcher_ended(launcher):
                state = "failed"
            elif not done:
                state = "starting"
            else:
                state = "ready" if settled else "failed"
            rows.append(
                Rank(
                    rank=rank, engine_id=engine_id, pid=launcher.pid or 0, state=state,
                    host=self.ranks[rank].host if rank < len(self.ranks) else "",
                    memory=settled.get("memory", 0),
                )
            )
        return rows

    def _standbys_ready(self, seconds: float = 60.0) -> list[Rank]:
        """The standbys once all are ready (waiting while they start); [] if one failed."""
        deadline = time.monotonic() + seconds
        if not self._standby_started(seconds):
            return []
        while True:
            standbys = self.standbys()
            states = {r.state for r in standbys}
            if len(standbys) != self.settings.n or "failed" in states:
                return []
            if states == {"ready"}:
                return standbys
            if time.monotonic() > deadline:
                return []
            time.sleep(0.02)

    def restart(self) -> bool:
        """Promote the standbys to ranks and start new standbys behind them: the controller
        and the client stay. False (nothing done) where no standby set is ready: the caller
        then stops and starts afresh. Raises StartError if the promoted ranks fail to join."""
        t0 = time.perf_counter()
        standbys = self._standbys_ready()
        if not standbys:
            return False
        cluster = self.cluster
        self.unfinished = None
        started_in_ranks = processes.started_by_ranks(cluster)
        # The old ranks end: SIGTERM, and SIGKILL soon for those stuck in a collective
        # (ipyparallel's own kill comes after a whole second) ...
        old = list(cluster.rank_launchers().values())
        for launcher in old:
            launcher.signal(signal.SIGTERM)
        self._end_far_ranks()  # (ranks on other hosts end on their control channel)
        processes.kill_now(old, after=0.2)
        cluster._in_thread(cluster.promote_standby)
        processes.end(started_in_ranks)
        self._remove_torch_file()
        # ... and the standbys join a new job, as the same ranks.
        self.ranks = [Rank(rank=r.rank, engine_id=r.engine_id) for r in standbys]
        self._launchers = cluster.rank_launchers()
        self._ssh = cluster.ssh_launchers()
        self._vanished = {}
        self.out_of_step, self.death = "", None
        self._cells.clear()
        local = self.settings.where.launcher == "local"
        try:
            # (on other hosts the new rank 0 proposes its own addresses)
            self._init_distributed(
                coordinators=_loopback_ports(self.settings.backend) if local else None
            )
        except BaseException:
            self.stop(keep_cache=True)
            raise
        self._start_standby()
        self.start_seconds = time.perf_counter() - t0
        return True

    def _exited_engines(self) -> str:
        """'' while every engine runs; else which exited, and the end of one's log."""
        exited = {r: p for r, p in self.cluster.rank_launchers().items() if processes.exited(p.process)}
        if exited:
            rank, launcher = min(exited.items())
            who = f"rank {rank}"
        else:  # mpiexec, for all its ranks at once
            launcher = self.cluster.launcher_process()
            if launcher is None or not processes.exited(launcher.process):
                return ""
            who = " ".join(launcher.find_args()[:1])
        tail = "\n".join(last_lines(launcher.get_output(), count=5)) or "(nothing)"
        return f" ({who}); the last lines it wrote:\n{tail}"

    @property
    def running(self) -> bool:
        """Whether the ranks run (after a death they do not, though standbys may)."""
        return self.cluster is not None and self.death is None

    def stop(self, keep_cache: bool = False) -> None:
        """End every engine and the controller. Safe to call twice, and at exit.
        ``keep_cache``: keep the compilation cache for the next start (a restart)."""
        atexit.unregister(self.stop)
        if not keep_cache and self._cache_dir and self._cache_dir != self.settings.cache_dir:
            shutil.rmtree(self._cache_dir, ignore_errors=True)
            self._cache_dir = None
        if self.cluster is not None:
            # a standby set still starting (over ssh) is stopped once its engines run
            self._standby_started(self.settings.start_timeout)
        if self.client is not None and self.cluster is not None:
            self._end_far_ranks(standbys=True)
        client, cluster = self.client, self.cluster
        self.client = self.cluster = None
        self._launchers, self._ssh, self._vanished = {}, {}, {}
        self.unfinished = None
        if client is not None:
            client.close(linger=0)
        if cluster is not None:
            # Standbys hold nothing and run no cell; one still importing torch holds the GIL
            # for long stretches and would take ipyparallel's 1 s kill timeout to end.
            standbys = cluster.standby_launchers().values()
            processes.kill_now(standbys)
            ssh.kill_now(  # (on other hosts: those that did not end on their control channel)
                ln for ln in standbys
                if isinstance(ln, ssh.RankedSSHEngineLauncher) and not ln.ended_by_control
            )
            started_in_ranks = processes.started_by_ranks(cluster)
            # Engines exit on SIGTERM at once (engine.initialize installs that); one that is
            # stuck in C++ is killed after LocalProcessLauncher.stop_seconds_until_kill.
            cluster._in_thread(cluster.stop_cluster)
            processes.end(started_in_ranks)
            # ... and end that thread's loop: every restart makes a new Cluster.
            loop = getattr(cluster, "_thread_loop", None)
            if loop is not None:
                loop.add_callback(loop.stop)
        self._mark_stopped()
        self.logs.close()
        self._remove_torch_file()
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None

    def signal(self, signum: int = signal.SIGINT, ranks: list[int] | None = None) -> None:
        """Send a signal to the processes of some ranks (default: all)."""
        if self.cluster is None:
            return
        chosen = [r.rank for r in self.ranks] if ranks is None else ranks
        self.cluster.signal_ranks([r for r in chosen if r in self._launchers], signum)
        far = [self.ranks[r].engine_id for r in chosen if r not in self._launchers]
        if far and self.client is not None:
            control.signal(self.client, far, signum)

    # -- cells ----------------------------------------------------------------------------

    def run_cell(
        self,
        code: str,
        ranks: list[int] | None = None,
        timeout: float | None = None,
        grace: float | None = None,
        on_output: Callable[[int, Output], None] | None = None,
        tick: Callable[[CellRun], None] | None = None,
        max_output: int | None = 0,
        on_prompt: Callable[[int, dict, CellRun], dict] | None = None,
        breakpoints: str = "lowest",
    ) -> CellRun:
        """Send ``code`` to the ranks and wait until every one has finished (lockstep).

        The wait ends early when a rank dies, when some ranks are still busy ``grace``
        seconds after another finished (they diverged), on a timeout, or when the notebook
        is interrupted. ``run.stall`` then says which, and where the busy ranks were.
        ``max_output``: stream lines kept per rank (0: the settings'; None: all of them).
        """
        self.check_alive()
        if self.out_of_step:
            raise OutOfStep(self.out_of_step)
        targets = {r.rank: r.engine_id for r in self.ranks if ranks is None or r.rank in ranks}
        run = CellRun(
            self.client,
            targets,
            code,
            on_output=on_output,
            max_lines=self.settings.max_output if max_output == 0 else max_output,
            log=self.logs,
            on_prompt=on_prompt,
            breakpoints=breakpoints,
        )
        self._cells.append(code)
        self.logs.begin_cell(code)
        for rank in targets:
            self.ranks[rank].state = "busy"
        run.send()
        timeout = timeout or self.settings.cell_timeout
        grace = self.settings.grace if grace is None else grace
        try:
            try:
                reason, seconds = self._wait(run, timeout, grace or None, tick)
            except KeyboardInterrupt:
                reason, seconds = INTERRUPTED, None
                if run.prompt_interrupted:
                    # Interrupted at a rank's prompt: the ranks at prompts raise
                    # KeyboardInterrupt themselves. If that ends the cell everywhere, the
                    # ranks are still in step: the cell just failed.
                    run.wait(until=time.monotonic() + 2.0, poll=0.02)
                    reason = "" if run.finished else reason
            if reason:
                # People press Interrupt twice: a second one must not cut the report short
                # and leave the ranks busy without the out-of-step guard.
                with processes.interrupts_held():
                    run.stall = self._stop_waiting(run, reason, seconds)
        finally:
            self.logs.flush()
            for rank, cell in run.cells.items():
                if cell.done and self.ranks[rank].state == "busy":
                    self.ranks[rank].state = "idle"
                    self.ranks[rank].last_seconds = cell.seconds
        return run

    def _wait(
        self,
        run: CellRun,
        timeout: float | None,
        grace: float | None,
        tick: Callable[[CellRun], None] | None,
    ) -> tuple[str, float | None]:
        """Poll the cell until it finishes ('', None) or a reason to stop waiting."""
        while not run.finished:
            now = time.monotonic()
            # (the time a person spent at a prompt does not count)
            until = None if timeout is None else run.started + run.paused + timeout
            if self._any_death():
                return DIED, None
            if until is not None and now >= until:
                return TIMEOUT, timeout
            diverged_at = (
                None if grace is None or run.first_done is None else run.first_done + grace
            )
            if diverged_at is not None and now >= diverged_at:
                return DIVERGED, grace
            wake = min(t for t in (until, diverged_at, now + 0.1) if t is not None)
            run.poll(max(0.0, wake - now))
            if tick is not None:
                tick(run)
        # A rank that died at the very end may have had its reply faked by ipyparallel.
        return (DIED, None) if self._any_death() else ("", None)

    def _stop_waiting(self, run: CellRun, reason: str, seconds: float | None) -> Stall:
        deaths = self._deaths()
        if reason == DIED and deaths and "torch" in self.settings.backend:
            self._let_survivors_finish(run, {d.rank for d in deaths})
        stall = Stall.at(reason, seconds, run.cells, deaths=deaths)
        busy = stall.busy
        # Where the busy ranks are, before an interrupt moves them.
        stall.stacks = self.stacks(busy)
        if reason == DIED:
            self._end_after_death(stall.deaths)
            return stall
        stall.unresponsive = self._interrupt(run, busy)
        what = {DIVERGED: "diverged", INTERRUPTED: "was interrupted"}.get(reason)
        what = what or f"timed out after {seconds:g} s"
        # Ranks stopped in the middle of a cell may be in the middle of a collective, or past
        # one the others never reached: the next collective would hang or mix up data. Only
        # a restart brings them back together.
        self.out_of_step = (
            f"the last cell {what}, so the ranks are out of step: %spmd restart before going on."
        )
        return stall

    def _let_survivors_finish(self, run: CellRun, dead: set[int]) -> None:
        """gloo raises at once in the other ranks when a peer's connection drops (jax's
        ranks stay blocked, so a jax death report does not wait for them). Their errors belong
        in the death report, not stacks caught half-way through formatting them: wait a
        moment, and longer for ranks already past the cell's code."""

        def busy() -> list[int]:
            return [r for r, c in run.cells.items() if not c.done and r not in dead]

        def wait(ranks: list[int], seconds: float) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until and any(not run.cells[r].done for r in ranks):
                run.poll(0.02)

        wait(busy(), AFTER_DEATH_SECONDS)
        stacks = self.stacks(busy())
        wait([r for r, s in stacks.items() if s is not None and not s.at_cell_line], 5.0)

    def _interrupt(self, run: CellRun, busy: list[int], grace: float = 0.5) -> list[int]:
        """SIGINT to the busy ranks; the ones still busy after ``grace`` seconds."""
        self.signal(signal.SIGINT, busy)
        run.wait(until=time.monotonic() + grace, poll=0.02)
        left = [r for r in run.busy_ranks if r in busy]
        self.unfinished = run if left else None
        return left

    # -- deaths and stacks --------------------------------------------------------------

    def _any_death(self) -> bool:
        return any(ln.exited_at is not None for ln in self._watched.values()) or bool(
            self._vanished_ranks()
        )

    @property
    def _watched(self) -> dict:
        """Ranks whose launcher sees their process end (a local handle, a wait over ssh)."""
        return {**self._ssh, **self._launchers}

    def dead_ranks(self) -> set[int]:
        """Ranks whose process has ended, or that the controller lost."""
        ended = {r for r, ln in self._watched.items() if ln.exited_at is not None}
        return ended | set(self._vanished_ranks())

    def local_ranks(self) -> set[int]:
        """Ranks with a process on this machine that the notebook started."""
        return set(self._launchers)

    def _vanished_ranks(self) -> dict[int, float]:
        """Ranks with no process handle here (other hosts, mpiexec, srun) that the controller
        lost: their engine missed its heartbeats and was unregistered."""
        watched = self._watched
        unwatched = [r for r in self.ranks if r.rank not in watched]
        if self.client is None or not unwatched:  # (every poll of every cell comes here)
            return self._vanished
        registered = set(self.client.ids)
        for r in unwatched:
            if r.engine_id not in registered:
                self._vanished.setdefault(r.rank, time.monotonic())
        # mpiexec ends every rank when one fails: all of them are gone with it
        whole = self.cluster.launcher_process() if self.cluster is not None else None
        if whole is not None and processes.exited(whole.process):
            for r in unwatched:
                self._vanished.setdefault(r.rank, time.monotonic())
        return self._vanished

    def _deaths(self) -> list[Death]:
        """Ranks whose processes ended while the cluster runs, first to die first."""
        gone = [ln for ln in self._watched.values() if ln.exited_at is not None]
        deaths = [
            Death(
                ln.rank,
                self.ranks[ln.rank].pid,
                ln.exit_code,
                ln.exited_at,
                last_lines(self.cluster.output_of(ln.rank)),
                self._crash_stack(ln) if ln.rank in self._launchers else None,
                host=self.ranks[ln.rank].host,
                cause=f"its process on {self.ranks[ln.rank].host} ended",
            )
            for ln in gone
        ]
        culprit = None
        for rank, at in self._vanished_ranks().items():
            row = self.ranks[rank]
            output = self.cluster.output_of(rank) if self.cluster is not None else ""
            death = Death(
                rank, row.pid, None, at, last_lines(output), host=row.host,
                cause="it stopped answering the controller's heartbeat",
            )
            culprit = culprit or remote.mpi_culprit(output)
            if culprit and culprit[0] == row.pid:
                # mpiexec kills every rank when one dies, and names the first end it saw:
                # almost always the rank that died, but not always. Say whose word it is.
                code = culprit[1]
                if code is None:
                    how = "an error"
                elif code >= 0:
                    how = f"exit code {code}"
                else:
                    how = signal.Signals(-code).name if -code in signal.valid_signals() else (
                        f"signal {-code}"
                    )
                death.cause, death.at = f"mpiexec says it ended by {how}", at - 1.0
            deaths.append(death)
        deaths.sort(key=lambda d: d.at)
        return deaths

    def _crash_stack(self, launcher: RankedEngineLauncher) -> where.Stack | None:
        """Where a rank was when it crashed, from faulthandler's dump in its stack file."""
        try:
            with open(launcher.stack_file, errors="replace") as f:
                text = f.read()
        except OSError:
            return None
        at = text.rfind("Fatal Python error")
        if at < 0:
            return None
        frames = where.parse_dump(text[at:], self.ranks[launcher.rank].main_thread)
        return self._stack(launcher.rank, frames) if frames else None

    def _stack(self, rank: int, frames: list[where.Frame]) -> where.Stack:
        """A rank's frames from the cell on, with the lines of the cells this session sent."""
        return where.Stack(rank, where.with_sources(where.from_cell_on(frames), self._cells))

    def notice_deaths(self) -> None:
        """If a rank died since the last look, stop the others and say so from now on."""
        if self._any_death():
            self._end_after_death(self._deaths())

    def check_alive(self) -> None:
        """Raise OutOfStep if a rank died (now, or earlier) and the cluster is stopped."""
        self.notice_deaths()
        if self.death is not None:
            raise OutOfStep(self.out_of_step)

    def _end_after_death(self, deaths: list[Death]) -> None:
        first = self.death = deaths[0]
        self.out_of_step = (
            f"rank {first.rank} died ({first.how}) and the cluster was stopped: "
            "%spmd restart starts a fresh one."
        )
        for d in deaths:
            self.ranks[d.rank].state = "died"
        if self.standbys():
            self._end_ranks()  # the controller and the standbys stay, for a fast restart
        else:
            self.stop(keep_cache=True)

    def _end_far_ranks(self, standbys: bool = False) -> None:
        """Ranks (and, with ``standbys``, ready standbys) with no process handle here end at
        once on their control channel; the launcher's own stop (over ssh, mpiexec or
        scancel) then only confirms it."""
        engine_ids = [
            r.engine_id
            for r in self.ranks
            if r.rank not in self._launchers and r.state not in ("died", "stopped")
        ]
        launchers = {
            self.ranks[rank].engine_id: ln for rank, ln in self.cluster.ssh_launchers().items()
            if rank < len(self.ranks)
        }
        if standbys:
            far = self.cluster.standby_launchers()
            for row in self.standbys():
                if row.state == "ready" and isinstance(far[row.rank], ssh.RankedSSHEngineLauncher):
                    engine_ids.append(row.engine_id)
                    launchers[row.engine_id] = far[row.rank]
        if not engine_ids or self.client is None:
            return
        ended = control.signal(self.client, engine_ids, signal.SIGTERM, timeout=0.5)
        for engine_id, launcher in launchers.items():
            launcher.ended_by_control = engine_id in ended

    def _end_ranks(self) -> None:
        """End the ranks' engines (and what their cells started), keeping the rest."""
        cluster = self.cluster
        started_in_ranks = processes.started_by_ranks(cluster)
        self._end_far_ranks()
        if cluster.rank_set in cluster.engines:
            cluster._in_thread(cluster.stop_engines, cluster.rank_set)
        processes.end(started_in_ranks)
        self._launchers, self._ssh, self._vanished, self.unfinished = {}, {}, {}, None
        self._mark_stopped()

    def _mark_stopped(self) -> None:
        for r in self.ranks:
            if r.state != "died":
                r.state = "stopped"

    def stacks(self, ranks: list[int]) -> dict[int, where.Stack | None]:
        """The main-thread Python stack of each rank (None: it did not answer)."""
        if not ranks or self.client is None:
            return {}
        # Local ranks answer a signal from C (even while holding the GIL); the others
        # answer on their control channel.
        local = {
            r: (
                self._launchers[r].process,
                self._launchers[r].stack_file,
                self.ranks[r].main_thread,
            )
            for r in ranks
            if r in self._launchers
        }
        found = where.dump(local) if local else {}
        far = [r for r in ranks if r not in self._launchers]
        if far:
            by_engine = control.stacks(self.client, [self.ranks[r].engine_id for r in far])
            for r in far:
                frames = by_engine.get(self.ranks[r].engine_id)
                found[r] = None if frames is None else [where.Frame(*f) for f in frames]
        return {r: None if frames is None else self._stack(r, frames) for r, frames in found.items()}

    def interrupt(self) -> tuple[list[int], list[int]]:
        """SIGINT to the ranks still running a cell: (the ones sent it, the ones still busy)."""
        busy = self.busy_ranks()
        if not busy:
            return [], []
        return busy, self._interrupt(self.unfinished, busy)

    def call(self, rank: int, fn, *args, timeout: float):
        """``fn(*args)`` on one rank (through ipyparallel's signed ``apply``): its answer.
        Raises the rank's error, or ipyparallel's TimeoutError after ``timeout`` seconds."""
        ar = self.client[self.ranks[rank].engine_id].apply_async(fn, *args)
        return ar.get(timeout)

    def busy_ranks(self) -> list[int]:
        """Ranks still running a cell the notebook stopped waiting for."""
        run = self.unfinished
        if run is None:
            return []
        run.poll(0)
        for rank, cell in run.cells.items():
            if cell.done and self.ranks[rank].state == "busy":
                self.ranks[rank].state = "idle"
        if run.finished:
            self.unfinished = None
        return run.busy_ranks
