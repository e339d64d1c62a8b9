"""A rank whose notebook process died while its cluster lingers (orphans.Linger): what it
prints from then on, and how each cell it finishes ends, go to its own log, where a notebook
that attaches reads them (spmd/magics/start/away.py). Nothing here runs while a notebook holds the
cluster, except for the cell that was running when the notebook died and still runs at the
attach: its output is copied on until it ends, and its end written too, so that what it printed
while the new notebook connected is not lost (that notebook hears the rest of it as well:
channel/client.py's ``adopt``).

The copy is the text as a person reads it: the marks around a printed array's placeholder
(``wire.PRINTED_BEGIN``, ``wire.PRINTED_MARK``, engine/arrays/print_marks.py) are for the notebook's
cell only, and are left out of the log.

Threads: the parent watch thread calls ``notebook_gone`` when it finds the notebook gone and
``notebook_back`` when one attached; the kernel's main thread calls ``cell_began`` and
``cell_ended`` at each cell's request and reply. The state below is under ``_lock``; each
writes whole lines to the process's own output (its log file) with one ``os.write``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

from spmd import wire

# The line a rank writes to its log when its notebook is gone (its output follows; then the
# time in UTC, as ``GONE_STAMP``, read back on the notebook's machine whatever either's zone),
# and the start of the line it writes when a cell ends meanwhile.
GONE_LINE = "--- the notebook process ended at "
GONE_STAMP = "%Y-%m-%d %H:%M:%S UTC"
CELL_ENDED = "--- the cell ended: "

_lock = threading.Lock()
_gone = False  # no notebook holds the cluster
_copying = False  # output goes to the log too (see the opening comment)
_running = False  # a cell runs (its request began, its reply is not made)

_MARKS = re.compile(re.escape(wire.PRINTED_BEGIN) + "|" + re.escape(wire.PRINTED_MARK).replace(
    re.escape("{}"), "[^\x00]*"))


class _PlainLog:
    """The process's own output (its log file), without the printed arrays' marks."""

    def write(self, text: str) -> int:
        return sys.__stdout__.write(_MARKS.sub("", text) if "\x00" in text else text)

    def flush(self) -> None:
        sys.__stdout__.flush()


def _copy(on: bool) -> None:
    for stream in (sys.stdout, sys.stderr):
        if not hasattr(stream, "echo"):
            continue
        if on and stream.echo is None:
            stream.echo = _PlainLog()
        elif not on and isinstance(stream.echo, _PlainLog):
            stream.echo = None


def notebook_gone() -> None:
    """(the watch thread) From now on what the rank prints goes to its log too."""
    global _gone, _copying
    with _lock:
        _gone = _copying = True
        stamp = time.strftime(GONE_STAMP, time.gmtime())
        os.write(1, f"{GONE_LINE}{stamp}; the rank's output follows ---\n".encode())
        _copy(True)


def notebook_back() -> None:
    """(the watch thread) A notebook holds the cluster again (an attach): output goes to it
    alone, as before, once the cell running now (if one is) has ended."""
    global _gone, _copying
    with _lock:
        _gone = False
        if not _running:
            _copying = False
            _copy(False)


def cell_began() -> None:
    """(the main thread, as a cell's request begins)"""
    global _running
    with _lock:
        _running = True


def cell_ended(code: str, reply: dict) -> None:
    """(the main thread, at a cell's reply) With no notebook (or for the cell that ran when
    one attached): how the cell ended, in a line of the log: ``--- the cell ended: ok |
    FIRST LINE`` or ``... ValueError: why | ...``."""
    global _running, _copying
    with _lock:
        _running = False
        if not _copying:
            return
        if not _gone:  # (the cell that ran at the attach: the copy ends with this line)
            _copying = False
    first = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")[:80]
    how = "ok" if reply.get("status") == "ok" else (
        f"{reply.get('ename', 'error')}: {reply.get('evalue', '')}"[:200].replace("|", "/"))
    for stream in (sys.stdout, sys.stderr):  # (what it printed first, then the line)
        try:
            stream.flush()
        except Exception:
            pass
    os.write(1, f"{CELL_ENDED}{how} | {first}\n".encode())
    with _lock:
        if not _copying:
            _copy(False)
