"""A Session: one SPMD cluster's life, its rank table, and cells run on it in lockstep.

The work is split by seam: starting (startup.py), restarting (restarts.py), deaths
(deaths.py) and cells (cells.py); Session holds the state they share and stops the cluster.

Who may touch what:
- ``gen`` (the ranks of this start or restart, their process handles, the unfinished cell,
  the death) is replaced whole by start, restart and stop, in one assignment; ``cluster``,
  ``client`` and the folders change only with it. All of these change only while ``_life`` is
  held: start, restart, stop, death handling and a cell's run (its report may end ranks) hold
  it from beginning to end. Readers on other threads see one generation or the next, never
  a mix.
- The main thread runs cells, restarts and stops. ipykernel's control thread asks for a stop
  (``shutdown``): it cancels what the main thread is doing (a cell's wait, a start, a
  restart's wait all give up within ~0.1 s), then takes ``_life`` and stops. The kernel's
  background start runs ``start`` on a Session of its own, which no cell sees until it ended.
  ipyparallel's event-loop thread owns the launchers and engine sets; this side reads them
  only through copies (see SpmdCluster). The client's IO thread hands over what ranks print
  after their cell through one deque (client.py), taken under ``_life`` (collect_late).
- ``_server`` (the rank server of this machine, or those of the ssh hosts) is started and
  closed under ``_life`` with the cluster; ipyparallel's event-loop thread asks it for forks,
  and each server's reader thread is the only writer of what it answered (servers.py).
- A SIGINT on the main thread during a stop, a restart's end of the old ranks, a start's
  last steps or a cell's report is held until it has finished (interrupts.py).
"""

from __future__ import annotations

import atexit
import collections
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from spmd.cluster import interrupts
from spmd.cluster.cells import AFTER_DEATH_SECONDS, Cells
from spmd.cluster.deaths import Deaths
from spmd.cluster.launchers import processes, servers, ssh
from spmd.cluster.launchers.launch import LOOPBACK, SpmdCluster
from spmd.cluster.lockstep.logs import RankLogs
from spmd.cluster.lockstep.run import CellRun
from spmd.cluster.lockstep.watchdog import Death
from spmd.cluster.ranks import Generation, OutOfStep, Ran, Rank, Settings, StartError
from spmd.cluster.restarts import Restarts
from spmd.cluster.startup import Startup

__all__ = [
    "AFTER_DEATH_SECONDS",
    "OutOfStep",
    "Ran",
    "Rank",
    "Session",
    "Settings",
    "StartError",
]


