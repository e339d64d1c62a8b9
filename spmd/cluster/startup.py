"""The launch: the processes of one cluster, started in named steps (the controller and
the engines, the client, every rank joining jax's or torch's job), re-forked by a restart
(restarts.py) and ended by a stop (stopping.py), and the frozen record of what runs.

Launch's state is its own. Session calls its steps with Session's lock held, on the thread
that starts (the main thread, or the kernel's background start on a Session of its own);
other threads read only ``record()``, a frozen copy, or the fields Session exposes.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import subprocess
import sys
import threading
import time

from spmd import internals
from spmd.cluster import linger
from spmd.cluster.launchers import forks, processes, remote, servers, ssh
from spmd.cluster.launchers.launch import LOOPBACK, SpmdCluster, cluster_config, cluster_log
from spmd.cluster.launchers.profiles import new_profile_dir, owned_folder
from spmd.cluster.lockstep.logs import last_lines
from spmd.cluster.records import Rank, Running, StartError
from spmd.controller.start import CURVE_ENV
from spmd.engine import bootstrap as engine
from spmd.engine.join.address import coordinator_addresses
from spmd.engine.join.import_env import read_at_import as import_time_env
from spmd.engine.server import modules_for as server_modules
from spmd.words import rank_words


def loopback_ports(backend: str) -> dict[str, str]:
    """A free port on 127.0.0.1 for each backend's coordinator (jax's and torch's differ)."""
    return coordinator_addresses(LOOPBACK, [b for b in backend.split(",") if b != "none"])


def check_can_start(settings) -> None:
    """Raise StartError where a start cannot work: a package's private part this project
    uses has changed, or this machine has no room for the ranks."""
    try:
        internals.check("notebook")
    except internals.InternalsChanged as exc:
        raise StartError(str(exc)) from None
    if settings.where.on_this_machine:
        try:
            forked = settings.rank_server and settings.where.launcher == "local"
            processes.check_room(settings.n, settings.backend, forked)
        except processes.StartRefused as exc:
            raise StartError(str(exc)) from None


def _within(seconds: float, fn, *args) -> str:
    """``fn(*args)``, or '' when it raises or takes longer than ``seconds`` (a detail of an
    error, not worth delaying it)."""
    found: list[str] = []

    def ask() -> None:
        try:
            found.append(fn(*args) or "")
        except Exception:  # (the host is gone: the error goes without these lines)
            return

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(seconds)
    return found[0] if found else ""


def _last_lines(cluster, rank: int) -> str:
    """What ``rank`` wrote last, for a start's error about it: why it waited, often."""
    if cluster is None:
        return ""
    output = _within(2.0, cluster.output_of, rank)  # (a slow host: skip)
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()][-6:]
    if not lines:
        return ""
    return f"\nThe last lines rank {rank} wrote:\n" + "\n".join("  " + ln[:300] for ln in lines)


def _init_failure(rank: int, exc: Exception) -> StartError:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    if ename == "BackendMissing":
        return StartError(
            f"{evalue}: install it there, or start with --backend none."
        )
    if ename in ("GpuError", "TorchSetupError", "InternalsChanged"):  # (its text says what to do)
        return StartError(evalue)
    return StartError(f"Rank {rank} failed to initialize: {ename}: {evalue}")




# While ranks are missing, the controller is asked this often which engines it has: the
# client can miss one's announcement (SpmdClient.sync_engines).
SYNC_ENGINES_S = 1.0
ASK_AGAIN_S = 5.0  # (a rank not joined this long after it was asked is asked again)

# How rank 0 says its coordinator's port was taken: jax raises the first when the join fails
# on its thread; the second is gRPC's own line when the engine exits before it registered.
PORT_TAKEN = ("Failed to start RPC server", "Failed to add port to server")


