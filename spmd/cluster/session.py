"""The cluster's one face: a Session is one SPMD cluster from its start to its stop, and its
verbs are all the notebook asks of it: ``start``, ``run_cell`` (observed through one
records.CellObserver), ``interrupt``, ``restart``, ``stop`` (and ``shutdown`` from another
thread), ``attach``, ``call`` (a function on one rank), ``stacks`` and ``signal``. What comes
back are the records of records.py; what runs is read as one frozen ``record()``.

Session keeps the lock and the generation, and hands its parts what each needs (never
itself):

- ``launch`` (startup.py, Launch): the processes, started in named steps, re-forked by a
  restart (restarts.py), ended by a stop (stopping.py); ``record()`` is a frozen copy of what
  runs (records.Running).
- ``deaths`` (deaths.py, DeathWatch): which ranks ended or vanished, and how.
- ``cells`` (cells.py, CellRunner): a cell in lockstep, its wait and report; stacks, signals.
- ``late`` (late.py, LateOutputs): what ranks print after their cell.
- ``logs`` (lockstep/logs.py): every line each rank printed.

Who may touch what:
- ``gen`` (the ranks of this start or restart, their process handles, the unfinished cell,
  the death) is replaced whole by start, restart and stop, in one assignment, by Session
  only; inside a generation, cells change a rank's state and the unfinished cell, and a
  death its death. The launch's processes change only with it. All of these change only
  while ``life`` is held: start, restart, stop, death handling and a cell's run (its report
  may end ranks) hold it from beginning to end. Readers on other threads see one generation
  or the next, never a mix.
- The main thread runs cells, restarts and stops. ipykernel's control thread asks for a stop
  (``shutdown``): it cancels what the main thread is doing (a cell's wait, a start, a
  restart's wait all give up within ~0.1 s: ``cancelled`` and ``stopping``), then takes
  ``life`` and stops. The kernel's background start runs ``start`` on a Session of its own,
  which no cell sees until it ended. ipyparallel's event-loop thread owns the launchers and
  engine sets; this side reads them only through copies (see SpmdCluster). The client's IO
  thread hands over what ranks print after their cell through one deque (channel/client.py),
  taken under ``life`` (collect_late). The debugger's control thread asks ``busy`` and
  the death watch's ``dead_ranks`` of one generation it reads, which never wait.
- The rank server (the launch's ``rank_server``: this machine's, or those of the ssh hosts) is started and
  closed under ``life`` with the cluster; ipyparallel's event-loop thread asks it for forks,
  and each server's reader thread is the only writer of what it answered (servers.py).
- A SIGINT on the main thread during a stop, a restart's end of the old ranks, a start's
  last steps or a cell's report is held until it has finished (interrupts.py).
"""

from __future__ import annotations

import atexit
import collections
import shutil
import threading
import time

from spmd.cluster import adopted, attach, interrupts, linger, restarts, stopping
from spmd.cluster.cells import AFTER_DEATH_SECONDS, CellRunner
from spmd.cluster.deaths import DeathWatch
from spmd.cluster.generation import Generation
from spmd.cluster.late import LateOutputs
from spmd.cluster.lockstep import census
from spmd.cluster.lockstep.census import first_difference
from spmd.cluster.lockstep.logs import RankLogs
from spmd.cluster.lockstep.run import PRINTED, CellRun, RankCell, unmarked
from spmd.cluster.lockstep.where import Stack
from spmd.cluster.records import (
    CellObserver,
    CellResult,
    Death,
    OutOfStep,
    Ran,
    Rank,
    Running,
    Settings,
    StartError,
)
from spmd.cluster.startup import Launch, check_can_start

# What the magics read of a cell beside the records (records.py): a rank's part of a cell and
# its printed arrays' marks, the live run an observer is shown, a rank's stack, where the
# ranks' launches part, the ranks' logs. The face hands them on, so that the notebook's side
# reaches the cluster through this module and records.py only (tests/test_layout.py).
__all__ = [
    "AFTER_DEATH_SECONDS",
    "PRINTED",
    "CellRun",
    "OutOfStep",
    "Ran",
    "Rank",
    "RankCell",
    "RankLogs",
    "Running",
    "Session",
    "Settings",
    "Stack",
    "StartError",
    "first_difference",
    "unmarked",
]

