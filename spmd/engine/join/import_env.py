"""On a rank: a cell that changes a variable jax or XLA reads once, at import.

``%env JAX_ENABLE_X64=1`` in auto mode runs on the ranks, and changes nothing there: jax read
its ``JAX_*`` variables (and XLA its ``XLA_FLAGS``) when the rank imported it. A cell that
changes one is told so once, by every rank alike (one grouped line), and the rank's reply
carries its changes (``wire.ENV_CHANGED``: every such variable changed since the rank started,
its value, or None where it was removed); the notebook keeps them for the ranks its next
``%spmd restart`` starts (restarts.py), which is when jax reads them.

The rank's kernel (engine/rank_kernel.py) makes the watch once the rank has joined and asks it for
each reply's metadata.

Threads: the main thread only (IPython's ``post_run_cell`` and the reply's metadata are the
cell's, both on the main thread).
"""

from __future__ import annotations

import os
import sys

from spmd import wire

PREFIXES = ("JAX_", "XLA_")


_PREFIXES_BYTES = tuple(p.encode() for p in PREFIXES)


def read_at_import() -> dict[str, str]:
    """This process's variables that jax and XLA read once, at import (``JAX_ENABLE_X64``,
    ``XLA_FLAGS``...): a rank forked by a server that imported jax before they changed
    computes as before (the notebook compares its own with its server's at a restart)."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}


def _fingerprint():
    """What changes when one of them does, read fast: it runs after every cell (os.environ's
    own bytes, 3 us here, where decoding every variable took 27 us)."""
    raw = getattr(os.environ, "_data", None)  # (CPython's; elsewhere the slow way)
    if raw is None:
        return read_at_import()
    return [(k, v) for k, v in raw.items() if k.startswith(_PREFIXES_BYTES)]


class ImportEnv:
    def __init__(self) -> None:
        self.started = read_at_import()  # as the rank began
        self.last = dict(self.started)  # as the last cell left them
        self.unsent = False  # a change the next reply carries
        self.seen = _fingerprint()

    def after_cell(self, result=None) -> None:
        seen = _fingerprint()
        if seen == self.seen:
            return
        self.seen = seen
        now = read_at_import()
        if now == self.last:
            return
        changed = sorted(k for k in now.keys() | self.last.keys() if now.get(k) != self.last.get(k))
        self.last, self.unsent = now, True
        if "jax" in sys.modules:  # (before jax is imported, the variable works now)
            names = ", ".join(changed)
            verb = "changes" if len(changed) == 1 else "change"
            print(f"{names} {verb} nothing in ranks that imported jax already (jax and XLA "
                  "read them once, at import): %spmd restart starts the ranks with them.",
                  file=sys.stderr)

    def changes(self) -> dict[str, str | None]:
        """Every variable changed since the rank started: its value (None: removed)."""
        return {k: self.last.get(k) for k in self.last.keys() | self.started.keys()
                if self.last.get(k) != self.started.get(k)}

    def into(self, metadata: dict) -> None:
        """A reply's metadata: the changes, if the last reply did not carry them."""
        if self.unsent:
            metadata[wire.ENV_CHANGED] = self.changes()
            self.unsent = False


def watch(shell) -> ImportEnv:
    """A watch over this rank's cells, from now (from the rank's main thread, once joined)."""
    watching = ImportEnv()
    shell.events.register("post_run_cell", watching.after_cell)
    return watching
