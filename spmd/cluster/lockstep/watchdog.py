"""Why a cell stopped before every rank finished, said in plain words.

In SPMD the classic failure is silent: one rank raises, or takes another branch, while the
others wait in a collective forever. The session's wait loop notices four things (a rank that
died, ranks still busy a grace period after another finished that launched what it never did,
a timeout, the user's interrupt); this module holds what it found and turns it into the report
a student reads. A rank that is only later than the others is no fault: the live view says
who the cell waits for (``straggler_lines``). The census does not see jax's own programs (an
eager operation on an array over several processes), so a straggler that stays inside one call
of jax or torch for ``INSIDE_PATIENCE`` seconds past the grace is taken for diverged too, and
the report says that this is what is known.
"""

from __future__ import annotations

import re
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from spmd.cluster.launchers.processes import how_it_ended
from spmd.cluster.lockstep.outputs import RankCell, drop_chatter
from spmd.cluster.lockstep.where import Stack
from spmd.words import rank_label, rank_words, with_hint

DIED, DIVERGED, TIMEOUT, INTERRUPTED = "died", "diverged", "timeout", "interrupted"
RESTART = "%spmd restart"

# How long past the grace every busy rank may stay inside one call of jax or torch (the same
# stack at every look, not compiling) before it is taken for waiting in a cross-process
# operation that a finished rank did not make: the census does not see jax's own programs.
INSIDE_PATIENCE = 3.0

