"""The cell runner: sending a cell to the ranks, waiting for all of them, and what happens
when the wait ends early (a death, a divergence, a timeout, an interrupt); the ranks' stacks
and signals.

A part of the face (session.py), given what it needs: the launch (its client and cluster),
the death watch, the ranks' logs, the settings, the face's ``stopping`` event and what the
face does when a rank died (``on_death``). Each cell runs on the generation the face hands it,
under the face's lock, on the main thread (a cell's report may end ranks). Its own state: the
recent cells' text (``sources``, for stack dumps), touched under the face's lock only.
"""

from __future__ import annotations

import collections
import signal
import time
from collections.abc import Callable

from spmd.cluster import interrupts
from spmd.cluster.channel import control
from spmd.cluster.launchers import processes
from spmd.cluster.lockstep import census, where
from spmd.cluster.lockstep.run import CellRun
from spmd.cluster.records import (
    DIED,
    DIVERGED,
    INSIDE_PATIENCE,
    INTERRUPTED,
    TIMEOUT,
    CellObserver,
    CellResult,
    OutOfStep,
    Stall,
)

# How long the other ranks may take to finish their cell once one died (see _stop_waiting).
AFTER_DEATH_SECONDS = 0.5

# How long a rank on this machine has to answer "where are you?" on its control channel (a
# few ms when it can) before it is asked by signal instead (it holds the GIL).
LOCAL_ANSWER_SECONDS = 0.5
# How long ranks let go from JupyterLab's debugger by an interrupt are sent it again.
RESUMED_SECONDS = 10.0

# Why a cell's wait ended when the kernel is shutting down (see Session.shutdown).
STOPPED = "stopped"


class _Late:
    """The watchdog's looks at ranks still busy past the grace (``_wait``): a look asks them
    for their census so far, and names those ahead of a finished rank (they diverged); the
    others are the run's ``stragglers``. The first look comes at the grace, then one a grace
    (half a second at least) apart, so a straggler that goes on to launch what the finished
    ranks never did is reported within a grace of it.

    The census does not see jax's eager operations on arrays over several processes
    (``print(x)``, ``x[::-1]``, ``jnp.dot`` outside a jit: jax's own programs), so each look
    also reads the stragglers' stacks (``run.inside``: those inside a call of jax or torch,
    and since when in that same call). When every busy rank has stayed in one such call, not
    compiling, for ``INSIDE_PATIENCE`` seconds, they are taken for diverged too; a look comes
    every second while one is there. A straggler in plain Python is waited for."""

    def __init__(self, client, run: CellRun, stacks: Callable[[list[int]], dict]) -> None:
        self.client, self.run, self.stacks = client, run, stacks
        self.looked: float | None = None
        self.records: dict[int, dict] = {}  # finished ranks' whole records, read once
        self.seen: dict[int, tuple[tuple, float]] = {}  # rank -> (its frames, there since)

    def next_look(self, grace_ends: float, grace: float) -> float:
        if self.looked is None:
            return grace_ends
        then = self.looked + max(grace, 0.5)
        waits = [since for stack, since in self.run.inside.values() if not stack.inside.building]
        if waits:  # (to see that it stays in the call, and to report it on time)
            then = min(then, self.looked + 1.0, min(waits) + INSIDE_PATIENCE)
        return max(grace_ends, then)

    def diverged(self) -> bool:
        """Whether the busy ranks cannot meet the finished ones: some launched what those
        never did (the census), or all of them stay inside jax or torch (their stacks)."""
        run = self.run
        busy = run.busy_ranks
        finished = {r: run.census.get(r) for r, c in run.cells.items() if c.done}
        found = census.launched_ahead(self.client, run.engine_ids, run.requests, busy,
                                      finished, self.records) if busy else []
        run.stragglers = [r for r in run.busy_ranks if r not in found]
        if not found:
            run.inside = self._inside(run.stragglers)
        self.looked = now = time.monotonic()
        stuck = [r for r, (stack, since) in run.inside.items()
                 if not stack.inside.building and now - since >= INSIDE_PATIENCE - 0.05]
        return bool(found) or (bool(busy) and set(stuck) >= set(busy))

    def _inside(self, ranks: list[int]) -> dict:
        """{rank: (its stack, since when it is in this same call)} of ``ranks`` inside a call
        of jax or torch now."""
        now = time.monotonic()
        stacks = self.stacks(ranks) if ranks else {}
        inside = {}
        for rank in ranks:
            stack = stacks.get(rank)
            if stack is None or stack.inside is None:
                self.seen.pop(rank, None)
                continue
            frames = tuple(stack.frames)
            before = self.seen.get(rank)
            since = before[1] if before is not None and before[0] == frames else now
            self.seen[rank] = (frames, since)
            inside[rank] = (stack, since)
        return inside


