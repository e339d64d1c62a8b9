"""The whole flow in JupyterLab, in a real (headless) chromium: what a person sees.

One test per front-end path: the magic in a plain Python kernel, and the SPMD kernel picked
from the launcher. Each starts its own JupyterLab on 127.0.0.1 with a token, and leaves
screenshots in its temporary folder (``SPMD_SCREENSHOTS=DIR`` copies them there too).
"""

from __future__ import annotations

import os
import re
import shutil

import nbformat
import pytest
from conftest import JUPYTER_DIR, SPMD_KERNEL
from lab import Lab, browser_page, kernel_stacks, needs_browser, save_shot

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MAGIC_CELLS = [
    "%load_ext spmd",
    "%spmd start -n 2 -d 2",
    # collapsed: the same on every rank
    "import jax\nprint('devices:', jax.device_count())",
    # per rank
    "print('process', jax.process_index(), 'of', jax.process_count())",
    "import jax.numpy as jnp\nfrom jax.sharding import NamedSharding, PartitionSpec as P\n"
    "mesh = jax.make_mesh((2, 2), ('x', 'y'), axis_types=(jax.sharding.AxisType.Auto,) * 2)\n"
    "x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P('x', 'y')))",
    "%spmd sharding x",
    "from tqdm.auto import tqdm\nimport time\n"
    "for step in tqdm(range(20), desc='train'):\n    time.sleep(0.05 * (1 + jax.process_index()))",
    "%%spmd --panel --grace 30\nimport time\ntime.sleep(5 if jax.process_index() == 1 else 0.2)",
    "if jax.process_index() == 1:\n    raise ValueError('rank 1 is unhappy')",
    "print('after the error')",  # Run All stops before this one
    # run alone: a widget on each rank, moved in the page, read back on the ranks
    "import ipywidgets\nslider = ipywidgets.IntSlider(value=5, max=10, description='lr')\nslider",
    "print('value', slider.value)",
    "import time\ntime.sleep(300)",  # run alone, then interrupted from the Kernel menu
    "%spmd stop",
]


def _notebook(path: str, cells: list[str], kernel: str, display_name: str) -> None:
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": kernel, "display_name": display_name, "language": "python"}}
    )
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}")).first.click()


