"""Every line each rank printed, in a file per rank: the notebook keeps only a cell's first and
last lines of a flood (``--max-output``); ``%spmd log RANK`` reads the rest here."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile


class RankLogs:
    """One append-only file per rank, in a folder of the session's (removed at stop)."""

    def __init__(self) -> None:
        self.folder: str | None = None
        self._files: dict[int, object] = {}
        self._cell = 0

    def path(self, rank: int) -> str | None:
        return None if self.folder is None else os.path.join(self.folder, f"rank-{rank}.log")

    def begin_cell(self, ranks: list[int], first_line: str) -> None:
        """A header in each rank's log: which cell the following lines belong to."""
        self._cell += 1
        line = first_line.strip().splitlines()[0][:60] if first_line.strip() else ""
        for rank in ranks:
            self._file(rank).write(f"--- cell {self._cell}: {line}\n")

    def write(self, rank: int, text: str) -> None:
        self._file(rank).write(text)

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def _file(self, rank: int):
        f = self._files.get(rank)
        if f is None:
            if self.folder is None:
                self.folder = tempfile.mkdtemp(prefix="spmd-logs-")
            # (buffered: a flood arrives in many chunks; flushed when the cell ends)
            f = self._files[rank] = open(self.path(rank), "a", encoding="utf-8")  # noqa: SIM115
        return f

    def read(self, rank: int, tail: int | None = None) -> tuple[str, int]:
        """(the text of rank's log, or its last ``tail`` lines; the log's line count)."""
        self.flush()
        path = self.path(rank)
        if path is None or not os.path.exists(path):
            return "", 0
        with open(path, encoding="utf-8", errors="replace") as f:
            if tail is None:
                text = f.read()
                return text, text.count("\n")
            last = collections.deque(maxlen=tail)
            count = 0
            for line in f:
                last.append(line)
                count += 1
            return "".join(last), count

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
