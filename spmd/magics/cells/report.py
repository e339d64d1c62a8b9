"""A stopped cell's report, in the words a student reads: a death's and a stall's (why the
wait for a cell ended early: a death, a divergence, a timeout, an interrupt), the sections
that say where the busy ranks were, and the live view's lines on the ranks a long cell waits
for.

The cluster keeps what it found as data (spmd/cluster/records.py: ``Death``,
``Stall``); this module says it. A rank that is only later than the others is no fault: the
live view says who the cell waits for (``straggler_lines``). The census does not see jax's own
programs, so a divergence found by the ranks' stacks (``Stall.inside``) says that this is what
is known. The census's own words are census_report.py's.

Main thread only: the cell's steps (cell.py), the live view (render.py) and ``%spmd where``
(commands/inspection.py) call it.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterable

from spmd.cluster.records import DIED, DIVERGED, INSIDE_PATIENCE, TIMEOUT, Death, Stall
from spmd.cluster.session import Stack
from spmd.words import rank_label, rank_words, with_hint

RESTART = "%spmd restart"

# What launches collectives the census does not see, by library (the report's words).
_UNSEEN = {
    "torch": "torch's operations on DTensors over several processes are collectives too",
}
_UNSEEN_JAX = ("jax's own operations on arrays over several processes, such as printing one, "
               "x[::-1] or jnp.dot outside a jit, are collectives too")


# -- a death ----------------------------------------------------------------------------------


def how_and_why(death: Death) -> str:
    """``death.how``, with what usually sends that signal."""
    return with_hint(death.how)


def elsewhere(death: Death) -> str:
    """' on node2' for a rank on another host ('' on this one)."""
    return f" on {death.host}" if death.host and death.host != socket.gethostname() else ""


def describe(death: Death, headline: bool = True) -> list[str]:
    """Where it crashed, if it did, and its last lines; ``headline`` adds who and how."""
    on = elsewhere(death)
    lines = [f"Rank {death.rank} (pid {death.pid}{on}) died: {how_and_why(death)}."] if headline else []
    if death.crash is not None and death.crash.frames:
        lines.append(f"Rank {death.rank} crashed {death.crash.at_cell_line}".rstrip())
        lines.extend(death.crash.lines())
    if death.last_lines:
        lines.append(f"The last lines rank {death.rank} wrote (its stdout and stderr):")
        lines.extend(f"    {ln}" for ln in death.last_lines)
    else:
        lines.append(f"Rank {death.rank} wrote nothing to its stdout or stderr before it died.")
    if death.log:
        lines.append(
            f"Every line its cells printed: %spmd log {death.rank} ({death.log}, kept until "
            "the next %spmd start)."
        )
    return lines


# -- a stall ----------------------------------------------------------------------------------


def title(stall: Stall) -> str:
    """The report's exception in one line (its ``str()``, the ``evalue`` that front ends
    such as nbclient's errors and VS Code's show beside the report): other words than
    the report's first sentence, which would otherwise be read twice in a row."""
    if stall.reason == DIED:
        return f"The cell stopped: {rank_words([d.rank for d in stall.deaths])} died."
    if stall.reason == DIVERGED:
        return "The cell stopped: the ranks diverged."
    if stall.reason == TIMEOUT:
        return f"The cell stopped: it ran past its timeout of {stall.seconds:g} s."
    return "The cell stopped: interrupted."


def summary(stall: Stall) -> list[str]:
    """The headline, the likely cause and the next step."""
    lines = [_headline(stall)]
    if stall.in_debugger:
        were = "was" if len(stall.in_debugger) == 1 else "were"
        lines.append(f"{rank_words(stall.in_debugger).capitalize()} {were} paused in the "
                     "debugger: the interrupt let them go on, then stopped them.")
    if stall.unresponsive:
        lines.append(
            f"{rank_words(stall.unresponsive).capitalize()} did not respond to the interrupt "
            "(still inside C code); a restart ends them."
        )
    if stall.inside:
        ranks = sorted(stall.inside)
        lines.append(
            f"If {rank_words(ranks)} {'was' if len(ranks) == 1 else 'were'} only computing "
            "(on its own data, not waiting for the others), allow more time with %%spmd "
            "--grace S: a rank that stays in one call of jax or torch is reported "
            f"{INSIDE_PATIENCE:g} s after the grace."
        )
    if stall.reason == DIED:
        lines.append(f"The other ranks were stopped. Next: {RESTART} starts a fresh cluster.")
    else:
        lines.append(
            f"Next: {RESTART}. Until then cells are refused: the ranks are out of step, "
            "and the next collective would hang."
        )
    return lines


def _in_collective(stall: Stall) -> list[int]:
    return [r for r in stall.busy if (s := stall.stacks.get(r)) and s.waiting_in]


def _headline(stall: Stall) -> str:
    busy, waiting = stall.busy, _in_collective(stall)
    finished, raised = stall.finished, stall.raised
    if stall.reason == DIED:
        first = stall.deaths[0]
        text = f"Rank {first.rank}{elsewhere(first)} died: {how_and_why(first)}."
        later = [d.rank for d in stall.deaths[1:]]
        if later:
            aborted = all(d.exit_code == -signal.SIGABRT for d in stall.deaths[1:])
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
    if stall.reason == DIVERGED and stall.inside:
        return _inside_headline(stall)
    if stall.reason == DIVERGED:
        waiting = [r for r in waiting if r in (stall.ahead or busy)]
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
        ahead = stall.ahead or busy
        return (
            f"The ranks diverged: {rank_words(ahead)} launched cross-process programs that "
            f"{rank_words(finished)} never launched, and {_be(ahead)} still running "
            f"{_seconds(stall.seconds)} after {'it' if len(finished) == 1 else 'they'} "
            "finished: the ranks cannot meet again (a different branch, loop count or "
            "input shape)."
        )
    if stall.reason == TIMEOUT:
        text = (
            f"Timed out after {stall.seconds:g} s: {rank_words(busy)} {_be(busy)} still running"
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


def _inside_headline(stall: Stall) -> str:
    """A divergence told by the ranks' stacks, not the census: what is known."""
    finished = stall.finished
    groups: dict[tuple, list[int]] = {}
    for rank, (stack, seconds) in sorted(stall.inside.items()):
        groups.setdefault((*_inside_words(stack), _seconds(seconds)), []).append(rank)
    said = "; ".join(
        f"{rank_words(ranks)} {'has' if len(ranks) == 1 else 'have'} been inside {library} "
        f"({where}) for {seconds}"
        for (library, where, seconds), ranks in groups.items())
    unseen = "; ".join(_UNSEEN.get(lib, _UNSEEN_JAX) for lib in sorted({g[0] for g in groups}))
    them = rank_words(finished)
    return (
        f"The ranks diverged: {said}, and {them} finished the cell "
        f"{_seconds(stall.seconds)} ago: most likely "
        f"{'it is' if len(stall.inside) == 1 else 'they are'} waiting in a cross-process "
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


# -- where the busy ranks are -----------------------------------------------------------------


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


# -- the live view: who a long cell waits for, and where --------------------------------------


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