def _cell(page, i: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(i)


def _output(page, i: int) -> str:
    return _cell(page, i).locator(".jp-OutputArea").inner_text()


def _prompt(page, i: int) -> str:
    return _cell(page, i).locator(".jp-InputPrompt").inner_text().strip()


def _wait_idle(page) -> None:
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").wait_for()


def _run_one(page, i: int) -> None:
    _cell(page, i).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def test_browser_magic_in_a_python_kernel(tmp_path) -> None:
    needs_browser()
    _notebook(str(tmp_path / "magic.ipynb"), MAGIC_CELLS, "python3", "Python 3 (ipykernel)")
    with Lab(str(tmp_path)) as lab, browser_page() as page:
        page.goto(lab.url("lab/tree/magic.ipynb"))
        page.locator(".jp-Notebook").wait_for()
        _wait_idle(page)
        _menu(page, "Run", "Run All Cells")

        # the start: its progress becomes a timeline, then the summary
        page.get_by_text("Started 2 processes").wait_for(timeout=120_000)
        assert "engines registered in" in _output(page, 1)
        # collapsed and per rank
        page.get_by_text("[rank 1] process 1 of 2").wait_for()
        assert "[ranks 0-1] devices: 4" in _output(page, 2)
        assert "[rank 0] process 0 of 2" in _output(page, 3)
        # the sharding picture: both processes' devices, drawn
        _cell(page, 5).locator(".jp-OutputArea-output img, .jp-OutputArea-output svg").first.wait_for()
        # the panel while rank 1 sleeps: it stands out as the straggler
        straggler = _cell(page, 7).locator(".spmd-panel", has_text="straggler")
        straggler.wait_for(timeout=60_000)
        save_shot(page, str(tmp_path), "panel-live", show=_cell(page, 7))
        # tqdm on the ranks: one bar per rank, both at 100%
        save_shot(page, str(tmp_path), "widgets", show=_cell(page, 7))
        bars = _output(page, 6)
        assert bars.count("100%") == 2, bars
        assert "[rank 0]" in bars and "[rank 1]" in bars
        _cell(page, 7).get_by_text("the slowest was rank 1").wait_for()
        # the failure: the report is visible and Run All stopped there
        _cell(page, 8).get_by_text("Error on 1 of 2 ranks").wait_for()
        report = _output(page, 8)
        assert "ValueError: rank 1 is unhappy" in report and "rank 0 did not raise" in report
        _wait_idle(page)
        assert _prompt(page, 9) == "[ ]:", "Run All went on after the failing cell"
        save_shot(page, str(tmp_path), "magic", show=_cell(page, 9))

        # widgets both ways: rank 0's slider moved here changes the value on rank 0 only
        _run_one(page, 10)
        handles = _cell(page, 10).locator(".noUi-handle")
        handles.nth(1).wait_for()
        assert _output(page, 10).count("[rank") == 2
        handles.first.focus()
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(500)
        _run_one(page, 11)
        _cell(page, 11).get_by_text("[rank 1] value 5").wait_for()
        assert "[rank 0] value 7" in _output(page, 11)
        save_shot(page, str(tmp_path), "slider", show=_cell(page, 11))

        # Kernel > Interrupt on a cell blocked on every rank
        _run_one(page, 12)
        page.wait_for_timeout(2000)
        assert _prompt(page, 12) == "[*]:"
        _menu(page, "Kernel", "Interrupt Kernel")
        _cell(page, 12).get_by_text("interrupted").first.wait_for(timeout=30_000)
        assert "KeyboardInterrupt" not in _output(page, 12).split("\n")[0]
        save_shot(page, str(tmp_path), "interrupt", show=_cell(page, 12))

        _run_one(page, 13)
        _cell(page, 13).get_by_text("Stopped 2 processes").wait_for()


KERNEL_NAME = "Python 3 (SPMD, 2 processes)"


def test_browser_spmd_kernel_from_the_launcher(tmp_path) -> None:
    needs_browser()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    # Lab sees this test run's SPMD kernelspec (2 ranks) and no other that a test installs
    data = tmp_path / ".jupyter-data"
    shutil.copytree(os.path.join(JUPYTER_DIR, "kernels", SPMD_KERNEL), data / "kernels" / SPMD_KERNEL)
    env = dict(os.environ, JUPYTER_DATA_DIR=str(data), JUPYTER_PATH=str(data))
    with Lab(str(tmp_path), env=env) as lab, browser_page() as page:
        page.goto(lab.url("lab"))
        cards = page.locator(f".jp-LauncherCard[data-category='Notebook'][title='{KERNEL_NAME}']")
        cards.first.click()
        page.locator(".jp-Notebook").wait_for()
        page.locator(".jp-Toolbar", has_text=KERNEL_NAME).first.wait_for()

        editor = _cell(page, 0).locator(".jp-InputArea-editor")
        editor.click()
        page.keyboard.type(
            "import os\nprint('pid', os.getpid())\n"
            "only_on_ranks = int(os.environ['SPMD_RANK'])\nonly_on_ranks"
        )
        page.keyboard.press("Shift+Enter")
        try:
            _cell(page, 0).get_by_text("[rank 1] 1").wait_for(timeout=120_000)
        except PlaywrightTimeout:  # (seen twice in full runs, never alone: say where it was)
            save_shot(page, str(tmp_path), "kernel-first-cell")
            raise AssertionError(
                f"the first cell did not finish; the kernel's threads:\n{kernel_stacks(lab)}"
            ) from None
        first = _output(page, 0)
        assert "[rank 0] 0" in first
        pids_before = set(re.findall(r"\] pid (\d+)", first))
        assert len(pids_before) == 2, first

        # completion of a name defined on the ranks only
        _cell(page, 1).locator(".jp-InputArea-editor").click()
        page.keyboard.type("only_on")
        item = page.locator(".jp-Completer-item", has_text="only_on_ranks").first
        for _ in range(5):  # (a Tab pressed while the editor still takes the keys is lost)
            page.keyboard.press("Tab")
            try:
                item.wait_for(timeout=5_000)
                break
            except PlaywrightTimeout:
                save_shot(page, str(tmp_path), "completion-not-yet")
        item.wait_for()
        save_shot(page, str(tmp_path), "kernel-completion")
        page.keyboard.press("Escape")
        page.keyboard.press("Control+a")
        page.keyboard.type("import os\nprint('rank', os.environ['SPMD_RANK'], 'pid', os.getpid())")

        # restart from the Kernel menu: new processes, and cells run again
        _menu(page, "Kernel", "Restart Kernel")
        page.locator(".jp-Dialog button.jp-mod-accept").click()
        page.wait_for_timeout(1000)
        _wait_idle(page)
        _cell(page, 1).locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        _cell(page, 1).get_by_text(re.compile(r"\[rank 1\] rank 1 pid \d+")).wait_for(timeout=120_000)
        pids_after = set(re.findall(r"\] rank \d pid (\d+)", _output(page, 1)))
        assert len(pids_after) == 2 and not pids_after & pids_before
        save_shot(page, str(tmp_path), "kernel")
