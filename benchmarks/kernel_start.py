"""The SPMD kernel's time from launch to the first cell's result, beside a plain Python kernel
that runs ``%load_ext spmd`` + ``%spmd start`` + the same cell (both 4 ranks x 2 devices).

The kernelspec is installed into a temporary Jupyter folder, never the user's.
"""

from __future__ import annotations

import os
import tempfile
import time

from jupyter_client.manager import KernelManager

from spmd.kernel.kernelspec import install

START = "%spmd start -n 4 -d 2"


def _first_result(kernel_name: str, cells: list[str]) -> float:
    """Seconds from launching the kernel to the reply of its last cell."""
    t0 = time.perf_counter()
    km = KernelManager(kernel_name=kernel_name)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        for code in cells:
            reply = kc.execute_interactive(code, timeout=300, output_hook=lambda msg: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"benchmark cell failed in {kernel_name}: {code!r}")
        return time.perf_counter() - t0
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


class KernelBench:
    """Installs a 4 x 2 SPMD kernelspec for the benchmark's life."""

    def __enter__(self) -> KernelBench:
        self._dir = tempfile.TemporaryDirectory(prefix="spmd-bench-jupyter-")
        self._env = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JUPYTER_DATA_DIR")}
        os.environ["JUPYTER_PATH"] = os.environ["JUPYTER_DATA_DIR"] = self._dir.name
        install("spmd-bench", user=True, processes=4, devices_per_process=2)
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._dir.cleanup()

    def spmd_kernel(self, cell: str) -> float:
        return _first_result("spmd-bench", [cell])

    def magic_in_python3(self, cell: str) -> float:
        return _first_result("python3", [f"%load_ext spmd\n{START}", cell])
