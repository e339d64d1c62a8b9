"""JupyterLab's own debugger on the ranks, in a real JupyterLab and a real (headless) chromium:
the bug button, a breakpoint clicked in a cell's gutter, the cell run, each rank's values in
the Variables panel, picked in the debugger's Ranks panel (the extension the wheel ships,
spmd/labextension) and with ``%rank N`` in its console, a step, Continue all, and Pause all
on a cell that loops. Screenshots stay in the test's folder (``SPMD_SCREENSHOTS=DIR`` copies
them there too, for the docs).
"""

from __future__ import annotations

import os
import re
import shutil

import nbformat
import pytest
from conftest import JUPYTER_DIR, SPMD_KERNEL
from lab import Lab, browser_page, kernel_stacks, needs_browser, save_shot, serve_checkout_extension

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

KERNEL_NAME = "Python 3 (SPMD, 2 processes)"
# (rank 1 reaches the breakpoint 3 s after rank 0: the first to stop is shown first)
CELL = ("import jax, time\nrank = jax.process_index()\nx = time.sleep(3 * rank) or 1\n"
        "y = rank * 10 + 5\nprint('after', y)")
# (no breakpoint in it: Pause all stops it wherever the ranks are)
# (until the test says stop: as long as the pause and the continue take, and no longer)
LOOP = ("import os\ni = 0\nwhile not os.path.exists({stop!r}):\n    time.sleep(0.01)\n"
        "    i += 1\nprint('looped')")


def _variable(page, name: str):
    """The Variables panel's row of ``name`` (its text: 'name: value')."""
    return page.locator(".jp-DebuggerVariables").get_by_role(
        "treeitem", name=re.compile(rf"^{name}:")).first


def _number(text: str) -> int:
    """The value of a Variables row's text ('y: 15', or 'y\n: 15')."""
    return int(re.search(r"(\d+)\s*$", text.strip()).group(1))


def _evaluate(page, code: str) -> None:
    """``code`` in the debugger's console (Evaluate Code, from the command palette)."""
    prompt = page.locator(".jp-DebugConsole .jp-CodeConsole-promptCell .cm-content, "
                          ".jp-CodeConsole-promptCell .cm-content").last
    if not prompt.is_visible():
        page.keyboard.press("Control+Shift+c")
        page.locator(".lm-CommandPalette-input").fill("Evaluate Code")
        page.locator(".lm-CommandPalette-item", has_text="Evaluate Code").first.click()
        prompt.wait_for()
    prompt.click()
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")


def _show_rank(page, rank: int) -> None:
    """``%rank N`` in the debugger's console until rank N has stopped and is shown."""
    said = page.locator(".jp-CodeConsole-content .jp-OutputArea-output")
    for _ in range(60):
        before = said.count()
        _evaluate(page, f"%rank {rank}")
        said.nth(before).wait_for()
        if said.nth(before).inner_text().strip() == f"showing rank {rank}":
            break
        page.wait_for_timeout(500)
    page.locator(".jp-DebuggerVariables").get_by_role(
        "treeitem", name=re.compile(rf"^rank: {rank}")).first.wait_for(timeout=30_000)


def _pick_in_panel(page, rank: int) -> None:
    """A click on rank N in the debugger's Ranks panel, once it is paused there: the
    Variables panel then shows rank N's values, and the panel marks it."""
    panel = page.locator("#jupyter-spmd-debugger-ranks")
    panel.locator(f"li[data-rank='{rank}']").wait_for(timeout=60_000)
    panel.locator(f"li[data-rank='{rank}']").click()
    page.locator(".jp-DebuggerVariables").get_by_role(
        "treeitem", name=re.compile(rf"^rank: {rank}")).first.wait_for(timeout=30_000)
    panel.locator(f"li[data-rank='{rank}'][aria-selected='true']").wait_for(timeout=10_000)


