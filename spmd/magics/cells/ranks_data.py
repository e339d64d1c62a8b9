"""A cell's outputs rank by rank, as data a program reads: the ``application/vnd.spmd.ranks+json``
bundle.

The notebook groups what the ranks printed so that a person sees what is the same on every
rank (render.py); a program (nbclient, papermill, an agent's tool) would have to parse those
``[rank 1]`` labels back. So every cell that ran on the ranks also shows one display output
whose MIME bundle carries, for each rank, its text, its value, its error with the traceback
and how the cell ended on it (``bundle``; the schema is in docs/reference/ranks-json.md).
Beside it is an empty ``text/plain``: a front end that does not know the type (the classic
notebook, VS Code, nbconvert) shows nothing for it, and JupyterLab's extension (labextension/)
hides it, so the notebook reads as it did. It is saved with the notebook.

Bounded as the text is: each rank's streams are the lines its RankCell kept (``--max-output``),
with the count of lines left out; a display or value is its ``text/plain`` and the names of
its other MIME types, never a picture's bytes.

Main thread only (the cell's magic, after its wait): it reads the cell's CellResult.
"""

from __future__ import annotations

import re

from IPython.display import display

from spmd.wire import RANKS_DATA_MIME

MIME = RANKS_DATA_MIME
VERSION = 1
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def bundle(ran, count: int | None) -> dict:
    """The cell ``ran`` (records.CellResult) rank by rank; ``count``: its ``In[n]``."""
    stall = ran.stall
    dead = {d.rank for d in stall.deaths} if stall is not None else set()
    busy = set(stall.busy) if stall is not None else set()
    paused = set(stall.in_debugger) if stall is not None else set()
    ranks = []
    for rank in ran.ranks:
        cell = ran.cells.get(rank)
        outputs = cell.outputs if cell is not None else []
        error = cell.error if cell is not None else None
        if rank in dead:
            ended = "died"
        elif rank in busy:
            ended = "paused" if rank in paused else "running"
        elif error is not None:
            ended = "interrupted" if error.ename == "KeyboardInterrupt" else "error"
        else:
            ended = "ok"
        value = next((o for o in outputs if o.kind == "result"), None)
        ranks.append({
            "rank": rank,
            "ended": ended,
            "seconds": round(cell.seconds, 3) if cell is not None and cell.seconds else None,
            "stdout": "".join(o.text for o in outputs if o.kind == "stdout"),
            "stderr": "".join(o.text for o in outputs if o.kind == "stderr"),
            "lines_left_out": cell.left_out if cell is not None else 0,
            "displays": [_shown(o) for o in outputs if o.kind == "display"],
            "value": _shown(value) if value is not None else None,
            "error": None if error is None else {
                "ename": error.ename, "evalue": error.evalue,
                "traceback": [_ANSI.sub("", line) for line in error.traceback]},
        })
    return {
        "version": VERSION,
        "execution_count": count,
        "stall": None if stall is None else {"reason": stall.reason, "ranks": sorted(busy)},
        "ranks": ranks,
    }


def _shown(out) -> dict:
    """A display or value as its text, and the names of its MIME types."""
    return {"text": str(out.data.get("text/plain", "")), "mime": sorted(out.data)}


def show(data: dict) -> None:
    """A cell's ``bundle``, as one display output (empty text: nothing is seen)."""
    display({MIME: data, "text/plain": ""}, raw=True)


def goes_first(ran) -> bool:
    """Where a rank's last output clears the cell's at the next output (``clear_output(
    wait=True)``), the bundle is shown before the outputs, not after: it would clear them."""
    return any(kept and kept[-1].kind == "clear" for kept in (
        [o for o in c.outputs if o.kind not in ("result", "error")]
        for c in ran.cells.values()))
