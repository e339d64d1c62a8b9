"""The records that cross the cluster's face (session.py): what a cluster is asked for (its
settings), what runs (Running), the rows of its rank table, the cells that ran (for an
export), what one cell was (its outputs and result), how a cell's run is watched (the
observer), and the two errors its life and its cells raise.

Records are made on the notebook's main thread and read anywhere: the frozen ones never
change once made; a Rank row changes only under the face's lock (session.py says who may).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from spmd.cluster.launchers import remote
from spmd.cluster.launchers.processes import how_it_ended


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
    fell_back: str = ""  # why the ranks started without the rank server ('' if not)


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


# -- what a cell was ---------------------------------------------------------------------------

def left_out_line(lines: int) -> str:
    """The line a rank's bounded text has where lines were left out: the same on every rank
    that left out as many, so that it groups (and the per-rank data leaves it out)."""
    return f"... {lines:,} lines left out here (%spmd log RANK shows a rank's whole output) ...\n"


@dataclass
class Output:
    """One output of one rank: a stream chunk, a display, a result or an error.

    ``kind`` is ``stdout``, ``stderr``, ``display``, ``result``, ``error`` or ``clear`` (a
    ``clear_output``, with ``data["wait"]``). Streams carry
    ``text``; displays and results carry a MIME bundle in ``data``; errors carry ``ename``,
    ``evalue`` and the ``traceback`` lines.
    """

    kind: str
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CellResult:
    """What one cell was, once the notebook's wait for it ended (``CellRun.result``)."""

    code: str
    cells: Mapping[int, Any]  # rank -> its lockstep.run.RankCell: outputs, error, seconds
    engine_ids: Mapping[int, int]  # rank -> ipyparallel engine id: the ranks it ran on
    requests: Mapping[int, str]  # rank -> the msg_id of its execute request
    census: Mapping[int, list]  # rank -> [launches, digest] from its reply (engine/watch/launches.py)
    # rank -> the parts of the arrays it printed, from its reply (engine/arrays/print_marks.py)
    printed: Mapping[int, dict]
    # A Stall (below: why the wait ended, busy ranks, deaths, stacks, census)
    # when the wait ended before every rank finished; None when every rank did.
    stall: object | None
    started: float  # when it was sent (time.monotonic())
    prompting: frozenset[int]  # ranks waiting at a prompt when the wait ended
    in_debugger: tuple[int, ...]  # ranks still in it, paused in JupyterLab's debugger, then

    @property
    def ranks(self) -> list[int]:
        """The ranks it ran on, lowest first."""
        return sorted(self.engine_ids)


class CellObserver(Protocol):
    """What watches one cell while it runs, on the notebook's main thread (the magics' live
    view): every output of every rank as it comes, a tick about ten times a second, and a
    rank's prompt (input, getpass, pdb) to answer."""

    def output(self, rank: int, out: Output) -> None:
        """One output of ``rank`` (a stream chunk, a display, a result, an error)."""

    def tick(self, run) -> None:
        """The cell still runs (``run``: the live lockstep.run.CellRun, read only)."""

    def prompt(self, rank: int, request: dict, run) -> dict:
        """``rank`` asks the person (``request``: its prompt); the answer, ``{"text": ...}``
        or ``{"error": why}``. A KeyboardInterrupt ends every rank's prompt."""


# -- why a cell stopped before every rank finished ---------------------------------------------
# In SPMD the classic failure is silent: one rank raises, or takes another branch, while the
# others wait in a collective forever. The cell runner's wait (cells.py) notices four things (a
# rank that died, ranks still busy a grace period after another finished that launched what it
# never did, a timeout, the user's interrupt) and keeps what it found in these records: the
# magics say it in words (spmd/magics/cells/report.py). The census does not see jax's own
# programs (an eager operation on an array over several processes), so a straggler that stays
# inside one call of jax or torch for ``INSIDE_PATIENCE`` seconds past the grace is taken for
# diverged too.

DIED, DIVERGED, TIMEOUT, INTERRUPTED = "died", "diverged", "timeout", "interrupted"

# How long past the grace every busy rank may stay inside one call of jax or torch (the same
# stack at every look, not compiling) before it is taken for waiting in a cross-process
# operation that a finished rank did not make: the census does not see jax's own programs.
INSIDE_PATIENCE = 3.0


@dataclass
class Death:
    """One rank's process ended on its own (not stopped by the notebook)."""

    rank: int
    pid: int
    exit_code: int | None
    at: float  # time.monotonic()
    last_lines: list[str] = field(default_factory=list)
    crash: Any = None  # where it was (a lockstep.where.Stack), if it crashed in Python
    host: str = ""
    cause: str = ""  # what is known where the exit code is not (a rank on another host)
    log: str = ""  # the file with every line it printed in its cells ('' if none)

    @property
    def how(self) -> str:
        """'killed by SIGKILL', 'exit code 1'."""
        if self.exit_code is None:
            return self.cause or "it exited"
        return how_it_ended(self.exit_code)


@dataclass
class Stall:
    """The notebook stopped waiting for a cell before every rank finished."""

    reason: str  # DIED | DIVERGED | TIMEOUT | INTERRUPTED
    seconds: float | None  # the grace or the timeout that ran out
    busy: list[int]  # ranks still running when the wait ended
    stacks: dict[int, Any]  # where each busy rank was (where.Stack or None), before any interrupt
    finished: list[int] = field(default_factory=list)  # ranks done when the wait ended
    raised: list[int] = field(default_factory=list)  # those of them that raised
    unresponsive: list[int] = field(default_factory=list)  # busy after SIGINT and a grace
    deaths: list[Death] = field(default_factory=list)  # first to die first
    in_debugger: list[int] = field(default_factory=list)  # busy ranks paused in the debugger
    # What the living ranks' census said of the cell's launches, read before any interrupt or
    # a death's end takes their records with them (None: not read)
    census: Any = None  # (a lockstep.census.Reading)
    # DIVERGED: the busy ranks that launched what a finished rank never did (the others were
    # only behind, and are interrupted with them)
    ahead: list[int] = field(default_factory=list)
    # DIVERGED with no census evidence: the busy ranks that stayed inside one call of jax or
    # torch past the patience, rank -> (its stack then, seconds seen in that call)
    inside: dict[int, tuple[Any, float]] = field(default_factory=dict)

    @classmethod
    def at(cls, reason: str, seconds: float | None, cells: dict, **kw) -> Stall:
        """A Stall for ``cells`` (rank -> its lockstep.run.RankCell) as they are now: call it
        before interrupting anyone."""
        dead = {d.rank for d in kw.get("deaths", [])}
        finished = sorted(r for r, c in cells.items() if c.done and r not in dead)
        raised = [r for r in finished if cells[r].error is not None]
        busy = sorted(r for r, c in cells.items() if not c.done and r not in dead)
        return cls(reason, seconds, busy, {}, finished, raised, **kw)
