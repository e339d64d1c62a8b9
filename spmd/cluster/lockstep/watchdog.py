"""Why a cell stopped before every rank finished, said in plain words.

In SPMD the classic failure is silent: one rank raises, or takes another branch, while the
others wait in a collective forever. The session's wait loop notices four things (a rank that
died, ranks still busy a grace period after another finished, a timeout, the user's
interrupt); this module holds what it found and turns it into the report a student reads.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from spmd.cluster.launchers.processes import how_it_ended
from spmd.cluster.lockstep.outputs import RankCell, drop_chatter
from spmd.cluster.lockstep.run import rank_label, rank_words
from spmd.cluster.lockstep.where import Stack

DIED, DIVERGED, TIMEOUT, INTERRUPTED = "died", "diverged", "timeout", "interrupted"
RESTART = "%spmd restart"


@dataclass
class Death:
    """One rank's process ended on its own (not stopped by the notebook)."""

    rank: int
    pid: int
    exit_code: int | None
    at: float  # time.monotonic()
    last_lines: list[str] = field(default_factory=list)
    crash: Stack | None = None  # where it was, if it crashed with a Python stack to show
    host: str = ""
    cause: str = ""  # what is known where the exit code is not (a rank on another host)
    log: str = ""  # the file with every line it printed in its cells ('' if none)

    @property
    def how(self) -> str:
        """'killed by SIGKILL', 'exit code 1'."""
        if self.exit_code is None:
            return self.cause or "it exited"
        return how_it_ended(self.exit_code)

    @property
    def how_and_why(self) -> str:
        """``how``, with what usually sends that signal."""
        return with_hint(self.how)

    @property
    def elsewhere(self) -> str:
        """' on node2' for a rank on another host ('' on this one)."""
        return f" on {self.host}" if self.host and self.host != socket.gethostname() else ""

    def describe(self, headline: bool = True) -> list[str]:
        """Where it crashed, if it did, and its last lines; ``headline`` adds who and how."""
        on = self.elsewhere
        lines = [f"Rank {self.rank} (pid {self.pid}{on}) died: {self.how_and_why}."] if headline else []
        if self.crash is not None and self.crash.frames:
            lines.append(f"Rank {self.rank} crashed {self.crash.at_cell_line}".rstrip())
            lines.extend(self.crash.lines())
        if self.last_lines:
            lines.append(f"The last lines rank {self.rank} wrote (its stdout and stderr):")
            lines.extend(f"    {ln}" for ln in self.last_lines)
        else:
            lines.append(f"Rank {self.rank} wrote nothing to its stdout or stderr before it died.")
        if self.log:
            lines.append(
                f"Every line its cells printed: %spmd log {self.rank} ({self.log}, kept until "
                "the next %spmd start)."
            )
        return lines


def with_hint(how: str) -> str:
    """``how``, with what usually sends that signal."""
    return how + _SIGNAL_HINTS.get(how.removeprefix("killed by "), "")


_SIGNAL_HINTS = {
    "SIGKILL": " (sent by hand, or by the out-of-memory killer)",
    "SIGSEGV": " (a crash in C code)",
    "SIGABRT": " (it aborted: jax, XLA and torch's gloo do this on a fatal error, or when another "
                "rank died)",
    "SIGBUS": " (a crash in C code)",
}


# ipyparallel's own log lines in the engine's log file ("2026-11-22 00:11:36.959 [IPEngine]
# WARNING | ..."): start-up notices, not what the process said when it died.
_IPP_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[IPEngine")


def last_lines(output: str, count: int = 8, width: int = 400) -> list[str]:
    """The end of what an engine wrote to its stdout and stderr (jax's fatal messages, a
    crash's Python stack), without gloo's chatter and ipyparallel's own log lines."""
    text = drop_chatter(output[-50000:])
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not _IPP_LOG.match(ln)]
    return [ln if len(ln) <= width else ln[: width - 3] + "..." for ln in lines[-count:]]