class Launch:
    """The processes of one cluster and the steps that start them (see the module's
    opening comment for who may call what)."""

    def __init__(self, settings, cancelled: threading.Event, cache_dir: str | None = None):
        self.settings = settings
        self._cancelled = cancelled  # (Session's: set by cancel and by shutdown)
        self.cluster: SpmdCluster | None = None
        self.client = None
        # The rank server that forks the ranks (servers.RankServer on this machine, or
        # servers.SSHRankServers, one per host); it lives from the start to the stop, across
        # restarts. None where there is none (mpi, slurm, --rank-server off, a fallback).
        self.rank_server = None
        self.address = LOOPBACK  # where the controller listens
        self.profile_dir: str | None = None
        self.cache_dir = cache_dir  # the compilation cache the ranks share
        self.engine_sets = 0  # engine sets started so far: their engine ids do not overlap
        self.torch_method = ""  # torch's init method as the ranks got it ('' without torch)
        # What jax and XLA read once, at import, as the rank server had it when it imported
        # them; a restart whose notebook has other values starts afresh (restarts.py).
        self.server_env: dict = {}
        # The ranks' one string-hash secret (PYTHONHASHSEED) where a rank server forks them
        # ('': each rank has its own Python, and its own secret, as a job's processes do).
        self.hash_seed = ""
        self.fell_back = ""  # why the ranks started without the rank server ('' if not)
        self.coordinator = ""  # rank 0's address for the others (jax's, else torch's)
        # Told how a start goes: ("registered" | "joined", how many so far, of how many, the
        # coordinator's address or '').
        self.progress = None
        # The cluster's record for a notebook that attaches after this one died (linger.py),
        # and what makes its processes linger ({}: they end with this notebook).
        self.record_id = linger.new_id()
        self.linger_env: dict[str, str] = {}

    def record_path(self) -> str:
        return os.path.join(linger.records_dir(), f"{linger.RECORD_PREFIX}{self.record_id}.json")

    def record(self) -> Running:
        """What runs now, as a frozen copy."""
        return Running(
            cluster=self.cluster, client=self.client, rank_server=self.rank_server,
            address=self.address, profile_dir=self.profile_dir, cache_dir=self.cache_dir,
            hash_seed=self.hash_seed, coordinator=self.coordinator,
            torch_method=self.torch_method, fell_back=self.fell_back,
        )

    def hand_over(self) -> Running:
        """What runs, for the stop to end: the launch forgets its processes (its folders
        stay until ``remove_folders``)."""
        running = self.record()
        self.client = self.cluster = self.rank_server = None
        return running

    # The start's steps, in order.

    def prepare(self) -> None:
        """The compilation cache (kept across restarts) and this attempt's folder."""
        if self.cache_dir is None and "jax" in self.settings.backend:
            self.cache_dir = self.settings.cache_dir or owned_folder("spmd-jax-cache-")
        self.profile_dir = new_profile_dir()

    def open_cluster(self) -> None:
        """The controller and the engines (or the rank servers that fork them)."""
        s, placed = self.settings, self.settings.where
        try:
            self.address = remote.controller_address(placed, placed.ssh_args)
        except remote.HostsError as exc:
            raise StartError(f"{exc}.") from None
        # Local ranks: rank 0 is here. Elsewhere rank 0 proposes its own addresses.
        coordinators = loopback_ports(s.backend) if placed.launcher == "local" else {}
        self.tell_coordinator(coordinators)
        config = cluster_config(
            s.n,
            s.backend,
            s.cpu_devices,
            coordinators=coordinators,
            init_timeout=int(s.start_timeout),
            where=placed,
            address=self.address,
            gpus_per_process=s.gpus_per_process,
            torch_backend=s.torch_backend,
            torch_init=self.torch_init(),
            # (on other hosts, only a folder the user named: this machine's is not theirs)
            cache_dir=self.cache_dir if placed.on_this_machine else s.cache_dir,
            check_collectives=s.check_collectives,
        )
        if s.curve and self.address != LOOPBACK:
            config.LocalControllerLauncher.environment[CURVE_ENV] = "1"
        self.linger_env = linger.process_env(s, self.profile_dir)
        if self.linger_env:  # (a cluster that outlives a notebook process that died)
            own_cache = self.cache_dir if self.cache_dir != s.cache_dir else ""
            config.LocalControllerLauncher.environment.update(linger.process_env(
                s, self.profile_dir, controller=True,
                remove=[self.profile_dir, own_cache, self.record_path()]))
            if placed.launcher == "local":  # (another host's ranks end with its server)
                for section in ("LocalEngineSetLauncher", "LocalEngineLauncher"):
                    config[section].environment.update(self.linger_env)
        if placed.launcher in ("local", "ssh") and s.rank_server:
            self._start_rank_server(config)
        if placed.launcher == "slurm":  # (ipyparallel writes it in the current folder)
            config.SpmdSlurmEngineSetLauncher.batch_file_name = f"{self.profile_dir}/engines.sbatch"
        self.cluster = SpmdCluster(
            n=s.n,
            profile_dir=self.profile_dir,
            config=config,
            engine_timeout=int(s.start_timeout),
            # Errors only: the notebook is not ipyparallel's log. (Its own choice of logger
            # depends on what runs: a kernel app's, when the SPMD kernel starts its cluster
            # before the kernel is up, would show its warnings in the first cell.)
            log=cluster_log(),
            shutdown_atexit=False,  # Session.start registers its own, faster, stop
        )
        self.cluster.rank_server = self.rank_server
        self.server_env = import_time_env()
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
        except servers.ServerSlow:  # (as if no rank registered in time, which none did)
            raise StartError(self._not_registered(list(range(s.n)))) from None
        except servers.ServerUnavailable as exc:  # it was ready, then ended before a fork
            raise StartError(
                f"The rank server failed while it forked the ranks ({exc}): start again, or "
                "with --rank-server off."
            ) from None
        self.note_fallback()

    def _start_rank_server(self, config) -> None:
        """One process per host imports what the ranks need, once, and forks them."""
        s, placed = self.settings, self.settings.where
        log_dir = os.path.join(self.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        modules = server_modules(s.backend, list(s.preload))
        # Every rank a server forks has the server's string-hash secret: one for the whole
        # cluster, on every host (a set's order is the same on every rank), which the
        # exported job gets too (PYTHONHASHSEED in its launch).
        self.hash_seed = str(secrets.randbelow(2**32 - 1) + 1)
        if placed.launcher == "local":
            self.rank_server = servers.local_server(
                placed.python or sys.executable, modules,
                os.path.join(log_dir, "rank-server.log"), self.hash_seed, env=self.linger_env,
            )
            config.Cluster.engine_launcher_class = forks.ForkedEngineSetLauncher
        else:  # (it logs in and starts them while the controller starts)
            self.rank_server = servers.SSHRankServers(
                [host for host, _ in placed.hosts], placed.ssh_cmd, placed.ssh_args,
                placed.python or sys.executable, modules, log_dir,
                folder=ssh.host_folder(self.profile_dir), hash_seed=self.hash_seed,
                linger=s.linger if self.linger_env else 0.0,
            )
            self.rank_server.start()
            config.Cluster.engine_launcher_class = forks.ForkedSSHEngineSetLauncher

    def connect(self) -> list[int]:
        """The notebook's client, once every engine registered: the engine ids, sorted."""
        self.client = _client(self.cluster, self.profile_dir)
        self.wait_registered(range(self.settings.n))
        return sorted(self.client.ids)

    def join(self, ranks: list[Rank], coordinators: dict[str, str] | None = None) -> None:
        """Wait until every rank has joined, filling in its row; ``coordinators`` go to ranks
        that were not given them at launch (remote ranks get rank 0's proposal)."""
        s = self.settings
        if coordinators is None and s.where.launcher != "local" and s.backend != "none":
            try:
                ar = self.client[ranks[0].engine_id].apply_async(
                    engine.propose_coordinators, self.address)
                coordinators = ar.get(s.start_timeout)
            except Exception as exc:
                raise _init_failure(0, exc) from None
        self.tell_coordinator(coordinators or {})
        self._tell("joined", 0, s.n)
        # (every rank at once: the others wait for rank 0's coordinator to listen on their
        # side, see bootstrap._join_jax; asked again at 5 s and 15 s: a rank that registered
        # a moment before its requests' connection was up loses the first, which the
        # controller cannot route; a second waits behind a first that runs)
        pending = {r.rank: [] for r in ranks}
        asked, deadline = time.monotonic(), time.monotonic() + s.start_timeout
        while pending:
            self.check_cancelled()
            for rank, ars in pending.items():
                if len(ars) < 3 and time.monotonic() - asked >= ASK_AGAIN_S * (2**len(ars) - 1):
                    ars.append(self.client[ranks[rank].engine_id].apply_async(
                        engine.joined, coordinators))
            for rank, ars in list(pending.items()):
                ar = next((a for a in ars if a.ready()), None)
                if ar is None:
                    continue
                del pending[rank]
                try:
                    facts = ar.get()
                except Exception as exc:  # a RemoteError carries the engine's exception
                    raise _init_failure(rank, exc) from None
                row = ranks[rank]
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
                    + _last_lines(self.cluster, min(pending))
                )
            time.sleep(0.005)

    # What the steps share with a restart.

    def check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise StartError("The start was cancelled.")

    def note_fallback(self) -> None:
        """Where the rank server could not be used, the ranks started as a Python each: the
        start says so in one line, and the server goes."""
        engine_set = self.cluster.engines.get(self.cluster.rank_set)
        why = getattr(engine_set, "fell_back", "")
        if why and self.rank_server is not None:
            self.fell_back = (
                f"The rank server could not be used ({why.rstrip('.')}): each rank started "
                "its own Python."
            )
            self.rank_server.close()
            self.rank_server = self.cluster.rank_server = None
            self.hash_seed = ""  # (each rank its own Python, its own secret)

    def torch_init(self) -> str:
        """torch's init method as the ranks get it: ``file`` becomes a file in the cluster's
        folder. A file left by an earlier start would break this one: it is removed first."""
        method = self.settings.init_method
        if method == "file":
            method = f"file://{self.profile_dir}/torch-init"
        self.torch_method = method if "torch" in self.settings.backend else ""
        self.remove_torch_file()
        return method

    def remove_torch_file(self) -> None:
        if self.torch_method.startswith("file://"):
            with contextlib.suppress(OSError):
                os.remove(self.torch_method[len("file://"):])

    def wait_registered(self, engine_ids: range) -> None:
        """Until these engines registered with the controller (engine id = its first id +
        rank). Polls rather than wait_for_engines(timeout): an engine that crashes at start
        fails the start at once, not after the whole timeout."""
        s, client = self.settings, self.client
        deadline = time.monotonic() + s.start_timeout
        registered, synced = -1, time.monotonic()
        while missing := sorted(set(engine_ids) - set(client.ids)):
            if time.monotonic() - synced > SYNC_ENGINES_S:
                client.sync_engines()  # (one whose announcement this client missed)
                synced = time.monotonic()
                continue
            if s.n - len(missing) != registered:
                registered = s.n - len(missing)
                self._tell("registered", registered, s.n)
            self.check_cancelled()
            exited = _exited_engines(self.cluster)
            if exited:
                raise StartError(f"An engine process exited during start-up{exited}")
            if time.monotonic() > deadline:
                missing = [engine_id - engine_ids.start for engine_id in missing]  # (ranks)
                raise StartError(self._not_registered(missing))
            time.sleep(0.01)
        self._tell("registered", s.n, s.n)

    def _not_registered(self, missing: list[int]) -> str:
        """The start's error for these ranks, which did not register in time."""
        s = self.settings
        hosts = remote.hosts_of(s.where, missing)
        where_ = f" (on {', '.join(hosts)})" if hosts else ""
        return (
            f"Only {s.n - len(missing)} of {s.n} engines registered within "
            f"{s.start_timeout:.0f} s; {rank_words(missing)}{where_} did not: check the "
            "engines' Python environment there, or give them more time with --start-timeout."
            + _last_lines(self.cluster, missing[0])
        )

    def tell_coordinator(self, coordinators: dict[str, str]) -> None:
        if coordinators:
            self.coordinator = coordinators.get("jax") or next(iter(coordinators.values()))

    def _tell(self, stage: str, done: int, of: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, of, self.coordinator)


