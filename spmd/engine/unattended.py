"""A rank whose notebook process died while its cluster lingers (orphans.Linger): what it
prints from then on, and how each cell it finishes ends, go to its own log, where a notebook
that attaches reads them (spmd/magics/away.py). Nothing here runs while a notebook holds the
cluster.

Threads: the parent watch thread calls ``notebook_gone`` when it finds the notebook gone and
``notebook_back`` when one attached; the kernel's main thread calls ``cell_ended`` at each
cell's reply. Both write whole lines to the process's own output (its
log file) with one ``os.write`` each.
"""

from __future__ import annotations

import os
import sys
import time

# The line a rank writes to its log when its notebook is gone (its output follows), and the
# start of the line it writes when a cell ends meanwhile.
GONE_LINE = "--- the notebook process ended at "
CELL_ENDED = "--- the cell ended: "

_gone = False


def notebook_gone() -> None:
    """(the watch thread) From now on what the rank prints goes to its log too."""
    global _gone
    _gone = True
    stamp = time.strftime("%H:%M:%S")
    os.write(1, f"{GONE_LINE}{stamp}; the rank's output follows ---\n".encode())
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "echo") and getattr(stream, "echo", None) is None:
            stream.echo = sys.__stdout__  # (the process's own output: its log file)


def notebook_back() -> None:
    """(the watch thread) A notebook holds the cluster again (an attach): output goes to it
    alone, as before."""
    global _gone
    _gone = False
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "echo", None) is sys.__stdout__:
            stream.echo = None


def cell_ended(code: str, reply: dict) -> None:
    """(the main thread, at a cell's reply) With no notebook: how the cell ended, in a line
    of the log: ``--- the cell ended: ok | FIRST LINE`` or ``... ValueError: why | ...``."""
    if not _gone:
        return
    first = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")[:80]
    how = "ok" if reply.get("status") == "ok" else (
        f"{reply.get('ename', 'error')}: {reply.get('evalue', '')}"[:200].replace("|", "/"))
    for stream in (sys.stdout, sys.stderr):  # (what it printed first, then the line)
        try:
            stream.flush()
        except Exception:
            pass
    os.write(1, f"{CELL_ENDED}{how} | {first}\n".encode())
