"""A cell that prints a million lines, executed by nbclient as a notebook: its time, what it
costs the notebook's process in memory, and the size of the saved notebook.

Beside it, the same loop in a plain Python kernel (no ranks): what a flood costs a notebook
without jupyter-spmd. On the ranks, every rank prints the million lines.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime

import nbformat
from nbclient import NotebookClient

FLOOD = "for i in range({lines}):\n    print('line', i)"
RSS = "import psutil\nprint('rss', psutil.Process().memory_info().rss)"


def _seconds(cell) -> float:
    timing = cell.metadata["execution"]
    start = datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
    end = datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
    return (end - start).total_seconds()


def _rss(cell) -> int:
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    return int(text.split()[-1])


def flood(lines: int, ranks: int | None) -> dict[str, float]:
    """{seconds, memory_mb (the notebook process's growth), saved_mb}; ``ranks`` None: a
    plain kernel."""
    local = "%%local\n" if ranks else ""
    # (one rank may finish printing seconds before the other: not a divergence here)
    grace = "%%spmd --grace 120\n" if ranks else ""
    cells = [f"{local}{RSS}", grace + FLOOD.format(lines=lines), f"{local}{RSS}"]
    if ranks:
        cells = [f"%load_ext spmd\n%spmd start -n {ranks} --backend none", *cells, "%spmd stop"]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    first = 1 if ranks else 0
    with tempfile.TemporaryDirectory(prefix="spmd-flood-") as folder:
        NotebookClient(nb, timeout=600, kernel_name="python3").execute()
        path = os.path.join(folder, "flood.ipynb")
        nbformat.write(nb, path)
        size = os.path.getsize(path)
    before, flooded, after = nb.cells[first], nb.cells[first + 1], nb.cells[first + 2]
    return {
        "seconds": _seconds(flooded),
        "memory_mb": (_rss(after) - _rss(before)) / 2**20,
        "saved_mb": size / 2**20,
    }


def measure(bench, lines: int) -> None:
    """A million lines from every rank, and from a plain kernel, executed as notebooks."""
    for name, ranks in (("spmd", 2), ("plain_kernel", None)):
        got = flood(lines, ranks)
        bench.record(f"flood_1M_lines/{name}", got["seconds"])
        bench.record(f"flood_memory_mb/{name}", got["memory_mb"])
        bench.record(f"flood_saved_mb/{name}", got["saved_mb"])
