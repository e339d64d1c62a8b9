"""A Session: one SPMD cluster's life, its rank table, and cells run on it in lockstep.

The work is split by seam: starting (startup.py), the standby set (standby.py), deaths
(deaths.py) and cells (cells.py); Session holds the state they share and stops the cluster.
"""

from __future__ import annotations

import atexit
import collections
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from spmd.cluster import processes, ssh
from spmd.cluster.cells import AFTER_DEATH_SECONDS, Cells
from spmd.cluster.deaths import Deaths
from spmd.cluster.launch import LOOPBACK, RankedEngineLauncher, SpmdCluster
from spmd.cluster.lockstep import CellRun
from spmd.cluster.logs import RankLogs
from spmd.cluster.ranks import OutOfStep, Rank, Settings, StartError
from spmd.cluster.standby import STANDBY_LAUNCHERS, Standbys
from spmd.cluster.startup import Startup
from spmd.cluster.watchdog import Death

__all__ = [
    "AFTER_DEATH_SECONDS",
    "STANDBY_LAUNCHERS",
    "OutOfStep",
    "Rank",
    "Session",
    "Settings",
    "StartError",
]


@dataclass
class Session(Startup, Standbys, Deaths, Cells):
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

