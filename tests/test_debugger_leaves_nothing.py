"""JupyterLab's debugger turned off leaves nothing on the ranks: no socket listening for a
debugger, no process started for it, no cell file in the notebook's cell folder; turned on
again it works as the first time. And a cluster stopped with the debugger on leaves no cell
file either. Driven over the debug protocol as JupyterLab drives it, against the SPMD kernel
with 2 real ranks (tests/test_visual_debugger.py has the protocol's helpers).

Each test starts its own kernel.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest
from conftest import kernel_stream, spmd_kernel
from test_visual_debugger import CELL, debug, paused, reply_to, stop_at

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("spmd_kernelspec")]

START = {"clientID": "test-client", "clientName": "testClient", "adapterID": "",
         "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
         "supportsVariableType": True, "supportsVariablePaging": True, "locale": "en"}


def rank_processes(kc) -> dict[int, psutil.Process]:
    reply, text = kernel_stream(kc, "import os\nprint(os.getpid())")
    assert reply["content"]["status"] == "ok", text
    return {int(r): psutil.Process(int(pid))
            for r, pid in re.findall(r"\[rank (\d)\] (\d+)", text)}


def what_they_hold(ranks: dict[int, psutil.Process]) -> dict[int, tuple]:
    """Each rank's listening TCP ports and child processes."""
    return {r: (sorted(c.laddr.port for c in p.net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN),
                sorted(c.pid for c in p.children(recursive=True)))
            for r, p in ranks.items()}


def busy_seconds(ranks: dict[int, psutil.Process], seconds: float) -> float:
    """The most CPU seconds one idle rank spends in ``seconds``."""
    before = {r: sum(p.cpu_times()[:2]) for r, p in ranks.items()}
    time.sleep(seconds)
    return max(sum(p.cpu_times()[:2]) - before[r] for r, p in ranks.items())


def turn_on(kc) -> str:
    """JupyterLab's start sequence; the cell folder it names."""
    assert debug(kc, "initialize", START)["success"]
    assert debug(kc, "attach", {})["success"]
    assert debug(kc, "setExceptionBreakpoints", {"filters": []})["success"]
    return debug(kc, "debugInfo")["body"]["tmpFilePrefix"].rstrip("/")


def stop_and_go_on(kc) -> str:
    """A cell that stops at its breakpoint on both ranks, then goes on: its file's path."""
    path, msg_id, _ = stop_at(kc, CELL, 4)
    paused(kc, 2)
    debug(kc, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})
    for thread in debug(kc, "debugInfo")["body"]["stoppedThreads"]:
        debug(kc, "continue", {"threadId": thread})
    reply, text = reply_to(kc, msg_id)
    assert reply["content"]["status"] == "ok", text
    return path


def test_the_debugger_turned_off_leaves_nothing_and_turns_on_again():
    with spmd_kernel() as (km, kc):
        ranks = rank_processes(kc)
        before = what_they_hold(ranks)
        folder = turn_on(kc)
        on = what_they_hold(ranks)
        assert all(set(on[r][0]) - set(before[r][0]) for r in ranks), (before, on)
        path = stop_and_go_on(kc)
        assert os.path.exists(path)  # (dumpCell's, on this host)

        assert debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})[
            "success"]
        assert what_they_hold(ranks) == before  # no listening socket, no process left
        assert not os.path.exists(folder), os.listdir(folder)
        assert busy_seconds(ranks, 2.0) < 0.5  # (nothing of the debugger's left running)

        # on again: a breakpoint stops both ranks as the first time
        turn_on(kc)
        assert stop_and_go_on(kc) == path
        debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})
        assert what_they_hold(ranks) == before
        assert not os.path.exists(folder)
        # and a cell after it runs untraced, as before the debugger came
        reply, text = kernel_stream(kc, "import sys\nprint(sys.gettrace())")
        assert text == "[ranks 0-1] None\n", text


def test_a_cluster_stopped_with_the_debugger_on_leaves_no_cell_file():
    with spmd_kernel() as (km, kc):
        ranks = rank_processes(kc)
        folder = turn_on(kc)
        stop_and_go_on(kc)
        assert os.listdir(folder)
        reply, text = kernel_stream(kc, "%spmd stop")
        assert reply["content"]["status"] == "ok", text
        _, alive = psutil.wait_procs(list(ranks.values()), timeout=30)
        assert not alive
        deadline = time.monotonic() + 10
        while os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(folder), os.listdir(folder)
