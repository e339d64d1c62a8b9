"""JupyterLab's debugger on 4 ranks, driven as JupyterLab drives it (debug_request on the
control channel): a trivial cell's round trip with the debugger attached and no breakpoint,
beside the same cell detached, and before the debugger was ever on, in one kernel; and the time from a cell's execute_request to
the ``stopped`` event of its breakpoint.

``python -m benchmarks.debugger`` runs it alone; ``make bench`` runs it with the rest.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time

from jupyter_client.manager import start_new_kernel

from spmd.kernel.kernelspec import install

_seq = itertools.count(1)
STOP_CELL = "a = 1\nb = a + 1\nc = b + 1"


def _debug(kc, command: str, arguments: dict | None = None) -> dict:
    msg = kc.session.msg("debug_request", {"type": "request", "seq": next(_seq),
                                           "command": command, "arguments": arguments or {}})
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]


def _cell(kc, code: str) -> float:
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"benchmark cell failed: {code!r}")
    return time.perf_counter() - t0


def _to_stopped(kc) -> float:
    """Seconds from sending a cell with a breakpoint to its first ``stopped`` event."""
    path = _debug(kc, "dumpCell", {"code": STOP_CELL})["body"]["sourcePath"]
    _debug(kc, "setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 2}]})
    while True:  # (what earlier cells left on IOPub, a late rank's stop among it)
        try:
            kc.get_iopub_msg(timeout=0.2)
        except Exception:  # (queue.Empty)
            break
    t0 = time.perf_counter()
    msg_id = kc.execute(STOP_CELL)
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "debug_event" and msg["content"]["event"] == "stopped":
            took = time.perf_counter() - t0
            thread = msg["content"]["body"]["threadId"]
            break
    _debug(kc, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})
    _debug(kc, "continue", {"threadId": thread})
    while True:  # (until the cell's reply; a rank that stopped after the continue goes on)
        try:
            reply = kc.get_shell_msg(timeout=0.5)
        except Exception:  # (queue.Empty)
            for thread in _debug(kc, "debugInfo")["body"]["stoppedThreads"]:
                _debug(kc, "continue", {"threadId": thread})
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    return took


@contextlib.contextmanager
def jupyter_data_in(folder: str):
    """Jupyter's data and search path set to ``folder`` inside the block (where a benchmark's
    own kernelspec is installed, so that the user's own kernels are never touched)."""
    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "JUPYTER_DATA_DIR")}
    os.environ["JUPYTER_PATH"] = os.environ["JUPYTER_DATA_DIR"] = folder
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(cells: int = 100, stops: int = 10) -> dict[str, list[float]]:
    """{figure: samples} for a 4-rank SPMD kernel (its kernelspec in a temporary folder)."""
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="spmd-bench-debugger-") as folder, \
            jupyter_data_in(folder):
        install("spmd-bench-debugger", user=True, processes=4)
        km, kc = start_new_kernel(kernel_name="spmd-bench-debugger")
        try:
            _cell(kc, "import jax")
            for _ in range(5):
                _cell(kc, "x = 1")
            # before the debugger ever came: ranks with no debugpy loaded
            for _ in range(cells // 5):
                samples.setdefault("debugger_cell_n4/never_attached", []).append(
                    _cell(kc, "x = 1"))
            # detached (debugpy loaded in the ranks, no client) and attached alternate in
            # blocks, so that drift hits both alike
            blocks = 5
            _debug(kc, "initialize", {"clientID": "bench", "adapterID": "",
                                      "pathFormat": "path", "linesStartAt1": True,
                                      "columnsStartAt1": True})
            _debug(kc, "attach", {})
            for _ in range(blocks):
                _debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})
                for _ in range(cells // blocks):
                    samples.setdefault("debugger_cell_n4/detached", []).append(
                        _cell(kc, "x = 1"))
                _debug(kc, "initialize", {"clientID": "bench", "adapterID": "",
                                          "pathFormat": "path", "linesStartAt1": True,
                                          "columnsStartAt1": True})
                _debug(kc, "attach", {})
                for _ in range(cells // blocks):
                    samples.setdefault("debugger_cell_n4/attached", []).append(
                        _cell(kc, "x = 1"))
            for _ in range(stops):
                samples.setdefault("debugger_stop_n4/execute_to_stopped", []).append(
                    _to_stopped(kc))
            _debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    return samples


if __name__ == "__main__":
    found = measure(cells=int(sys.argv[1]) if len(sys.argv) > 1 else 100)
    for name, xs in found.items():
        print(f"{name}: median {statistics.median(xs) * 1000:.1f} ms "
              f"({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f}), {len(xs)} runs")
    attached = statistics.median(found["debugger_cell_n4/attached"])
    detached = statistics.median(found["debugger_cell_n4/detached"])
    print(f"attached / detached: {attached / detached:.2f}")
