"""The ranks of one start or restart, their process handles, and what became of them.

The face (session.py) holds one Generation and replaces it whole, in one assignment, at
start, restart and stop, under its lock; readers on other threads see one generation or the
next, never a mix (session.py says who may touch what inside one).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from spmd.cluster.records import Rank

if TYPE_CHECKING:
    from spmd.cluster.adopted import Adopted
    from spmd.cluster.lockstep.run import CellRun
    from spmd.cluster.records import Death


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