# How long the notebook's client waits for the controller's hub to answer it: the hub answers
# once it is up, on a busy machine later than ipyparallel's 10 s.
HUB_SECONDS = 30


def _client(cluster: SpmdCluster, profile_dir: str):
    """The notebook's client of the controller's hub. A controller that ended because a port
    it picked was taken is started once more: ipyparallel's controller picks free ports and
    binds them a moment later, and on a busy machine another process took one meanwhile; the
    new one picks others, and the engines, which wait for its connection file, join it."""
    for again in (True, False):
        try:
            return cluster._in_thread(cluster.connect_client, timeout=HUB_SECONDS)
        except (TimeoutError, RuntimeError) as exc:
            # (RuntimeError: ipyparallel's "Controller stopped with ..."; TimeoutError: the
            # wait for a connection file that a controller ended at its bind never wrote)
            if not _controller_ended(cluster):
                if isinstance(exc, TimeoutError):
                    raise StartError(_controller_silent(cluster, profile_dir)) from None
                raise
            if again and "Address already in use" in _controller_silent(cluster, profile_dir):
                cluster.controller = None
                cluster._in_thread(cluster.start_controller)
                continue
            raise StartError(_controller_silent(cluster, profile_dir)) from None


def _controller_ended(cluster: SpmdCluster) -> bool:
    process = getattr(cluster.controller, "process", None)
    return process is not None and processes.exited(process)


