"""``python -m benchmarks.gpu_check``: the quickstart on real GPUs, one process per GPU.

Run it on a machine with NVIDIA GPUs and jax's CUDA build. It executes the quickstart
notebook with its start cell changed to ``%spmd start -n G --gpus-per-process 1`` (G: the
GPUs ``nvidia-smi`` lists, at most 4), then checks on every rank that jax sees exactly one
GPU, a different one on each rank, and that a psum across the ranks is right. It prints the
timings, and exits 0 when every check holds (or, with a message, where there is no GPU).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from spmd.demo import cell_text, execute
from spmd.engine.join.placement import host_gpus

QUICKSTART = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"
# (one line per rank: "[rank 1] 1 ['gpu'] [4.]"; lines of several, a rank's block)
CHECK = (
    "import os, jax, jax.numpy as jnp\n"
    "print(os.environ['CUDA_VISIBLE_DEVICES'], [d.platform for d in jax.local_devices()],\n"
    "      jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')("
    "jnp.ones(jax.local_device_count())))"
)


def main() -> int:
    gpus = host_gpus()
    if not gpus:
        print("No GPU here (nvidia-smi lists none): nothing to check.")
        return 0
    n = min(len(gpus), 4)
    nb = nbformat.read(str(QUICKSTART), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "%spmd start" in cell.source:
            cell.source = re.sub(
                r"%spmd start[^\n]*", f"%spmd start -n {n} --gpus-per-process 1", cell.source
            )
            break
    # (before the quickstart's last cell, its %spmd stop: after it, cells run in the notebook)
    stop = next((i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and c.source.strip() == "%spmd stop"), len(nb.cells))
    nb.cells[stop:stop] = [nbformat.v4.new_code_cell(CHECK),
                           nbformat.v4.new_code_cell("%spmd status")]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "quickstart-gpu.ipynb"
        nbformat.write(nb, str(path))
        t0 = time.perf_counter()
        done = execute(path, timeout=600)
        seconds = time.perf_counter() - t0
    texts = [cell_text(c) for c in done.cells if c.cell_type == "code"]
    for text in texts:
        print(text)
    check = next(cell_text(c) for c in done.cells if c.source == CHECK)
    seen = re.findall(r"\[rank (\d+)\] (\S+) \['gpu'\]", check)
    ok = len(seen) == n and len({g for _, g in seen}) == n and f"[{n}.]" in check
    print(f"{n} ranks, one GPU each: {'ok' if ok else 'FAILED'}; the notebook took {seconds:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
