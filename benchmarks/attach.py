"""``%spmd attach``: from the attach to the first cell's result, on 4 ranks (jax) and on 64
(``--backend none``), side by side in one run with what a person would pay without it: a new
start to the same first result (the floor the attach saves), and the same cell on a cluster
the notebook already holds (the floor under the attach).

Each round: a notebook process starts the cluster with a linger and is killed (SIGKILL);
this process then attaches and runs the cell. Records go to a Jupyter runtime folder of the
benchmark's own.

``python -m benchmarks.attach`` runs it alone; ``make bench`` runs it with the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

NOTEBOOK = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "spmd")
for cell in sys.argv[1:]:
    assert shell.run_cell(cell).success, cell
print("STARTED", flush=True)
import time
time.sleep(600)
"""
CELL = "x"  # (each rank's own value, shown as the cell's result)


def _killed_notebook(start: str, setup: str) -> None:
    """A notebook process that starts a cluster and sets ``x``, killed: its cluster lingers."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(NOTEBOOK)
    try:
        notebook = subprocess.Popen([sys.executable, f.name, start, setup],
                                    stdout=subprocess.PIPE, text=True)
        line = next((ln for ln in notebook.stdout if ln.startswith("STARTED")), "")
        notebook.kill()
        notebook.wait()
        notebook.stdout.close()
        if not line:
            raise RuntimeError(f"the notebook did not start its cluster: {start}")
    finally:
        os.unlink(f.name)


def measure(bench, rounds: int = 3) -> None:
    """Attach to first result, a fresh start to first result, and the cell alone."""
    runtime = tempfile.mkdtemp(prefix="spmd-bench-runtime-")
    before = os.environ.get("JUPYTER_RUNTIME_DIR")
    os.environ["JUPYTER_RUNTIME_DIR"] = runtime
    try:
        for n, backend, times in ((4, "jax", rounds), (64, "none", 1)):
            if not bench.fits(n, backend, f"attach to {n} ranks ({backend})"):
                continue
            start = f"%spmd start -n {n} --backend {backend} --linger 2m"
            setup = "import os\nx = int(os.environ['SPMD_RANK'])"
            for _ in range(times):
                _killed_notebook(start, setup)
                t0 = time.perf_counter()
                bench.cell("%spmd attach")
                bench.cell(CELL)
                bench.record(f"attach_to_first_result/spmd_n{n}", time.perf_counter() - t0)
                t0 = time.perf_counter()
                bench.cell(CELL)
                bench.record(f"attach_to_first_result/cell_alone_n{n}", time.perf_counter() - t0)
                bench.cell("%spmd stop")
                t0 = time.perf_counter()
                bench.cell(start.replace("--linger 2m", "--linger 0"))
                bench.cell(setup)
                bench.cell(CELL)
                bench.record(f"attach_to_first_result/fresh_start_n{n}",
                             time.perf_counter() - t0)
                bench.cell("%spmd stop")
    finally:
        if before is None:
            os.environ.pop("JUPYTER_RUNTIME_DIR", None)
        else:
            os.environ["JUPYTER_RUNTIME_DIR"] = before
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)


if __name__ == "__main__":
    from benchmarks.bench import Bench
    from benchmarks.table import summarize, table

    bench = Bench()
    measure(bench, rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    print(table(summarize(bench.samples)))