def _controller_silent(cluster: SpmdCluster, profile_dir: str) -> str:
    """Why the notebook could not connect: the controller's process ended, or it runs and
    did not answer; and the end of what it wrote (its output, and a log file where it keeps
    one)."""
    controller = cluster.controller
    if _controller_ended(cluster):
        code = _exit_code(controller)
        ended = "" if code is None else f" ({processes.how_it_ended(code)})"
        said = f"The controller's process ended during start-up{ended}: start again."
    else:
        said = (f"The controller did not answer the notebook within {HUB_SECONDS} s (its "
                "process still runs): start again.")
    # Its output file (get_output() would keep a first read made while it runs for good);
    # once it ended, ipyparallel reads and removes the file, and get_output() has it.
    written = ""
    output = getattr(controller, "output_file", None)
    logs = sorted(glob.glob(os.path.join(profile_dir or "", "log", "ipcontroller-*.log")))
    for path in dict.fromkeys(filter(None, [output, *logs])):
        try:
            with open(path, errors="replace") as f:
                written += f.read()[-20000:] + "\n"
        except OSError:
            if path == output:
                written += controller.get_output()[-20000:] + "\n"
    tail = "\n".join(last_lines(written, count=8)) or "(nothing)"
    return f"{said} The last lines it wrote:\n{tail}"