class CellRunner:
    """Cells on the ranks of a generation (see the module's opening comment)."""

    def __init__(self, launch, deaths, logs, settings, stopping,
                 on_death: Callable[[list], None], sources: collections.deque) -> None:
        self.launch, self.deaths, self.logs = launch, deaths, logs
        self.settings, self.stopping, self.on_death = settings, stopping, on_death
        # The text of recent cells, to show the lines of a stack dump (where.with_sources).
        self.sources = sources

    @property
    def _client(self):
        return self.launch.client  # (read afresh: a start or an attach sets it)

    def run(
        self,
        gen,
        code: str,
        observer: CellObserver | None = None,
        ranks: list[int] | None = None,
        timeout: float | None = None,
        grace: float | None = None,
        max_output: int | None = 0,
        breakpoints: str = "lowest",
    ) -> CellResult:
        """Send ``code`` to the ranks of ``gen`` (in step: the face checked) and wait until
        every one has finished (lockstep), ``observer`` seeing the cell as it runs.

        The wait ends early when a rank dies, when ranks still busy ``grace`` seconds after
        another finished launched what it never did, or all stay inside one call of jax or
        torch (they diverged: ranks only behind are waited for; ``_Late``), on a timeout, or
        when the notebook is interrupted. The result's ``stall`` then says which, and where
        the busy ranks were.
        ``max_output``: stream lines kept per rank (0: the settings'; None: all of them).
        """
        targets = {r.rank: r.engine_id for r in gen.ranks if ranks is None or r.rank in ranks}
        run = CellRun(
            self._client,
            targets,
            code,
            observer=observer,
            max_lines=self.settings.max_output if max_output == 0 else max_output,
            log=self.logs,
            breakpoints=breakpoints,
        )
        self.sources.append(code)
        self.logs.begin_cell(code)
        for rank in targets:
            gen.ranks[rank].state = "busy"
        # From the send on, a SIGINT either ends the wait (the report follows) or waits
        # for the report: people press Interrupt twice, and a second one must not cut the
        # report short and leave the ranks busy without the out-of-step guard.
        timeout = timeout or self.settings.cell_timeout
        grace = self.settings.grace if grace is None else grace
        try:
            with interrupts.held("the report"):
                run.send()
                try:
                    with interrupts.interruptible():
                        reason, seconds = self._wait(gen, run, timeout, grace or None)
                except KeyboardInterrupt:
                    reason, seconds = INTERRUPTED, None
                    if run.prompt_interrupted:
                        # Interrupted at a rank's prompt: the ranks at prompts raise
                        # KeyboardInterrupt themselves. If that ends the cell everywhere, the
                        # ranks are still in step: the cell just failed.
                        run.wait(until=time.monotonic() + 2.0, poll=0.02)
                        reason = "" if run.finished else reason
                if reason == STOPPED:
                    raise OutOfStep(
                        "the kernel is shutting down: the cell's wait ended and the cluster "
                        "is being stopped."
                    )
                if reason:
                    run.stall = self._stop_waiting(gen, run, reason, seconds)
        finally:
            self.logs.flush()
            for rank, cell in run.cells.items():  # (gen's rows: a death's end copies them)
                if cell.done and gen.ranks[rank].state == "busy":
                    gen.ranks[rank].state = "idle"
                    gen.ranks[rank].last_seconds = cell.seconds
        return run.result()  # (the live run stays the generation's, if ranks still run it)

    def _wait(
        self, gen, run: CellRun, timeout: float | None, grace: float | None
    ) -> tuple[str, float | None]:
        """Poll the cell until it finishes ('', None) or a reason to stop waiting."""
        last = time.monotonic()
        late = _Late(self._client, run, lambda ranks: self.stacks(gen, ranks))
        while not run.finished:
            now = time.monotonic()
            if run.debugger_paused() and not run.prompting:  # (a prompt counts itself)
                # (a person steps through the ranks in JupyterLab's debugger: as at a prompt,
                # neither the timeout nor the grace counts that time)
                run.paused += now - last
                if run.first_done is not None:
                    run.first_done += now - last
            last = now
            # (the time a person spent at a prompt does not count)
            until = None if timeout is None else run.started + run.paused + timeout
            if self.stopping.is_set():  # (a shutdown from ipykernel's control thread)
                return STOPPED, None
            if self.deaths.any(gen):
                return DIED, None
            if until is not None and now >= until:
                return TIMEOUT, timeout
            # (a rank whose output keeps coming, a flood, is not stuck: the grace runs from
            # the later of the first rank done and the latest output, for 10 graces at most:
            # a rank stuck in a collective while a thread of its cell prints is still found)
            grace_ends = (
                None
                if grace is None or run.first_done is None
                else min(
                    max(run.first_done, run.last_output or 0.0),
                    run.first_done + 10 * grace,
                )
                + grace
            )
            look_at = None if grace_ends is None else late.next_look(grace_ends, grace)
            if look_at is not None and now >= look_at:
                # Late is not diverged: only ranks that launched what a finished rank never
                # did, or that stay inside jax or torch, cannot meet it; the others are
                # behind, and the cell waits for them.
                if late.diverged():
                    return DIVERGED, round(time.monotonic() - run.first_done, 1)
                look_at = late.next_look(grace_ends, grace)
            wake = min(t for t in (until, look_at, now + 0.1) if t is not None)
            run.poll(max(0.0, wake - now))
            if run.observer is not None:
                run.observer.tick(run)
        # A rank that died at the very end: its death is the cell's news.
        return (DIED, None) if self.deaths.any(gen) else ("", None)

    def _stop_waiting(self, gen, run: CellRun, reason: str, seconds: float | None) -> Stall:
        deaths = self.deaths.deaths(gen)
        if reason == DIED and deaths and "torch" in self.settings.backend:
            self._let_survivors_finish(gen, run, {d.rank for d in deaths})
        ahead = [r for r in run.busy_ranks if r not in run.stragglers]
        now = time.monotonic()
        inside = {r: (stack, now - since) for r, (stack, since) in run.inside.items()
                  if r in run.busy_ranks}
        stall = Stall.at(reason, seconds, run.cells, deaths=deaths,
                         ahead=ahead if reason == DIVERGED else [],
                         inside=inside if reason == DIVERGED and not ahead else {})
        busy = stall.busy
        # Where the busy ranks are, before an interrupt moves them.
        stall.stacks = self.stacks(gen, busy)
        stall.in_debugger = run.debugger_paused()
        # Why, before an interrupt or a death's end takes the ranks' records with them.
        stall.census = census.read(self._client, run.engine_ids, stall, run.requests)
        if reason == DIED:
            self.on_death(stall.deaths)
            return stall
        stall.unresponsive = self._interrupt(gen, run, busy)
        what = {DIVERGED: "diverged", INTERRUPTED: "was interrupted"}.get(reason)
        what = what or f"timed out after {seconds:g} s"
        # Ranks stopped in the middle of a cell may be in the middle of a collective, or past
        # one the others never reached: the next collective would hang or mix up data. Only
        # a restart brings them back together.
        gen.out_of_step = (
            f"the last cell {what}, so the ranks are out of step: %spmd restart before going on."
        )
        return stall

    def _let_survivors_finish(self, gen, run: CellRun, dead: set[int]) -> None:
        """gloo raises at once in the other ranks when a peer's connection drops (jax's
        ranks stay blocked, so a jax death report does not wait for them). Their errors belong
        in the death report, not stacks caught half-way through formatting them: wait a
        moment, and longer for ranks already past the cell's code."""

        def busy() -> list[int]:
            return [r for r, c in run.cells.items() if not c.done and r not in dead]

        def wait(ranks: list[int], seconds: float) -> None:
            until = time.monotonic() + seconds
            while (
                time.monotonic() < until
                and not self.stopping.is_set()
                and any(not run.cells[r].done for r in ranks)
            ):
                run.poll(0.02)

        wait(busy(), AFTER_DEATH_SECONDS)
        stacks = self.stacks(gen, busy())
        wait([r for r, s in stacks.items() if s is not None and not s.at_cell_line], 5.0)

    def _interrupt(self, gen, run: CellRun, busy: list[int], grace: float = 0.5) -> list[int]:
        """SIGINT to the busy ranks; the ones still busy after ``grace`` seconds. Ranks
        paused in JupyterLab's debugger go on first: paused, they would never see it."""
        paused = run.debugger_paused()
        if paused:
            control.resume_debugged(self._client, [gen.ranks[r].engine_id for r in paused])
            # (a SIGINT that lands before debugpy has let the rank go leaves it stuck there:
            # seen on a busy machine, with debugpy in the rank's own process)
            until = time.monotonic() + RESUMED_SECONDS / 2
            while time.monotonic() < until and any(
                    s is not None and any(f.function == "_do_wait_suspend" for f in s.frames)
                    for s in self.stacks(gen, paused).values()):
                time.sleep(0.05)
        self.signal(gen, signal.SIGINT, busy)
        run.wait(until=time.monotonic() + grace, poll=0.02)
        # A SIGINT that lands while debugpy is still letting a paused rank go is swallowed
        # by it, and on a busy machine that takes a while: again, until it reaches the cell.
        until = time.monotonic() + RESUMED_SECONDS
        again = [r for r in run.busy_ranks if r in paused]
        while again and time.monotonic() < until:
            self.signal(gen, signal.SIGINT, again)
            run.wait(until=time.monotonic() + grace, poll=0.02)
            again = [r for r in run.busy_ranks if r in paused]
        left = [r for r in run.busy_ranks if r in busy]
        gen.unfinished = run if left else None
        return left

    def stacks(self, gen, ranks: list[int]) -> dict[int, where.Stack | None]:
        """The main-thread Python stack of each rank of ``gen`` (None: it did not answer)."""
        if not ranks or self._client is None:
            return {}
        # Every rank is asked on its control channel first: its control thread reads the
        # stack under the GIL. A rank on this machine that did not answer holds the GIL (in
        # C, or stuck): its signal handler dumps the stacks from C. Only then, because a
        # dump that reads other threads' frames while they run can crash the rank
        # (CPython #116008, a SIGSEGV once a second's looks); with the GIL held, none runs.
        local = {r: gen.launchers[r].process for r in ranks if r in gen.launchers}
        gone = {r for r, process in local.items() if processes.exited(process)}
        asked = {r: gen.ranks[r].engine_id for r in ranks if r not in gone}
        found: dict[int, list[where.Frame] | None] = dict.fromkeys(gone)
        if asked:  # (one request for all; the longer wait where a rank is on another host)
            timeout = LOCAL_ANSWER_SECONDS if set(asked) <= set(local) else 1.0
            by_engine = control.stacks(self._client, list(asked.values()), timeout)
            for r, engine_id in asked.items():
                frames = by_engine.get(engine_id)
                found[r] = None if frames is None else [where.Frame(*f) for f in frames]
        silent = {
            r: (local[r], gen.launchers[r].stack_file, gen.ranks[r].main_thread)
            for r in asked
            if found[r] is None and r in local
        }
        if silent:
            found.update(where.dump(silent))
        return {r: None if frames is None else where.cell_stack(r, frames, self.sources)
                for r, frames in found.items()}

    def interrupt(self, gen) -> tuple[list[int], list[int]]:
        """SIGINT to the ranks of ``gen`` still running a cell the notebook stopped waiting
        for: (the ones sent it, the ones still busy). (Under the face's lock.)"""
        busy = self.busy_ranks(gen)
        if not busy:
            return [], []
        return busy, self._interrupt(gen, gen.unfinished, busy)

    def busy_ranks(self, gen) -> list[int]:
        """Ranks of ``gen`` still running a cell the notebook stopped waiting for. (Under the
        face's lock.)"""
        run = gen.unfinished
        if run is None:
            return []
        run.poll(0, answer=False)  # (a prompt is left for a person, not a keypress)
        for rank, cell in run.cells.items():
            if cell.done and gen.ranks[rank].state == "busy":
                gen.ranks[rank].state = "idle"
        if run.finished:
            gen.unfinished = None
        return run.busy_ranks

    def signal(self, gen, signum: int, ranks: list[int] | None = None) -> None:
        """Send a signal to the processes of some ranks of ``gen`` (default: all)."""
        cluster = self.launch.cluster
        if cluster is None:
            return
        chosen = [r.rank for r in gen.ranks] if ranks is None else ranks
        cluster.signal_ranks([r for r in chosen if r in gen.launchers], signum)
        far = [gen.ranks[r].engine_id for r in chosen if r not in gen.launchers]
        if far and self._client is not None:
            control.signal(self._client, far, signum)