# What launches collectives the census does not see, by library (the report's words).
_UNSEEN = {
    "torch": "torch's operations on DTensors over several processes are collectives too",
}
_UNSEEN_JAX = ("jax's own operations on arrays over several processes, such as printing one, "
               "x[::-1] or jnp.dot outside a jit, are collectives too")


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
    # DIVERGED: the busy ranks that launched what a finished rank never did (the others were
    # only behind, and are interrupted with them)
    ahead: list[int] = field(default_factory=list)
    # DIVERGED with no census evidence: the busy ranks that stayed inside one call of jax or
    # torch past the patience, rank -> (its stack then, seconds seen in that call)
    inside: dict[int, tuple[Stack, float]] = field(default_factory=dict)

    @classmethod
    def at(cls, reason: str, seconds: float | None, cells: dict[int, RankCell], **kw) -> Stall:
        """A Stall for ``cells`` as they are now: call it before interrupting anyone."""
        dead = {d.rank for d in kw.get("deaths", [])}
        finished = sorted(r for r, c in cells.items() if c.done and r not in dead)
        raised = [r for r in finished if cells[r].error is not None]
        busy = sorted(r for r, c in cells.items() if not c.done and r not in dead)
        return cls(reason, seconds, busy, {}, finished, raised, **kw)

    def title(self) -> str:
        """The report's exception in one line (its ``str()``, the ``evalue`` that front ends
        such as nbclient's errors and VS Code's show beside the report): other words than
        the report's first sentence, which would otherwise be read twice in a row."""
        if self.reason == DIED:
            return f"The cell stopped: {rank_words([d.rank for d in self.deaths])} died."
        if self.reason == DIVERGED:
            return "The cell stopped: the ranks diverged."
        if self.reason == TIMEOUT:
            return f"The cell stopped: it ran past its timeout of {self.seconds:g} s."
        return "The cell stopped: interrupted."

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
        if self.inside:
            ranks = sorted(self.inside)
            lines.append(
                f"If {rank_words(ranks)} {'was' if len(ranks) == 1 else 'were'} only computing "
                "(on its own data, not waiting for the others), allow more time with %%spmd "
                "--grace S: a rank that stays in one call of jax or torch is reported "
                f"{INSIDE_PATIENCE:g} s after the grace."
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
        if self.reason == DIVERGED and self.inside:
            return self._inside_headline(finished)
        if self.reason == DIVERGED:
            waiting = [r for r in waiting if r in (self.ahead or busy)]
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
            ahead = self.ahead or busy
            return (
                f"The ranks diverged: {rank_words(ahead)} launched cross-process programs that "
                f"{rank_words(finished)} never launched, and {_be(ahead)} still running "
                f"{_seconds(self.seconds)} after {'it' if len(finished) == 1 else 'they'} "
                "finished: the ranks cannot meet again (a different branch, loop count or "
                "input shape)."
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


    def _inside_headline(self, finished: list[int]) -> str:
        """A divergence told by the ranks' stacks, not the census: what is known."""
        groups: dict[tuple, list[int]] = {}
        for rank, (stack, seconds) in sorted(self.inside.items()):
            groups.setdefault((*_inside_words(stack), _seconds(seconds)), []).append(rank)
        said = "; ".join(
            f"{rank_words(ranks)} {'has' if len(ranks) == 1 else 'have'} been inside {library} "
            f"({where}) for {seconds}"
            for (library, where, seconds), ranks in groups.items())
        unseen = "; ".join(_UNSEEN.get(lib, _UNSEEN_JAX) for lib in sorted({g[0] for g in groups}))
        them = rank_words(finished)
        return (
            f"The ranks diverged: {said}, and {them} finished the cell "
            f"{_seconds(self.seconds)} ago: most likely "
            f"{'it is' if len(self.inside) == 1 else 'they are'} waiting in a cross-process "
            f"operation that {them} did not make ({unseen}, and the census of launches does "
            "not see them)."
        )


def _inside_words(stack: Stack) -> tuple[str, str]:
    """('jax', 'at cell line 2: print(x); now in _value, jax/_src/array.py line 623')."""
    inside = stack.inside
    library = "jax" if inside.library == "jaxlib" else inside.library
    return library, f"{stack.at_cell_line or 'outside the cell code'}; in {inside.where}"


def _seconds(seconds: float | None) -> str:
    """'2 s', '0.5 s'."""
    seconds = seconds or 0.0
    return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"


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


def straggler_lines(stragglers: list[int], finished: list[int], seconds: float,
                    inside: dict[int, Stack]) -> list[str]:
    """What the live view says of the stragglers: the ranks in plain Python are slower
    (``straggler_line``); of those inside a call of jax or torch (``inside``: their stacks at
    the watchdog's last look), one that builds a program is working, and another may be
    waiting in a collective the census does not see."""
    plain = [r for r in stragglers if r not in inside]
    lines = [straggler_line(plain, finished, seconds)] if plain else []
    groups: dict[tuple, list[int]] = {}
    for rank in stragglers:
        if rank in inside:
            stack = inside[rank]
            groups.setdefault((stack.inside.building, *_inside_words(stack)), []).append(rank)
    them = rank_words(finished)
    for (building, library, where), ranks in groups.items():
        head = (f"Waiting for {rank_words(ranks)}: still running {_seconds(seconds)} after "
                f"{them} finished")
        if building:
            lines.append(f"{head}, tracing or compiling a {library} program ({where}): "
                         "working, not waiting.")
        else:
            lines.append(
                f"{head}, inside {library} ({where}): it may be waiting in a collective that "
                f"{them} did not make; it is reported as diverged if it stays in that call."
            )
    return lines


def straggler_line(stragglers: list[int], finished: list[int], seconds: float) -> str:
    """What the live view says of ranks still busy past the grace that launched nothing the
    finished ranks did not: they are slower, not diverged, and the cell waits for them."""
    return (
        f"Waiting for {rank_words(stragglers)}: still running {_seconds(seconds)} after "
        f"{rank_words(finished)} finished, and behind {'it' if len(finished) == 1 else 'them'} "
        f"(no cross-process launch that {rank_words(finished)} did not make): slower, not "
        "diverged."
    )


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
            inside = stack.inside
            if inside is not None and inside.building:
                where += f"   (compiling in {inside.library})"
            elif stack.waiting_in:
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