@dataclass
class Stall:
    """The notebook stopped waiting for a cell before every rank finished."""

    reason: str  # DIED | DIVERGED | TIMEOUT | INTERRUPTED
    seconds: float | None  # the grace or the timeout that ran out
    busy: list[int]  # ranks still running when the wait ended
    stacks: dict[int, Stack | None]  # where each busy rank was, before any interrupt
    finished: list[int] = field(default_factory=list)  # ranks done when the wait ended
    raised: list[int] = field(default_factory=list)  # those of them that raised
    unresponsive: list[int] = field(default_factory=list)  # busy after SIGINT and a grace
    deaths: list[Death] = field(default_factory=list)  # first to die first
    in_debugger: list[int] = field(default_factory=list)  # busy ranks paused in the debugger
    census: list[str] = field(default_factory=list)  # where the ranks' launches parted (census.py)

    @classmethod
    def at(cls, reason: str, seconds: float | None, cells: dict[int, RankCell], **kw) -> Stall:
        """A Stall for ``cells`` as they are now: call it before interrupting anyone."""
        dead = {d.rank for d in kw.get("deaths", [])}
        finished = sorted(r for r, c in cells.items() if c.done and r not in dead)
        raised = [r for r in finished if cells[r].error is not None]
        busy = sorted(r for r, c in cells.items() if not c.done and r not in dead)
        return cls(reason, seconds, busy, {}, finished, raised, **kw)

    def summary(self) -> list[str]:
        """The headline, the likely cause and the next step."""
        lines = [self._headline(self.finished, self.raised)]
        if self.in_debugger:
            were = "was" if len(self.in_debugger) == 1 else "were"
            lines.append(f"{rank_words(self.in_debugger).capitalize()} {were} paused in the "
                         "debugger: the interrupt let them go on, then stopped them.")
        if self.unresponsive:
            lines.append(
                f"{rank_words(self.unresponsive).capitalize()} did not respond to the interrupt "
                "(still inside C code); a restart ends them."
            )
        if self.reason == DIED:
            lines.append(f"The other ranks were stopped. Next: {RESTART} starts a fresh cluster.")
        else:
            lines.append(
                f"Next: {RESTART}. Until then cells are refused: the ranks are out of step, "
                "and the next collective would hang."
            )
        return lines

    def _in_collective(self) -> list[int]:
        return [r for r in self.busy if (s := self.stacks.get(r)) and s.waiting_in]

    def _headline(self, finished: list[int], raised: list[int]) -> str:
        busy, waiting = self.busy, self._in_collective()
        if self.reason == DIED:
            first = self.deaths[0]
            text = f"Rank {first.rank}{first.elsewhere} died: {first.how_and_why}."
            later = [d.rank for d in self.deaths[1:]]
            if later:
                aborted = all(d.exit_code == -signal.SIGABRT for d in self.deaths[1:])
                text += f" Then {rank_words(later)} " + (
                    "aborted (jax ends every process of the job when one dies)."
                    if aborted
                    else "exited too."
                )
            if raised:
                text += (
                    f" {rank_words(raised).capitalize()} then raised an error, below (a "
                    "collective that lost it, as gloo does)."
                )
            if waiting:
                text += f" {rank_words(waiting).capitalize()} {_be(waiting)} waiting in a collective for it."
            return text
        if self.reason == DIVERGED:
            grace = f"{self.seconds:g} s"
            if waiting:
                why = (
                    f"{rank_words(raised)} raised an error first"
                    if raised
                    else f"{rank_words(finished)} finished the cell without it (a different "
                    "branch, loop count or input shape)"
                )
                return (
                    f"The ranks diverged: {rank_words(waiting)} {_be(waiting)} waiting in a "
                    f"collective that {rank_words(finished)} never reached: {why}."
                )
            return (
                f"The ranks diverged: {rank_words(busy)} {_be(busy)} still running {grace} after "
                f"{rank_words(finished)} finished; the ranks took different paths through the "
                "cell, or some have more work (allow more with %%spmd --grace S)."
            )
        if self.reason == TIMEOUT:
            text = (
                f"Timed out after {self.seconds:g} s: {rank_words(busy)} {_be(busy)} still running"
            )
        else:
            text = f"Interrupted: {rank_words(busy)} {_be(busy)} running"
        if finished:
            text += f" while {rank_words(finished)} had finished"
        if waiting and waiting == busy:
            text += (
                "; all of them inside a collective or a jax computation (a collective that "
                "cannot complete, such as different shapes on different ranks, or slow work)"
            )
        elif waiting:
            others = [r for r in busy if r not in waiting]
            text += (
                f"; {rank_words(waiting)} {_be(waiting)} waiting in a collective for "
                f"{rank_words(others)}, still in {'its' if len(others) == 1 else 'their'} own code"
            )
        return text + "."


