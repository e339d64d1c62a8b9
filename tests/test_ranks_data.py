"""A cell's outputs rank by rank as data (``application/vnd.spmd.ranks+json``), read back by
nbclient from a notebook it executed in the SPMD kernel with 2 real ranks: each rank's text is
what that rank printed, its value, its error with the traceback, how the cell ended on it; the
text a person reads is as before, and the data's own output shows nothing: the saved notebook
opened in JupyterLab and in the classic notebook (in chromium) shows the same text as without
the data."""

from __future__ import annotations

import os
import re
import time

import nbformat
import pytest
from conftest import SPMD_KERNEL
from lab import Lab, browser_page, needs_browser, serve_checkout_extension

from spmd.demo import cell_text, execute
from spmd.wire import RANKS_DATA_MIME as MIME

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("spmd_kernelspec")]

CELLS = [
    "import jax\nrank = jax.process_index()\nprint('same on every rank')\nprint('rank', rank)",
    "rank * 10 + 1",
    "print('before', rank)\nif rank == 1:\n    raise ValueError(f'only rank {rank}')\nrank",
    # a progress line rewritten in place: what stays is its last state, and the data
    "from IPython.display import clear_output\n"
    "for step in range(3):\n    print('step', step)\n    clear_output(wait=True)",
    # ... and cleared by the cell's value, as in one process
    "for step in range(3):\n    print('step', step)\n    clear_output(wait=True)\n7",
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


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """The notebook executed by nbclient in the SPMD kernel, saved (once for this module)."""
    path = tmp_path_factory.mktemp("saved") / "ranks.ipynb"
    _notebook(path)
    nbformat.write(execute(path, allow_errors=True), str(path))
    return str(path)


def test_nbclient_reads_each_ranks_outputs_from_the_saved_notebook(saved):
    nb = nbformat.read(saved, as_version=4)

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

    # (what one process shows of these two: 'step 2', and the value alone)
    assert cell_text(nb.cells[3]) == "[ranks 0-1] step 2\n"
    assert [r["ended"] for r in _data(nb.cells[3])["ranks"]] == ["ok", "ok"]
    assert cell_text(nb.cells[4]).strip() == "7"
    assert [r["value"]["text"] for r in _data(nb.cells[4])["ranks"]] == ["7", "7"]


def _without_data(nb):
    for cell in nb.cells:
        cell.outputs = [o for o in cell.outputs
                        if not (o.output_type == "display_data" and MIME in o.data)]
    return nb


@pytest.mark.slow
def test_the_saved_notebook_shows_the_same_text_in_jupyterlab_and_the_classic_notebook(
        saved, tmp_path):
    needs_browser()
    pytest.importorskip("nbclassic", reason="the classic notebook: pip install -e '.[test]'")
    nb = nbformat.read(saved, as_version=4)
    assert sum(MIME in o.get("data", {}) for c in nb.cells for o in c.outputs) == 5
    # (opened with a plain Python kernel: what is saved is read, nothing runs again)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(tmp_path / "with.ipynb"))
    nbformat.write(_without_data(nb), str(tmp_path / "without.ipynb"))
    data = str(tmp_path / ".jupyter-data")
    serve_checkout_extension(data)  # (JupyterLab with this checkout's renderer of the data)
    env = dict(os.environ, JUPYTER_DATA_DIR=data, JUPYTER_PATH=data)

    def every_output(read) -> list[str]:
        """The cells' output texts once all five show (a page draws them one by one)."""
        deadline = time.monotonic() + 60
        while True:
            texts = read()
            if len(texts) == 5 and all(t.strip() for t in texts) or time.monotonic() > deadline:
                return texts
            time.sleep(0.2)

    def lab_text(page, name: str) -> list[str]:
        page.goto(lab.url(f"lab/tree/{name}"))
        page.locator(".jp-Notebook .jp-OutputArea-output").first.wait_for()
        return every_output(
            page.locator(".jp-Notebook .jp-Cell-outputArea").all_inner_texts)

    def classic_text(page, name: str) -> list[str]:
        page.goto(lab.url(f"notebooks/{name}"))
        page.locator("#notebook .output_area").first.wait_for()
        return every_output(
            page.locator("#notebook .output_wrapper .output").all_inner_texts)

    def lines(texts: list[str]) -> list[str]:
        # (without the data between them, two stream outputs are one, as a front end merges
        # them: one line break between the lines, not two)
        return [re.sub(r"\n+", "\n", text).strip() for text in texts]

    with Lab(str(tmp_path), env=env) as lab, browser_page() as page:
        for shown in (lab_text, classic_text):
            texts = lines(shown(page, "with.ipynb"))
            assert len(texts) == 5 and "[rank 1] rank 1" in texts[0], (shown, texts)
            assert "ValueError: only rank 1" in texts[2], (shown, texts)
            assert texts == lines(shown(page, "without.ipynb")), shown