def _exited_engines(cluster: SpmdCluster) -> str:
    """'' while every engine runs; else which exited, and the end of one's log."""
    exited = {r: p for r, p in cluster.rank_launchers().items() if processes.exited(p.process)}
    if exited:
        rank, launcher = min(exited.items())
        who = f"rank {rank}"
    else:  # mpiexec, for all its ranks at once
        launcher = cluster.launcher_process()
        if launcher is None or not processes.exited(launcher.process):
            return ""
        who = " ".join(launcher.find_args()[:1])
    code = _exit_code(launcher)
    how = "" if code is None else f", {processes.how_it_ended(code)}"
    written = launcher.get_output()
    forked = isinstance(launcher, forks.ForkedEngineLauncher) and not written.strip()
    failed = launcher.fork_failure() if forked else ""
    if failed:
        return f" ({who}{how}); its rank server wrote:\n{failed}"
    tail = "\n".join(last_lines(written, count=5)) or "(nothing)"
    return f" ({who}{how}); the last lines it wrote:\n{tail}"


def _exit_code(launcher, wait: float = 1.0) -> int | None:
    """An ended process's exit code (negative: its signal), once its launcher has it; None
    after ``wait`` seconds without (its launcher's thread sets it a moment after the end)."""
    deadline = time.monotonic() + wait
    while True:
        code = getattr(launcher, "exit_code", None)
        if code is None:
            code = (getattr(launcher, "stop_data", None) or {}).get("exit_code")
        if code is not None or time.monotonic() > deadline:
            return code
        time.sleep(0.05)