def test_browser_visual_debugger_on_the_ranks(tmp_path) -> None:
    needs_browser()
    data = tmp_path / ".jupyter-data"
    shutil.copytree(os.path.join(JUPYTER_DIR, "kernels", SPMD_KERNEL),
                    data / "kernels" / SPMD_KERNEL)
    serve_checkout_extension(str(data))
    env = dict(os.environ, JUPYTER_DATA_DIR=str(data), JUPYTER_PATH=str(data))
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": SPMD_KERNEL, "display_name": KERNEL_NAME, "language": "python"}})
    stop = tmp_path / "stop-looping"
    nb.cells = [nbformat.v4.new_code_cell(CELL),
                nbformat.v4.new_code_cell(LOOP.format(stop=str(stop)))]
    nbformat.write(nb, str(tmp_path / "debug.ipynb"))
    shots = str(tmp_path)
    with Lab(str(tmp_path), env=env) as lab, browser_page(width=1400, height=900) as page:
        page.goto(lab.url("lab/tree/debug.ipynb"))
        page.locator(".jp-Notebook").wait_for()
        page.locator(".jp-StatusBar-TextItem", has_text="| Idle").wait_for(timeout=120_000)
        try:
            # the bug button: JupyterLab offers it (kernelspec metadata) and turns it on
            bug = page.locator(".jp-DebuggerBugButton").first
            bug.wait_for()
            bug.click()
            page.locator(".jp-DebuggerBugButton[aria-pressed='true']").first.wait_for(
                timeout=120_000)
            cell = page.locator(".jp-Notebook .jp-Cell").first
            cell.locator(".jp-InputArea-editor").click()
            # a breakpoint on line 4 (y = rank * 10 + 5), clicked in the gutter
            gutter = cell.locator(".cm-gutters > .cm-gutter.cm-breakpoint-gutter > "
                                  ".cm-gutterElement")
            gutter.nth(4).click(position={"x": 5, "y": 5})
            cell.locator(".cm-breakpoint-icon:visible").first.wait_for()
            page.locator(".jp-DebuggerBreakpoint").first.wait_for()
            page.keyboard.press("Shift+Enter")
            # every rank stops; the one shown first is in the call stack and Variables
            page.locator(".jp-DebuggerCallstackFrame").first.wait_for(timeout=120_000)
            _variable(page, "x").wait_for(timeout=60_000)
            first = _number(_variable(page, "rank").inner_text())
            save_shot(page, shots, "debugger-stopped")
            # the debugger's Ranks panel: both ranks paused on line 4, the first shown; a
            # click on rank 1 shows rank 1's values
            panel = page.locator("#jupyter-spmd-debugger-ranks")
            panel.locator(f"li[data-rank='{first}'][aria-selected='true']").wait_for()
            _pick_in_panel(page, 1)
            panel.locator("li[data-rank='0']", has_text="cell line 4").wait_for(timeout=30_000)
            assert _number(_variable(page, "x").inner_text()) == 1
            save_shot(page, shots, "debugger-ranks-panel")
            # `%rank 0` in the debugger's console shows that rank's stop too
            _show_rank(page, 0)
            panel.locator("li[data-rank='0'][aria-selected='true']").wait_for(timeout=10_000)
            # a step over line 4 (every paused rank steps): y appears
            page.locator("jp-button[title^=Next]").first.click()
            _variable(page, "y").wait_for(timeout=60_000)
            y_shown = _number(_variable(page, "y").inner_text())
            rank_shown = _number(_variable(page, "rank").inner_text())
            assert y_shown == rank_shown * 10 + 5, (rank_shown, y_shown)
            _pick_in_panel(page, 1 - rank_shown)
            _pick_in_panel(page, 1)
            page.locator(".jp-DebuggerVariables").get_by_role(
                "treeitem", name=re.compile(r"^y: 15")).first.wait_for(timeout=30_000)
            save_shot(page, shots, "debugger-rank-1")
            # Continue all: the cell ends on every rank
            page.locator(".jp-spmd-ContinueAll").click()
            cell.get_by_text("[rank 1] after 15").wait_for(timeout=60_000)
            cell.get_by_text("[rank 0] after 5").wait_for(timeout=10_000)
            assert first == 0, f"rank {first} was shown first; rank 0 stopped first"
            save_shot(page, shots, "debugger-done")
            # Pause all on a cell that loops: every rank pauses, in the loop; Continue all
            loop = page.locator(".jp-Notebook .jp-Cell").nth(1)
            loop.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            pause = page.locator(".jp-spmd-PauseAll:not([disabled])")
            pause.wait_for(timeout=60_000)
            pause.click()
            for rank in (0, 1):
                panel.locator(f"li[data-rank='{rank}']", has_text="paused").wait_for(
                    timeout=60_000)
            _variable(page, "i").wait_for(timeout=60_000)
            stop.touch()  # (seen by the ranks once they go on: the loop ends, and says so)
            page.locator(".jp-spmd-ContinueAll:not([disabled])").click()
            loop.get_by_text("[ranks 0-1] looped").wait_for(timeout=120_000)
        except Exception as exc:  # (what failed first, then where the kernel's threads were)
            save_shot(page, shots, "debugger-failed")
            said = str(exc).splitlines()[0] if str(exc) else ""
            raise AssertionError(
                f"{type(exc).__name__}: {said}\nsee {shots}; the kernel's threads:\n"
                f"{kernel_stacks(lab)}") from None
