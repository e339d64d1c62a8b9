"""What a cluster is asked for and what it holds: its settings, what runs (Running), the
rows of its rank table, and the two errors its life and its cells raise."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from spmd.cluster.launchers import remote

if TYPE_CHECKING:
    from spmd.cluster.adopted import Adopted
    from spmd.cluster.lockstep.run import CellRun
    from spmd.cluster.lockstep.watchdog import Death


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
    # jax's persistent compilation cache: a folder named by the user (kept), or None for one
    # of the cluster's own (kept across restarts, emptied at stop).
    cache_dir: str | None = None
    # Stream lines of one rank kept in the notebook per cell (the first and last half); the
    # rank's log keeps every line. None keeps them all.
    max_output: int | None = 1000
    # Modules the rank server imports once for every rank (besides the engine and backend).
    preload: tuple[str, ...] = ()
    # Local ranks forked by one rank server (True), or started as a Python each (False: each
    # has its own string-hash salt, as a job's processes do).
    rank_server: bool = True
    # torch's own check of each collective (TORCH_DISTRIBUTED_DEBUG=DETAIL): every rank
    # compares the op, shapes and dtypes with the others' before running it.
    check_collectives: bool = False
    # Seconds the cluster outlives a notebook process that died without stopping it (0:
    # none), for a new notebook process to attach (linger.py): 10m by default.
    linger: float = 600.0


@dataclass(frozen=True)
class Running:
    """What one cluster runs, as the launch hands it over (startup.Launch.record): enough to
    reach its ranks and to end every process and folder it has."""

    cluster: object | None = None  # launchers.launch.SpmdCluster: controller and engines
    client: object | None = None  # channel.client.SpmdClient: the notebook's connection
    rank_server: object | None = None  # servers.RankServer or SSHRankServers (None: none)
    address: str = "127.0.0.1"  # where the controller listens
    profile_dir: str | None = None  # the cluster's folder (connection files, logs)
    cache_dir: str | None = None  # the compilation cache the ranks share
    hash_seed: str = ""  # the ranks' PYTHONHASHSEED where a rank server forks them
    coordinator: str = ""  # rank 0's address for the others (jax's, else torch's)
    torch_method: str = ""  # torch's init method as the ranks got it


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


@dataclass(frozen=True)
class Ran:
    """A cell since the start or the last restart, as ``%spmd export`` writes it out."""

    code: str  # as the person typed it (a %spmd command: its line)
    count: int | None = None  # the notebook's execution count (In [N]), where it has one
    ranks: tuple[int, ...] | None = None  # where it ran (None: on every rank)
    where: str = "ranks"  # ranks | notebook (%%local) | push (%spmd push) | debug
    failed: str = ""  # how it failed, in a few words ('' if it did not)
    showed_value: bool = False  # the ranks returned a value, shown as the cell's result


@dataclass
class Generation:
    """The ranks of one start or restart and what became of them. Session replaces it whole,
    in one assignment, at start, restart and stop, so no reader ever sees old ranks beside
    new handles; inside one generation only cells change it (a rank's state, the unfinished
    cell, out_of_step), and a death."""

    ranks: list[Rank] = field(default_factory=list)
    launchers: dict = field(default_factory=dict)  # local ranks: rank -> process launcher
    ssh: dict = field(default_factory=dict)  # ranks started over ssh: rank -> launcher
    vanished: dict[int, float] = field(default_factory=dict)  # other ranks, gone since when
    unfinished: CellRun | None = None  # a cell some ranks still run after the notebook gave up
    death: Death | None = None  # the first rank to die; the cluster was stopped after it
    out_of_step: str = ""  # why cells are refused until a restart ('' when they are not)
    # After an attach: the cell that ran when the notebook before this one died (adopted.py).
    adopted: Adopted | None = None

    def ended(self) -> Generation:
        """The same rows once the processes are gone: no handles, every live rank stopped."""
        rows = [
            replace(r, state=r.state if r.state == "died" else "stopped") for r in self.ranks
        ]
        return Generation(ranks=rows, death=self.death, out_of_step=self.out_of_step)
