"""A cell's outputs rank by rank as data (``application/vnd.spmd.ranks+json``), read back by
nbclient from a notebook it executed in the SPMD kernel with 2 real ranks: each rank's text is
what that rank printed, its value, its error with the traceback, how the cell ended on it; the
text a person reads is as before, and the data's own output shows nothing."""

from __future__ import annotations

import nbformat
import pytest
from conftest import SPMD_KERNEL

from spmd.demo import cell_text, execute
from spmd.wire import RANKS_DATA_MIME as MIME

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("spmd_kernelspec")]

CELLS = [
    "import jax\nrank = jax.process_index()\nprint('same on every rank')\nprint('rank', rank)",
    "rank * 10 + 1",
    "print('before', rank)\nif rank == 1:\n    raise ValueError(f'only rank {rank}')\nrank",
]


def _notebook(path) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": SPMD_KERNEL, "display_name": "SPMD", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nbformat.write(nb, str(path))


def _data(cell) -> dict:
    found = [o for o in cell.outputs if o.output_type == "display_data" and MIME in o.data]
    assert len(found) == 1, cell.outputs
    assert found[0].data["text/plain"] == ""  # (a front end without its renderer: nothing)
    return found[0].data[MIME]


def test_nbclient_reads_each_ranks_outputs_from_the_saved_notebook(tmp_path):
    path = tmp_path / "ranks.ipynb"
    _notebook(path)
    nb = execute(path, allow_errors=True)
    nbformat.write(nb, str(path))
    nb = nbformat.read(str(path), as_version=4)  # (saved with the notebook)

    printed = _data(nb.cells[0])
    assert printed["version"] == 1 and printed["stall"] is None
    assert [r["rank"] for r in printed["ranks"]] == [0, 1]
    for r in printed["ranks"]:
        # what each rank printed, as that rank printed it (the notebook shows the first line
        # once, for both)
        assert r["stdout"] == f"same on every rank\nrank {r['rank']}\n", r
        assert r["ended"] == "ok" and r["error"] is None and r["value"] is None
    assert cell_text(nb.cells[0]).endswith(
        "[ranks 0-1] same on every rank\n[rank 0] rank 0\n[rank 1] rank 1\n")

    values = _data(nb.cells[1])
    assert [r["value"]["text"] for r in values["ranks"]] == ["1", "11"]
    assert values["execution_count"] == nb.cells[1].execution_count

    failed = _data(nb.cells[2])
    zero, one = failed["ranks"]
    assert zero["ended"] == "ok" and zero["value"]["text"] == "0" and zero["error"] is None
    assert one["ended"] == "error" and one["value"] is None
    assert one["error"]["ename"] == "ValueError" and one["error"]["evalue"] == "only rank 1"
    assert any("raise ValueError" in line for line in one["error"]["traceback"])
    assert not any("\x1b[" in line for line in one["error"]["traceback"])
    assert [r["stdout"] for r in failed["ranks"]] == ["before 0\n", "before 1\n"]
