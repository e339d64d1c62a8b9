"""Every line each rank printed, in a file per rank: the notebook keeps only a cell's first and
last lines of a flood (``--max-output``); ``%spmd log RANK`` reads the rest here.

The logs outlive their cluster: a rank that died is when its last lines matter most. A stop
closes the files; a restart writes on in them; the next ``%spmd start`` or the notebook's end
removes them (and a later notebook, if this one was killed: see profiles.py)."""

from __future__ import annotations

import atexit
import collections
import os
import re
import shutil
import sys

from spmd.cluster.launchers.profiles import owned_folder
from spmd.cluster.lockstep.run import drop_chatter


class RankLogs:
    """One append-only file per rank, in a folder of its own (removed by ``remove``)."""

    def __init__(self) -> None:
        self.folder: str | None = None
        self._files: dict[int, object] = {}
        self._cell = 0
        self._header = ""
        self._written: set[int] = set()  # ranks that printed in this cell
        self._mid_line: set[int] = set()  # ranks whose log ends without a newline

    def path(self, rank: int) -> str | None:
        return None if self.folder is None else os.path.join(self.folder, f"rank-{rank}.log")

    def begin_cell(self, code: str) -> None:
        """The header that the lines a rank prints in this cell come after (written with the
        first of them: a cell that prints nothing costs nothing here)."""
        self._cell += 1
        line = code.strip().splitlines()[0][:60] if code.strip() else ""
        self._header = f"--- cell {self._cell}: {line}\n"
        self._written = set()

    def write(self, rank: int, text: str) -> None:
        f = self._file(rank)
        if rank not in self._written:
            self._written.add(rank)
            # (on a line of its own: an earlier cell may have ended mid-line, print(end=''))
            f.write(self._header if rank not in self._mid_line else "\n" + self._header)
        f.write(text)
        if text.endswith("\n"):
            self._mid_line.discard(rank)
        elif text:
            self._mid_line.add(rank)

    def flush(self) -> None:
        for rank in self._written:
            if rank in self._files:  # (a death's stop may have closed them already)
                self._files[rank].flush()

    def _file(self, rank: int):
        f = self._files.get(rank)
        if f is None:
            if self.folder is None:
                self.folder = owned_folder("spmd-logs-")
                atexit.register(self.remove)
            # (buffered: a flood arrives in many chunks; flushed when the cell ends)
            f = self._files[rank] = open(self.path(rank), "a", encoding="utf-8")  # noqa: SIM115
        return f

    def read(self, rank: int, tail: int | None = None) -> tuple[str, int]:
        """(the text of rank's log, or its last ``tail`` lines; the log's line count)."""
        if rank in self._files:
            self._files[rank].flush()
        path = self.path(rank)
        if path is None or not os.path.exists(path):
            return "", 0
        with open(path, encoding="utf-8", errors="replace") as f:
            if tail is None:
                text = f.read()
                return text, text.count("\n")
            last = collections.deque(maxlen=min(tail, sys.maxsize))  # (more than it has: all)
            count = 0
            for line in f:
                last.append(line)
                count += 1
            return "".join(last), count

    def close(self) -> None:
        """Close the files (the cluster stopped); they stay to be read, and written on."""
        files, self._files = self._files, {}  # (a shutdown may close them from its thread)
        for f in list(files.values()):
            f.close()
        self._written = set()

    def remove(self) -> None:
        """Close and remove the files: a new cluster's logs begin."""
        self.close()
        self._mid_line = set()
        atexit.unregister(self.remove)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


# ipyparallel's own log lines in the engine's log file ("2026-11-22 00:11:36.959 [IPEngine]
# WARNING | ..."): start-up notices, not what the process said when it died.
_IPP_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[IPEngine")


def last_lines(output: str, count: int = 8, width: int = 400) -> list[str]:
    """The end of what an engine wrote to its stdout and stderr (jax's fatal messages, a
    crash's Python stack), without gloo's chatter and ipyparallel's own log lines."""
    text = drop_chatter(output[-50000:])
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not _IPP_LOG.match(ln)]
    return [ln if len(ln) <= width else ln[: width - 3] + "..." for ln in lines[-count:]]