def _be(ranks: list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def group_stacks(
    ranks: list[int], stacks: dict[int, Stack | None]
) -> list[tuple[list[int], Stack | None]]:
    """Ranks with identical stacks together, lowest rank first."""
    groups: dict[object, tuple[list[int], Stack | None]] = {}
    for rank in ranks:
        stack = stacks.get(rank)
        # by what is shown: cell files are named after each rank's pid, so frames differ
        key = None if stack is None else tuple(stack.lines())
        groups.setdefault(key, ([], stack))[0].append(rank)
    return list(groups.values())


def stack_section(ranks: list[int], stacks: dict[int, Stack | None],
                  paused: Iterable[int] = ()) -> list[str]:
    """Where each of ``ranks`` was, grouped; a line for ranks that did not answer
    (``paused``: ranks that were paused in JupyterLab's debugger)."""
    lines: list[str] = []
    paused = set(paused)
    groups = group_stacks(ranks, stacks)
    # Ranks outside the cell's code (ipykernel or IPython: the cell not begun yet, or just
    # ended) stop at as many places as there are steps there: with many ranks, a section
    # each would bury the cell's own. They are one section when they are at several.
    is_outside = [s is not None and bool(s.frames) and not s.at_cell_line for _, s in groups]
    merged: list[int] = []
    if sum(is_outside) > 1:
        outside = [pair for pair, out in zip(groups, is_outside) if out]
        merged = sorted(r for g, _ in outside for r in g)
        groups = [pair for pair, out in zip(groups, is_outside) if not out]
        groups.append((merged, outside[0][1]))
    for group, stack in sorted(groups, key=lambda pair: min(pair[0])):
        lines.append("")
        if group is merged:
            lines.append(f"{rank_label(group)} were outside the cell's code, in ipykernel or "
                         f"IPython (the cell not begun yet, or just ended), at "
                         f"{sum(is_outside)} places; the first of them:")
            lines.extend(stack.lines())
            continue
        if stack is None or not stack.frames:
            lines.append(f"{rank_label(group)} did not say where it was (no stack dump).")
            continue
        doing = "was paused in the debugger" if paused.issuperset(group) else "was running"
        lines.append(f"{rank_label(group)} {doing} {stack.at_cell_line}".rstrip())
        lines.extend(stack.lines())
    return lines


def progress_lines(stacks: dict[int, Stack | None], seconds: float,
                   paused: Iterable[int] = ()) -> list[str]:
    """Where the busy ranks of a long cell are, a line per group of ranks on the same line
    (``paused``: ranks paused in JupyterLab's debugger)."""
    groups: dict[str, list[int]] = {}
    paused = set(paused)
    for rank, stack in sorted(stacks.items()):
        if rank in paused:
            where = "paused in the debugger"
            if stack is not None and stack.at_cell_line:
                where += f" {stack.at_cell_line}"
        elif stack is None:
            where = "(no stack)"
        else:
            where = stack.at_cell_line or "outside the cell's code"
            if stack.waiting_in:
                where += f"   (waiting inside {stack.waiting_in})"
        groups.setdefault(where, []).append(rank)
    lines = [f"Paused in the debugger after {seconds:.0f} s:" if paused >= set(stacks)
             else f"Still running after {seconds:.0f} s:"]
    lines += [f"  {rank_words(ranks)} {where}" for where, ranks in groups.items()]
    if len(groups) > 1:
        lines.append(
            "  The ranks are on different lines: if they stay there, they are waiting for "
            "each other."
        )
    lines.append("Kernel > Interrupt stops the cell with a report of where every rank is.")
    return lines