# How rank 0 says its coordinator's port was taken: jax raises the first when the join fails
# on its thread; the second is gRPC's own line when the engine exits before it registered.
PORT_TAKEN = ("Failed to start RPC server", "Failed to add port to server")


class Session:
    def __init__(self, settings: Settings, cache_dir: str | None = None,
                 logs: RankLogs | None = None, progress=None) -> None:
        self.settings = settings
        self.gen = Generation()  # the ranks now (see above)
        self.life = threading.RLock()
        # Set by cancel (the kernel's background start is not wanted) and by shutdown: a
        # start under way gives up.
        self.cancelled = threading.Event()
        # Set by shutdown only: every wait of the main thread gives up (a cell's, a restart's).
        self.stopping = threading.Event()
        # ``cache_dir``: a restart's compilation cache, so compiled cells stay compiled.
        # ``progress(stage, done, of, coordinator)`` hears how the start goes.
        self.launch = Launch(settings, self.cancelled, cache_dir=cache_dir)
        self.launch.progress = progress
        self.logs = logs if logs is not None else RankLogs()  # (a restart's go on)
        self.late = LateOutputs()
        sources = collections.deque(maxlen=200)  # recent cells' text, for stacks' lines
        self.deaths = DeathWatch(self.launch, self.logs, sources, self.collect_late)
        self.cells = CellRunner(self.launch, self.deaths, self.logs, settings, self.stopping,
                                self.end_after_death, sources)
        # The cells since the start or the last restart, in order, and how each went
        # (records.Ran), for %spmd export. The main thread's: it runs cells and restarts.
        self.ran: list[Ran] = []
        self.start_seconds = 0.0
        self.afresh_because = ""  # why a restart started afresh ('' when it did not)
        self.env_left_out = ""  # what cells set on the ranks that the last restart left out

    # What runs, for readers (the magics, the panel, the debugger, the benchmarks, tests).

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
    def running(self) -> bool:
        """Whether the ranks run (after a death they do not, though the controller may)."""
        return self.launch.cluster is not None and self.gen.death is None

    def record(self) -> Running:
        """What runs now (client, controller, rank server, folders), as a frozen copy."""
        return self.launch.record()

    def busy(self) -> bool:
        """Whether a cell, a start, a restart or a stop holds the cluster now, or ranks still
        run a cell the notebook stopped waiting for. (Any thread; never waits.)"""
        free = self.life.acquire(blocking=False)
        if free:
            self.life.release()
        return not free or self.gen.unfinished is not None

    # The cluster's life.

    def start(self) -> None:
        """Start the engines and join them into one distributed job. Raises StartError."""
        t0 = time.perf_counter()
        check_can_start(self.settings)
        with self.life:
            for attempt in (1, 2):
                self.launch.prepare()
                atexit.register(self.stop)
                try:
                    self.launch.open_cluster()
                    self._new_generation(self.launch.connect())
                    self.launch.join(self.gen.ranks)
                    linger.keep(self.launch, self.gen.ranks)
                    break
                except StartError as exc:
                    # another program took the coordinator's port in the meantime: once more,
                    # with the same compilation cache
                    again = (
                        attempt == 1
                        and not self.cancelled.is_set()
                        and any(sign in str(exc) for sign in PORT_TAKEN)
                    )
                    self.stop(keep_cache=again)
                    if not again:
                        raise
                except BaseException:
                    self.stop()
                    raise
            self.launch.progress = None  # (the start's: a restart tells no one)
        self.start_seconds = time.perf_counter() - t0

    def cancel(self) -> None:
        """A ``start`` on another thread gives up soon, stopping what it began."""
        self.cancelled.set()

    def attach(self, record) -> Session:
        """Hold the lingering cluster of ``record`` (linger.Record) instead of starting one,
        or leave everything as it was (attach.AttachError): it lingers on. (The new
        Session's own, before any other verb: attach.py takes the lock.)"""
        return attach.attach(self, record)

    def _new_generation(self, engine_ids: list[int]) -> None:
        """The ranks are these engines, in this order (rank = position: ids change after a
        restart)."""
        cluster = self.launch.cluster
        self.gen = Generation(
            ranks=[Rank(rank=r, engine_id=eid) for r, eid in enumerate(engine_ids)],
            launchers=cluster.rank_launchers(),
            ssh=cluster.ssh_launchers(),
        )
        self.late.know(self.gen.ranks)

    def restart(self) -> bool:
        """Start the ranks again, keeping the controller and the client, forked by the rank
        servers. False (nothing done) where there are none, or they ended: the caller then
        stops and starts afresh. Raises StartError if the new ranks fail to join."""
        self.env_left_out = restarts.keep_rank_env(self.launch.client, self.gen.ranks)
        server = self.launch.rank_server
        if server is None:
            return False
        t0 = time.perf_counter()
        with self.life, interrupts.held("the restart"):
            if self.launch.cluster is None or self.stopping.is_set() or not server.usable:
                return False  # (a server that ended: the restart starts a new one)
            # (a new server imports jax with what changed: the restart starts afresh)
            self.afresh_because = restarts.why_afresh(self.launch)
            if self.afresh_because:
                return False
            try:
                self._refork()
            except BaseException:
                self.stop(keep_cache=True)
                raise
        self.start_seconds = time.perf_counter() - t0
        return True

    def _refork(self) -> None:
        engine_ids, coordinators = restarts.refork(self.launch)
        self.cells.sources.clear()
        self.ran.clear()  # (what the new ranks have not run, an export leaves out)
        with interrupts.interruptible():  # (a ^C here gives up the restart: the stop follows)
            self.launch.wait_registered(engine_ids)
            self._new_generation(list(engine_ids))
            self.launch.tell_coordinator(coordinators)
            self.launch.join(self.gen.ranks)  # (coordinators given at the fork)
        linger.keep(self.launch, self.gen.ranks)

    def stop(self, keep_cache: bool = False) -> None:
        """End every engine and the controller. Safe to call twice, and at exit.
        ``keep_cache``: keep the compilation cache for the next start (a restart)."""
        with self.life, interrupts.held("the stop"):
            self._stop(keep_cache)

    def shutdown(self, wait: float = 4.0) -> None:
        """Stop from another thread (ipykernel's control thread, at a shutdown request):
        the main thread's work with this cluster gives up, then the stop runs. A main thread
        that does not let go within ``wait`` s (a rank's prompt waits for an answer that will
        not come) is stopped beside: the kernel ends right after, killed without a stop."""
        self.stopping.set()
        self.cancelled.set()
        linger.disarm(self.launch)  # (a kernel killed while it stops: its ranks end with it)
        got = self.life.acquire(timeout=wait)
        try:
            # (beside a main thread that may still wait on the cluster's event loop: that
            # loop is left running, for the process's end to take)
            self._stop(keep_cache=False, end_loop=got)
        finally:
            if got:
                self.life.release()

    def _stop(self, keep_cache: bool, end_loop: bool = True) -> None:
        atexit.unregister(self.stop)
        launch = self.launch
        linger.disarm(launch)  # (nothing to linger for, nor to attach to)
        if not keep_cache and launch.cache_dir and launch.cache_dir != self.settings.cache_dir:
            shutil.rmtree(launch.cache_dir, ignore_errors=True)
            launch.cache_dir = None
        running = launch.record()
        if running.client is not None and running.cluster is not None:
            stopping.end_far_ranks(running, self.gen)
            if end_loop:  # (with the lock: a rank's last words before the stop, into its log)
                self.collect_late()
        running = launch.hand_over()
        self.gen = self.gen.ended()
        stopping.end_all(running, self.settings, end_loop)
        self.logs.close()
        launch.remove_torch_file()
        if launch.profile_dir:
            shutil.rmtree(launch.profile_dir, ignore_errors=True)
            launch.profile_dir = None

    def notice_deaths(self) -> None:
        """If a rank died since the last look, stop the others and say so from now on."""
        with self.life:
            gen = self.gen
            if self.launch.cluster is not None and gen.death is None and self.deaths.any(gen):
                self.end_after_death(self.deaths.deaths(gen))

    def check_alive(self) -> None:
        """Raise OutOfStep if a rank died (now, or earlier) and the cluster is stopped."""
        self.notice_deaths()
        if self.death is not None:
            raise OutOfStep(self.out_of_step)

    def end_after_death(self, deaths: list[Death]) -> None:
        """The ranks end (their report is made); the generation keeps the death."""
        first = deaths[0]
        with self.life, interrupts.held("the stop after a death"):
            self.gen.death = first
            self.gen.out_of_step = (
                f"rank {first.rank} died ({first.how}) and the cluster was stopped: "
                "%spmd restart starts a fresh one."
            )
            for d in deaths:
                self.ranks[d.rank].state = "died"
                self.deaths.mark_lost(self.gen, d)
            if self.launch.rank_server is not None:
                # the controller and the rank server stay, for a fast restart
                stopping.end_ranks(self.launch.record(), self.gen)
                self.gen = self.gen.ended()
            else:
                self.stop(keep_cache=True)

    # Cells (cells.py), and what ranks print after them (late.py).

    def run_cell(self, code: str, observer: CellObserver | None = None, **how) -> CellResult:
        """Send ``code`` to the ranks and wait until every one has finished (lockstep),
        ``observer`` seeing it as it runs; refused (OutOfStep) after a death or a cell that
        left the ranks out of step. ``how``: see CellRunner.run."""
        with self.life:
            self.check_alive()
            if self.gen.out_of_step:
                raise OutOfStep(self.gen.out_of_step)
            return self.cells.run(self.gen, code, observer, **how)

    def interrupt(self) -> tuple[list[int], list[int]]:
        """SIGINT to the ranks still running a cell: (the ones sent it, the ones still busy).
        After an attach, the cell from before it when no later one runs."""
        with self.life:
            sent, still = self.cells.interrupt(self.gen)
            if sent or self.gen.adopted is None:
                return sent, still
            return adopted.interrupt(self.gen, self.launch.client, self.cells.signal)

    def busy_ranks(self) -> list[int]:
        """Ranks still running a cell the notebook stopped waiting for (or from before)."""
        with self.life:
            busy = self.cells.busy_ranks(self.gen)
        return sorted({*busy, *self.busy_before_attach()})  # (the hub's: outside the lock)

    def busy_before_attach(self) -> list[int]:
        """The ranks still running the cell from before the attach."""
        held = self.gen.adopted
        return held.busy_ranks(self.launch.client) if held is not None else []

    def outputs_before_attach(self, with_news: bool = True) -> tuple[list, str]:
        """What the cell from before the attach printed since the last look (short), and
        (``with_news``), once, one line on how it ended ('' before that)."""
        held = self.gen.adopted
        if held is None:  # (every cell asks)
            return [], ""
        news = held.news(self.launch.client) if with_news else ""
        self.collect_late()  # (its error came before its end: shown with the line)
        return self.late.take_before(self.settings.max_output), news

    def census(self, engine_ids: dict[int, int], requests: dict | None = None,
               timeout: float = 1.0) -> dict[int, dict]:
        """{rank: its census record of a cell (its last, or ``requests[rank]``)}, asked."""
        return census.fetch(self.launch.client, engine_ids, requests, timeout)

    def stacks(self, ranks: list[int]):
        """The main-thread Python stack of each rank (None: it did not answer)."""
        return self.cells.stacks(self.gen, ranks)

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        """Send a signal to the processes of some ranks (default: all)."""
        self.cells.signal(self.gen, signum, ranks)

    def call(self, rank: int, fn, *args, timeout: float):
        """``fn(*args)`` on one rank (through ipyparallel's signed ``apply``): its answer.
        Raises the rank's error, or ipyparallel's TimeoutError after ``timeout`` seconds."""
        engine = self.launch.client[self.gen.ranks[rank].engine_id]
        return engine.apply_async(fn, *args).get(timeout)

    def collect_late(self) -> None:
        """Take what the client kept of the ranks' late outputs: streams into the logs now
        (a death report points there), everything kept for the next cell to show."""
        with self.life:
            self.late.collect(self.launch.client, self.logs)

    def late_outputs(self) -> list:
        """What ranks printed after their cell had ended (a thread, a callback) since the
        last cell, in order and kept short as a cell's output is (--max-output)."""
        client = self.launch.client
        if not (self.late.taken or getattr(client, "late", None)
                or getattr(client, "adopted", None) is not None):
            return []  # (most cells: nothing came after the last one)
        self.collect_late()
        return self.late.take(self.settings.max_output)


def unfinished(session: Session):
    """The cell some of ``session``'s ranks still run after the notebook stopped waiting for
    it (a timeout, a divergence), or None. (Any thread; never waits: while something holds
    the cluster, as it was last seen.)"""
    if session.gen.unfinished is not None and session.life.acquire(blocking=False):
        try:
            session.cells.busy_ranks(session.gen)  # (looks: a run that has ended is let go)
        finally:
            session.life.release()
    return session.gen.unfinished
