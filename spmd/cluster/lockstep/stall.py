"""Why a cell stopped before every rank finished, as the cell runner found it: the record of
a rank that died (``Death``) and of the wait that ended early (``Stall``).

In SPMD the classic failure is silent: one rank raises, or takes another branch, while the
others wait in a collective forever. The cell runner's wait (cells.py) notices four things (a
rank that died, ranks still busy a grace period after another finished that launched what it
never did, a timeout, the user's interrupt) and keeps what it found here, as data: the magics
say it in words (spmd/magics/cells/report.py). The census does not see jax's own programs (an
eager operation on an array over several processes), so a straggler that stays inside one call
of jax or torch for ``INSIDE_PATIENCE`` seconds past the grace is taken for diverged too.

Made on the notebook's main thread, by the cell runner and the death watch (deaths.py; the
start-up reads a rank's ``last_lines`` too); read there by the magics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from spmd.cluster.launchers.processes import how_it_ended
from spmd.cluster.lockstep.census import Reading
from spmd.cluster.lockstep.run import RankCell, drop_chatter
from spmd.cluster.lockstep.where import Stack

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
    # What the living ranks' census said of the cell's launches, read before any interrupt or
    # a death's end takes their records with them (None: not read)
    census: Reading | None = None
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
