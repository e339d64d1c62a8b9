"""The ranks' stdout and stderr, as ipyparallel's engines send them to the notebook.

Threads: any thread writes; the IOPub thread flushes (``_flush``). ``marks``, the rank's
print marks (engine/arrays/print_marks.py), is set by the main thread before each cell
(``mark_with``, called by the rank's kernel: ipyparallel makes the streams after the kernel)
and read by the writers.
"""

from __future__ import annotations

import sys
import threading

from ipykernel import iostream

from spmd.engine.arrays import print_marks


def mark_with(marks: print_marks.PrintMarks) -> None:
    """(main thread) The rank's stdout and stderr mark the placeholders ``marks`` noted."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, OutStream) and stream.marks is not marks:
            stream.marks = marks


class OutStream(iostream.OutStream):
    """ipykernel's stream, except that C-level writes stay in the rank's log file.

    Python's ``print`` and ``sys.stderr`` still reach the notebook. What C and C++ code
    writes to the process's file descriptors does not, for two reasons:

    - gloo writes "[Gloo] Rank 3 is connected to 7 peer ranks..." to stdout from its own
      threads while the cell's ``print`` runs; merged into one stream, it lands in the middle
      of the user's lines;
    - jax's fatal message ("Terminating process because ...") is written just before the
      process aborts: through ipykernel's pipe it would be lost with the process, while in
      the log file it is there for the notebook's death report.
    """

    def __init__(self, session, pub_thread, name, **kwargs) -> None:
        kwargs["watchfd"] = False
        super().__init__(session, pub_thread, name, **kwargs)
        # Writes so far, and how many of them a finished flush had sent (see flush). Any
        # thread writes; the IOPub thread flushes.
        self._writes = self._flushed = 0
        self._writes_lock = threading.Lock()
        self.marks: print_marks.PrintMarks | None = None  # (none yet: a write left as it is)

    def write(self, string: str):
        # (jax's placeholder of an array over several processes gets its mark:
        # engine/arrays/print_marks.py)
        shown, marks = string, self.marks
        if marks is not None and isinstance(string, str):
            try:
                shown = marks.marked(string)
            except Exception:  # (never the user's print's error: the text as it is)
                shown = string
        written = super().write(shown)
        with self._writes_lock:  # (after: a write counted is in the buffer a flush takes)
            self._writes += 1
        return len(string) if written is not None else written

    def _flush(self) -> None:
        """(the IOPub thread) Send what was written; then it is sent."""
        upto = self._writes
        super()._flush()
        self._flushed = upto

    def flush(self) -> None:
        """ipykernel's flush, skipped when nothing was written since the last one.

        ipykernel's asks the IOPub thread to send the buffer and waits for its answer even
        when the buffer is empty: a trivial cell paid four of these thread round trips (its
        stdout and stderr, flushed before and after the reply), about a third of what a rank
        spent on it. Ordering is kept without them: what a cell sends on IOPub goes through
        that one thread in order, and its ``status: idle`` last.

        Skipped only when every write was sent by a flush that had finished: one that the
        IOPub thread is in the middle of (its buffer taken, not sent yet) is waited for, so
        the text is sent, and counted (spmd/engine/shell/quiet.py), before the cell's reply."""
        if self._flushed == self._writes and not self._subprocess_flush_pending:
            if self.echo is not None:
                self.echo.flush()
            return
        super().flush()
