"""Cells in lockstep: sending one to the ranks, waiting for all of them, and what happens
when the wait ends early (a death, a divergence, a timeout, an interrupt); the ranks' stacks."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from spmd.cluster import interrupts
from spmd.cluster.channel import control
from spmd.cluster.lockstep import census, where
from spmd.cluster.lockstep.outputs import Output, RankCell, output_from_message
from spmd.cluster.lockstep.run import CellRun
from spmd.cluster.lockstep.watchdog import DIED, DIVERGED, INTERRUPTED, TIMEOUT, Stall
from spmd.cluster.ranks import OutOfStep

# How long the other ranks may take to finish their cell once one died (see _stop_waiting).
AFTER_DEATH_SECONDS = 0.5

# How long ranks let go from JupyterLab's debugger by an interrupt are sent it again.
RESUMED_SECONDS = 10.0

# Why a cell's wait ended when the kernel is shutting down (see Session.shutdown).
STOPPED = "stopped"


class Cells:
    """Session's cells (a mixin: the state is Session's, see session.py)."""

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
        with self._life:
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
                            reason, seconds = self._wait(run, timeout, grace or None, tick)
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
        last = time.monotonic()
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
            if self._stopping.is_set():  # (a shutdown from ipykernel's control thread)
                return STOPPED, None
            if self._any_death():
                return DIED, None
            if until is not None and now >= until:
                return TIMEOUT, timeout
            # (a rank whose output keeps coming, a flood, is not stuck: the grace runs from
            # the later of the first rank done and the latest output, for 10 graces at most:
            # a rank stuck in a collective while a thread of its cell prints is still found)
            diverged_at = (
                None
                if grace is None or run.first_done is None
                else min(
                    max(run.first_done, run.last_output or 0.0),
                    run.first_done + 10 * grace,
                )
                + grace
            )
            if diverged_at is not None and now >= diverged_at:
                return DIVERGED, grace
            wake = min(t for t in (until, diverged_at, now + 0.1) if t is not None)
            run.poll(max(0.0, wake - now))
            if tick is not None:
                tick(run)
        # A rank that died at the very end: its death is the cell's news.
        return (DIED, None) if self._any_death() else ("", None)

    def _stop_waiting(self, run: CellRun, reason: str, seconds: float | None) -> Stall:
        deaths = self._deaths()
        if reason == DIED and deaths and "torch" in self.settings.backend:
            self._let_survivors_finish(run, {d.rank for d in deaths})
        stall = Stall.at(reason, seconds, run.cells, deaths=deaths)
        busy = stall.busy
        # Where the busy ranks are, before an interrupt moves them.
        stall.stacks = self.stacks(busy)
        stall.in_debugger = run.debugger_paused()
        # Why, before an interrupt or a death's end takes the ranks' records with them.
        stall.census = census.for_report(self.client, run.engine_ids, stall, run.requests)
        if reason == DIED:
            self._end_after_death(stall.deaths)
            return stall
        stall.unresponsive = self._interrupt(run, busy)
        what = {DIVERGED: "diverged", INTERRUPTED: "was interrupted"}.get(reason)
        what = what or f"timed out after {seconds:g} s"
        # Ranks stopped in the middle of a cell may be in the middle of a collective, or past
        # one the others never reached: the next collective would hang or mix up data. Only
        # a restart brings them back together.
        self.gen.out_of_step = (
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
            while (
                time.monotonic() < until
                and not self._stopping.is_set()
                and any(not run.cells[r].done for r in ranks)
            ):
                run.poll(0.02)

        wait(busy(), AFTER_DEATH_SECONDS)
        stacks = self.stacks(busy())
        wait([r for r, s in stacks.items() if s is not None and not s.at_cell_line], 5.0)

    def _interrupt(self, run: CellRun, busy: list[int], grace: float = 0.5) -> list[int]:
        """SIGINT to the busy ranks; the ones still busy after ``grace`` seconds. Ranks
        paused in JupyterLab's debugger go on first: paused, they would never see it."""
        paused = run.debugger_paused()
        if paused:
            control.resume_debugged(self.client, [self.ranks[r].engine_id for r in paused])
        self.signal(signal.SIGINT, busy)
        run.wait(until=time.monotonic() + grace, poll=0.02)
        # A SIGINT that lands while debugpy is still letting a paused rank go is swallowed
        # by it, and on a busy machine that takes a while: again, until it reaches the cell.
        until = time.monotonic() + RESUMED_SECONDS
        again = [r for r in run.busy_ranks if r in paused]
        while again and time.monotonic() < until:
            self.signal(signal.SIGINT, again)
            run.wait(until=time.monotonic() + grace, poll=0.02)
            again = [r for r in run.busy_ranks if r in paused]
        left = [r for r in run.busy_ranks if r in busy]
        self.gen.unfinished = run if left else None
        return left

    def late_outputs(self) -> list[tuple[int, Output]]:
        """What ranks printed after their cell had ended (a thread, a callback) since the
        last cell, in order and kept short as a cell's output is (--max-output): for the
        notebook to show. Every line of it is in the ranks' logs already."""
        self.collect_late()
        late, self._late = self._late, []
        by_rank: dict[int, RankCell] = {}
        order = []
        for rank, out in late:
            if rank not in by_rank:
                by_rank[rank] = RankCell(rank, max_lines=self.settings.max_output)
                order.append(rank)
            by_rank[rank].add(out)
        shown = []
        for rank in order:
            by_rank[rank].finish()
            shown += [(rank, out) for out in by_rank[rank].outputs]
        return shown

    def collect_late(self) -> None:
        """Take what the client kept of the ranks' late outputs: streams into the logs now
        (a death report points there), everything kept for the next cell to show."""
        with self._life:
            self._collect_late()

    def _collect_late(self) -> None:
        client = self.client
        late = getattr(client, "late", None)
        if not late:
            return
        while True:
            try:
                engine_id, kind, content = late.popleft()
            except IndexError:
                break
            rank, out = self._engine_rank.get(engine_id), output_from_message(kind, content)
            if rank is None or out is None:
                continue
            if out.kind in ("stdout", "stderr"):
                self.logs.write(rank, out.text)
            self._late.append((rank, out))
        dropped, client.late_dropped = client.late_dropped, 0
        if dropped:
            self._late.append((0, Output("stderr", f"... {dropped:,} outputs printed after "
                                         "their cell ended were too many to keep ...\n")))
        self.logs.flush()

    def stacks(self, ranks: list[int]) -> dict[int, where.Stack | None]:
        """The main-thread Python stack of each rank (None: it did not answer)."""
        if not ranks or self.client is None:
            return {}
        # Local ranks answer a signal from C (even while holding the GIL); the others
        # answer on their control channel.
        local = {
            r: (
                self.gen.launchers[r].process,
                self.gen.launchers[r].stack_file,
                self.ranks[r].main_thread,
            )
            for r in ranks
            if r in self.gen.launchers
        }
        found = where.dump(local) if local else {}
        far = [r for r in ranks if r not in self.gen.launchers]
        if far:
            by_engine = control.stacks(self.client, [self.ranks[r].engine_id for r in far])
            for r in far:
                frames = by_engine.get(self.ranks[r].engine_id)
                found[r] = None if frames is None else [where.Frame(*f) for f in frames]
        return {r: None if frames is None else self._stack(r, frames) for r, frames in found.items()}

    def interrupt(self) -> tuple[list[int], list[int]]:
        """SIGINT to the ranks still running a cell: (the ones sent it, the ones still busy)."""
        with self._life:
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
        with self._life:
            gen = self.gen
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
    def signal(self, signum: int = signal.SIGINT, ranks: list[int] | None = None) -> None:
        """Send a signal to the processes of some ranks (default: all)."""
        if self.cluster is None:
            return
        chosen = [r.rank for r in self.ranks] if ranks is None else ranks
        self.cluster.signal_ranks([r for r in chosen if r in self.gen.launchers], signum)
        far = [self.ranks[r].engine_id for r in chosen if r not in self.gen.launchers]
        if far and self.client is not None:
            control.signal(self.client, far, signum)