@dataclass(eq=False)
class Session(Startup, Restarts, Deaths, Cells):
    settings: Settings
    gen: Generation = field(default_factory=Generation)  # the ranks now (see above)
    start_seconds: float = 0.0
    cluster: SpmdCluster | None = None
    client: object | None = None
    _address: str = LOOPBACK  # where the controller listens
    # Set by cancel (the kernel's background start is not wanted) and by shutdown: a start
    # under way gives up.
    _cancelled: threading.Event = field(default_factory=threading.Event)
    # Set by shutdown only: every wait of the main thread gives up (a cell's, a restart's).
    _stopping: threading.Event = field(default_factory=threading.Event)
    _life: threading.RLock = field(default_factory=threading.RLock)
    _profile_dir: str | None = None
    _cache_dir: str | None = None  # the compilation cache the ranks share
    _engine_sets: int = 0  # engine sets started so far: their engine ids do not overlap
    _torch_method: str = ""  # torch's init method as the ranks got it ('' without torch)
    # The rank server that forks the ranks (servers.RankServer on this machine, or
    # servers.SSHRankServers, one per host); it lives from the start to the stop, across
    # restarts. None where there is none (mpi, slurm, --rank-server off, a fallback).
    _server: object | None = None
    fell_back: str = ""  # why the ranks started without the rank server ('' if they did not)
    # What jax and XLA read once, at import, as the rank server had it when it imported them
    # (startup.import_time_env); a restart whose notebook has other values starts afresh,
    # and says why in ``afresh_because``.
    _server_env: dict = field(default_factory=dict)
    afresh_because: str = ""
    # The ranks' one string-hash secret (PYTHONHASHSEED) where a rank server forks them ('':
    # each rank has its own Python, and its own secret, as a job's processes do).
    hash_seed: str = ""
    # Every engine id the cluster's ranks had, and its rank (ids change at a restart; a
    # thread of an old rank may still print): for outputs that come after their cell.
    _engine_rank: dict = field(default_factory=dict)
    _late: list = field(default_factory=list)  # late outputs taken, for the next cell
    # The text of recent cells, to show the lines of a stack dump (see where.with_sources).
    _cells: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    logs: RankLogs = field(default_factory=RankLogs)  # every line each rank printed
    # The cells since the start or the last restart, in the order they ran, and how each went
    # (ranks.Ran), for %spmd export. The main thread only: it runs cells and restarts.
    ran: list = field(default_factory=list)
    # Told how a start goes: ("registered" | "joined", how many so far, of how many, the
    # coordinator's address or '').
    progress: Callable[[str, int, int, str], None] | None = None
    coordinator: str = ""  # rank 0's address for the others (jax's, else torch's)


    # The current generation's fields, for readers (the magics, the panel, tests).

    @property
    def ranks(self) -> list[Rank]:
        return self.gen.ranks

    @property
    def death(self) -> Death | None:
        return self.gen.death

    @property
    def out_of_step(self) -> str:
        return self.gen.out_of_step

    @property
    def unfinished(self) -> CellRun | None:
        return self.gen.unfinished

    @property
    def running(self) -> bool:
        """Whether the ranks run (after a death they do not, though the controller may)."""
        return self.cluster is not None and self.gen.death is None

    def stop(self, keep_cache: bool = False) -> None:
        """End every engine and the controller. Safe to call twice, and at exit.
        ``keep_cache``: keep the compilation cache for the next start (a restart)."""
        with self._life, interrupts.held("the stop"):
            self._stop(keep_cache)

    def shutdown(self, wait: float = 4.0) -> None:
        """Stop from another thread (ipykernel's control thread, at a shutdown request):
        whatever the main thread does with this cluster gives up, and the stop runs once it
        has. A main thread that does not let go within ``wait`` seconds (a rank's prompt
        waits for an answer that will not come) is stopped beside: the kernel's process ends
        right after, and its manager would kill it without a stop."""
        self._stopping.set()
        self._cancelled.set()
        got = self._life.acquire(timeout=wait)
        try:
            # (beside a main thread that may still wait on the cluster's event loop: that
            # loop is left running, for the process's end to take)
            self._stop(keep_cache=False, end_loop=got)
        finally:
            if got:
                self._life.release()

    def _stop(self, keep_cache: bool, end_loop: bool = True) -> None:
        atexit.unregister(self.stop)
        cluster, client = self.cluster, self.client
        if not keep_cache and self._cache_dir and self._cache_dir != self.settings.cache_dir:
            shutil.rmtree(self._cache_dir, ignore_errors=True)
            self._cache_dir = None
        if client is not None and cluster is not None:
            self._end_far_ranks()
            if end_loop:  # (with the lock: a rank's last words before the stop, into its log)
                self.collect_late()
        self.client = self.cluster = None
        self.gen = self.gen.ended()
        if client is not None:
            client.close(linger=0)
        server, self._server = self._server, None
        removed: set[str] = set()
        if cluster is not None:
            started_in_ranks = processes.started_by_ranks(cluster)
            far = list(cluster.ssh_launchers().values())
            lost = {ln.location for ln in far if ln.lost}
            # (where the hosts keep it: relative to their home, when it is under ours)
            remote_dir = next(
                (ln.remote_profile_dir for ln in far if getattr(ln, "remote_profile_dir", "")),
                self._profile_dir,
            )
            controller = getattr(cluster.controller, "process", None)  # (a psutil handle)
            try:
                # Engines exit on SIGTERM at once (engine.initialize installs that); one that
                # is stuck in C++ is killed after LocalProcessLauncher.stop_seconds_until_kill.
                cluster._in_thread(cluster.stop_cluster)
            finally:  # (whatever ipyparallel's stop raised, the rest ends all the same)
                # ipyparallel stops the controller beside the engines: where the engines'
                # stop raised first, the controller's may not have finished
                processes.end_within([controller] if controller is not None else [], 2.0)
                processes.end(started_in_ranks)
                where = self.settings.where
                # The rank servers kill any rank still there as they end; over ssh, each
                # removes the cluster's files on its host.
                if isinstance(server, servers.SSHRankServers):
                    lost |= {host for host in server.servers if server.lost(host)}
                    removed = server.close()
                elif server is not None:
                    server.close()
                server = None
                if where.launcher == "ssh" and self._profile_dir:  # (their files, their disks)
                    hosts = [h for h, _ in where.hosts if h not in lost and h not in removed]
                    ssh.remove_folder(hosts, where.ssh_cmd, where.ssh_args, remote_dir)
            # ... and end that thread's loop: every restart makes a new Cluster.
            loop = getattr(cluster, "_thread_loop", None)
            if loop is not None and end_loop:
                loop.add_callback(loop.stop)
                # (closed once its thread has left it: an open one keeps its selector and
                # self-pipe, three descriptors a start and stop)
                thread = getattr(cluster, "_async_thread", None)
                if thread is not None and thread is not threading.current_thread():
                    thread.join(timeout=5)
                    if not thread.is_alive():
                        loop.close()
        if server is not None:  # (a start that failed before its cluster)
            server.close()
        self.logs.close()
        self._remove_torch_file()
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None
