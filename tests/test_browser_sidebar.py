"""The Ranks sidebar in JupyterLab, in a real (headless) chromium: the extension the wheel ships
(spmd/labextension), an SPMD kernel of 4 ranks, and a cell where rank 1 holds the three others
in a collective. The sidebar lists the ranks, names rank 1 as it happens, and shows its stack
on a click; for a plain Python kernel it says it has nothing to show.

4 ranks: the point is one rank holding three back. Screenshots go to the test's folder
(``SPMD_SCREENSHOTS=DIR`` copies them there too: docs/screenshots/ranks-sidebar.png).
"""

from __future__ import annotations

import os
import re
import time

import nbformat
import pytest
from lab import Lab, browser_page, kernel_stacks, needs_browser, save_shot, serve_checkout_extension

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

KERNEL = "spmd-test-sidebar-lab"
CELLS = [
    # (the collective compiled here: in the next cell the other ranks wait in it at once)
    "import time, jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
    "def gather():\n    return multihost_utils.process_allgather(jnp.ones(1))\ngather();",
    "if jax.process_index() == 1:\n    time.sleep(120)\ngather();",
]


def _kernelspec(data: str) -> None:
    from spmd.kernel.kernelspec import install

    saved = os.environ.get("JUPYTER_DATA_DIR")
    os.environ["JUPYTER_DATA_DIR"] = data
    try:
        install(KERNEL, user=True, processes=4)
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_DATA_DIR")
        else:
            os.environ["JUPYTER_DATA_DIR"] = saved


def _notebook(path: str, kernel: str, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": kernel, "display_name": kernel, "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


def _open_sidebar(page):
    sidebar = page.locator("#jupyter-spmd-ranks")
    page.locator(".lm-TabBar-tab[data-id='jupyter-spmd-ranks']").wait_for()
    if not sidebar.is_visible():  # (a click on its tab toggles it)
        page.locator(".lm-TabBar-tab[data-id='jupyter-spmd-ranks']").click()
    sidebar.wait_for()
    return sidebar


def _run(page, i: int) -> None:
    page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def test_the_ranks_sidebar_names_the_rank_that_blocks_the_others(tmp_path) -> None:
    needs_browser()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    data = str(tmp_path / ".jupyter-data")
    _kernelspec(data)
    serve_checkout_extension(data)
    _notebook(str(tmp_path / "hang.ipynb"), KERNEL, CELLS)
    _notebook(str(tmp_path / "plain.ipynb"), "python3", ["1 + 1"])
    env = dict(os.environ, JUPYTER_DATA_DIR=data, JUPYTER_PATH=data)
    with Lab(str(tmp_path), env=env) as lab, browser_page(width=1400, height=900) as page:
        page.goto(lab.url("lab/tree/hang.ipynb"))
        page.locator(".jp-Notebook").wait_for()
        sidebar = _open_sidebar(page)
        try:  # (the kernel's own 4 ranks: they start with the kernel)
            sidebar.locator("tr[data-rank='3']").first.wait_for(timeout=120_000)
        except PlaywrightTimeout:
            save_shot(page, str(tmp_path), "sidebar-never-filled")
            raise AssertionError(f"no ranks in the sidebar:\n{kernel_stacks(lab)}") from None
        assert sidebar.locator(".jp-spmd-Ranks-head").inner_text().startswith("4 ranks (jax)")
        # the debugger's Ranks panel is in the debugger's sidebar for this kernel only
        assert page.locator("#jupyter-spmd-debugger-ranks").count() == 1
        where = sidebar.locator(".jp-spmd-Ranks-where").all_inner_texts()
        assert len(where) == 4 and all(re.search(r" · pid \d+ · 1 device$", w) for w in where), where

        _run(page, 0)
        page.locator(".jp-Notebook .jp-Cell").nth(0).locator(
            ".jp-InputPrompt", has_text=re.compile(r"\[\d+\]")).wait_for(timeout=120_000)
        _run(page, 1)
        sidebar.locator(".jp-spmd-Ranks-head", has_text="a cell runs").wait_for(timeout=60_000)
        running = time.monotonic()
        blocking = sidebar.locator(".jp-spmd-Ranks-blocking")
        blocking.wait_for(timeout=60_000)
        named = time.monotonic() - running
        print(f"the blocking rank named {named:.2f} s after the sidebar said a cell runs")
        said = blocking.inner_text()
        assert said.startswith("Rank 1 blocks the others: ranks 0,2-3 wait in "), said
        # named within 2 s of the cell running (the collective was compiled before)
        assert named < 2.0, named
        row = "\n".join(sidebar.locator("tr[data-rank='1']").all_inner_texts())
        assert "busy (blocks)" in row and "cell line 2: time.sleep(120)" in row, row

        sidebar.locator("tr[data-rank='1']").first.click()
        detail = sidebar.locator(".jp-spmd-Ranks-detail")
        detail.filter(has_text="time.sleep(120)").wait_for(timeout=30_000)
        save_shot(page, str(tmp_path), "ranks-sidebar")

        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Kernel$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Interrupt Kernel")).first.click()
        sidebar.locator(".jp-spmd-Ranks-head", has_text="idle").wait_for(timeout=60_000)
        assert sidebar.locator(".jp-spmd-Ranks-blocking").count() == 0

        # a plain Python kernel: the sidebar has nothing to show, and says so
        page.goto(lab.url("lab/tree/plain.ipynb"))
        page.locator(".jp-Notebook").wait_for()
        sidebar = _open_sidebar(page)
        sidebar.locator(".jp-spmd-Ranks-head", has_text="Not an SPMD kernel").wait_for(
            timeout=60_000)
        assert page.locator("#jupyter-spmd-debugger-ranks").count() == 0
