"""Fixtures: a real IPython shell with the extension loaded, real engines, real jax.

Every test that starts a cluster ends it; ``no_leftover_processes`` checks after each test
module that no engine or controller this process started is still alive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output


@dataclass
class CellResult:
    stdout: str
    stderr: str
    outputs: list = field(default_factory=list)  # rich display bundles (dicts)
    error: BaseException | None = None

    @property
    def texts(self) -> list[str]:
        return [o.get("text/plain", "") for o in self.outputs]


def run(shell: InteractiveShell, code: str) -> CellResult:
    """Run one notebook cell in ``shell`` and return what it showed.

    The cell's result (what a front end shows as ``Out[n]``, an execute_result) comes last in
    ``outputs``, as its MIME bundle; the terminal shell's displayhook does not print it.
    """
    with capture_output() as cap:
        result = shell.run_cell(code, store_history=True)
        shown = [o.data for o in cap.outputs]
        if result.result is not None:
            shown.append(shell.display_formatter.format(result.result)[0])
    error = result.error_before_exec or result.error_in_exec
    return CellResult(cap.stdout, cap.stderr, shown, error)


@pytest.fixture(scope="session")
def shell():
    ip = InteractiveShell.instance()
    # A notebook shows a cell's result as an output, not as 'Out[n]:' text: run() collects it.
    ip.displayhook.write_output_prompt = lambda: None
    ip.displayhook.write_format_data = lambda *args, **kwargs: None
    ip.run_line_magic("load_ext", "spmd")
    yield ip
    ip.run_line_magic("unload_ext", "spmd")


def spmd_children() -> list[psutil.Process]:
    """Engines and controllers started by this test process and still alive."""
    found = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if "spmd.engine" in cmd or "spmd.cluster" in cmd or "ipyparallel" in cmd:
                found.append(child)
        except psutil.Error:
            continue
    return found


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    yield
    left = spmd_children()
    if left:
        psutil.wait_procs(left, timeout=5)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left running after the module: {[p.pid for p in left]}"
