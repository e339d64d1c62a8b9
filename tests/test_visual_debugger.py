"""JupyterLab's debugger on the ranks, driven over the debug protocol as JupyterLab drives it
(``debug_request`` on the control channel, ``debug_event`` on IOPub), against the SPMD kernel
with 2 real ranks running real debugpy. The request sequence follows ipykernel's own
tests/test_debugger.py; the cell path is the one JupyterLab computes itself.

Each test starts its own kernel and leaves no process and no paused rank behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import re
import signal
import time

import pytest
from conftest import SPMD_KERNEL, kernel_stream, spmd_kernel
from ipykernel.compiler import murmur2_x86  # (JupyterLab's hash; the browser test checks its)

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("spmd_kernelspec")]

CELL = """import jax
rank = jax.process_index()
x = 1
y = rank * 10 + 5
print('after', y)"""

_seq = itertools.count(1)


def debug(kc, command: str, arguments: dict | None = None, timeout: float = 60) -> dict:
    """One debug request, and its reply's content (the events that come meanwhile are kept
    for ``event``)."""
    msg = kc.session.msg("debug_request", {"type": "request", "seq": next(_seq),
                                           "command": command, "arguments": arguments or {}})
    kc.control_channel.send(msg)
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_control_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]


def event(kc, name: str, timeout: float = 60) -> dict:
    """The next ``debug_event`` called ``name`` on IOPub (the cells' messages read meanwhile
    are kept for ``reply_to``)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["msg_type"] != "debug_event":
            kc.spmd_kept = [*getattr(kc, "spmd_kept", []), msg]
        elif msg["content"]["event"] == name:
            return msg["content"]


def reply_to(kc, msg_id: str, timeout: float = 120) -> tuple[dict, str]:
    """The execute reply of ``msg_id`` and the text its cell printed."""
    deadline = time.monotonic() + timeout
    text = []
    kept, kc.spmd_kept = getattr(kc, "spmd_kept", []), []
    kc.spmd_events = []  # (the debug events that came meanwhile)
    while True:
        msg = kept.pop(0) if kept else kc.get_iopub_msg(
            timeout=max(0.1, deadline - time.monotonic()))
        if msg["msg_type"] == "debug_event":
            kc.spmd_events.append(msg["content"])
        if msg["parent_header"].get("msg_id") == msg_id:
            if msg["msg_type"] == "stream":
                text.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    return kc.get_shell_msg(timeout=timeout), "".join(text)


@contextlib.contextmanager
def debugged_kernel(name: str = SPMD_KERNEL):
    """The SPMD kernel (the kernelspec ``name``) with its 2 ranks up and JupyterLab's start
    sequence done."""
    with spmd_kernel(name) as (km, kc):
        reply, _ = kernel_stream(kc, "import jax")  # (waits for the kernel's own cluster)
        assert reply["content"]["status"] == "ok", reply["content"]
        info = debug(kc, "debugInfo")
        assert info["success"] and not info["body"]["isStarted"]
        r = debug(kc, "initialize", {"clientID": "test-client", "clientName": "testClient",
                                     "adapterID": "", "pathFormat": "path",
                                     "linesStartAt1": True, "columnsStartAt1": True,
                                     "supportsVariableType": True,
                                     "supportsVariablePaging": True, "locale": "en"})
        assert r["success"], r
        assert debug(kc, "attach", {})["success"]
        r = debug(kc, "setExceptionBreakpoints", {"filters": []})
        assert r["success"], r
        yield km, kc


def debugger_waits(kc, quick: float) -> None:
    """The kernel's debugger waits ``quick`` seconds (not QUICK_SECONDS' 10) for a rank's
    reply to a request that computes nothing: set in the kernel's own process."""
    reply, text = kernel_stream(kc, f"%%local\nimport spmd.kernel.debugger\n"
                                    f"spmd.kernel.debugger.QUICK_SECONDS = {quick}")
    assert reply["content"]["status"] == "ok", text


def cell_path(kc, code: str) -> str:
    info = debug(kc, "debugInfo")["body"]
    return (info["tmpFilePrefix"] + str(murmur2_x86(code, info["hashSeed"]))
            + info["tmpFileSuffix"])


def stop_at(kc, code: str, line: int) -> tuple[str, str, dict]:
    """dumpCell, a breakpoint at ``line``, and the cell sent: (its path, its msg_id, the first
    ``stopped`` event)."""
    dumped = debug(kc, "dumpCell", {"code": code})
    path = dumped["body"]["sourcePath"]
    assert path == cell_path(kc, code)  # JupyterLab's own computation names the same file
    r = debug(kc, "setBreakpoints", {"source": {"path": path}, "sourceModified": False,
                                     "breakpoints": [{"line": line}]})
    assert r["success"] and r["body"]["breakpoints"][0]["verified"], r
    assert debug(kc, "configurationDone")["success"]
    msg_id = kc.execute(code)
    return path, msg_id, event(kc, "stopped")


def show(kc, rank: int, timeout: float = 30, panel: bool = False) -> dict:
    """``%rank N`` in the Evaluate box (``panel``: a click on rank N in the extension's Ranks
    panel, its ``spmdShowRank``), once rank N has stopped: its ``stopped`` event."""
    deadline = time.monotonic() + timeout
    while True:
        said = (debug(kc, "spmdShowRank", {"rank": rank}) if panel else
                debug(kc, "evaluate", {"expression": f"%rank {rank}", "context": "repl"}))
        assert said["success"], said
        if said["body"]["result"] == f"showing rank {rank}":
            return event(kc, "stopped")
        assert "is not paused" in said["body"]["result"], said
        assert time.monotonic() < deadline, said
        time.sleep(0.1)


def paused(kc, count: int, timeout: float = 30) -> list[int]:
    """The stopped threads, once ``count`` ranks are paused."""
    deadline = time.monotonic() + timeout
    while True:
        stopped = debug(kc, "debugInfo")["body"]["stoppedThreads"]
        if len(stopped) >= count:
            return stopped
        assert time.monotonic() < deadline, stopped
        time.sleep(0.1)


def rank_of(kc, thread_id: int) -> int:
    threads = debug(kc, "threads")["body"]["threads"]
    name = next(t["name"] for t in threads if t["id"] == thread_id)
    return int(name.split(":")[0].removeprefix("rank "))


def value_of(kc, thread_id: int, name: str) -> str:
    frames = debug(kc, "stackTrace", {"threadId": thread_id})["body"]["stackFrames"]
    scopes = debug(kc, "scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    ref = next(s["variablesReference"] for s in scopes if s["name"] in ("Locals", "Globals"))
    variables = debug(kc, "variables", {"variablesReference": ref})["body"]["variables"]
    return next(v["value"] for v in variables if v["name"] == name)


def test_breakpoints_stop_every_rank_and_show_each_ranks_values():
    with debugged_kernel() as (km, kc):
        assert "debugger" in kc.kernel_info(reply=True)["content"]["supported_features"]
        path, msg_id, stopped = stop_at(kc, CELL, 4)
        assert stopped["body"]["reason"] == "breakpoint"
        first = stopped["body"]["threadId"]
        threads = debug(kc, "threads")["body"]["threads"]
        names = [t["name"] for t in threads]
        assert any(n.startswith("rank 0: MainThread") for n in names), names
        assert any(n.startswith("rank 1: MainThread") for n in names), names
        assert len({t["id"] for t in threads}) == len(threads)  # (no id names two threads)
        frames = debug(kc, "stackTrace", {"threadId": first})["body"]["stackFrames"]
        assert frames[0]["line"] == 4 and frames[0]["source"]["path"] == path
        # rank 1 is paused too: `%rank 1` in the Evaluate box shows it
        mains = {int(n.split(":")[0][5:]): t["id"] for n, t in zip(names, threads)
                 if n.endswith("MainThread")}
        assert show(kc, 1)["body"]["threadId"] == mains[1]
        # y is not assigned yet at line 4: step over it on every rank, once both are paused
        # (a rank that reaches the breakpoint after the step stops there, and is shown then)
        paused(kc, 2)
        assert debug(kc, "next", {"threadId": mains[1]})["success"]
        again = event(kc, "stopped")
        assert again["body"]["reason"] == "step"
        values = {rank_of(kc, again["body"]["threadId"]):
                  value_of(kc, again["body"]["threadId"], "y")}
        other = 1 - next(iter(values))
        shown = show(kc, other, panel=True)["body"]
        thread = shown["threadId"]
        assert rank_of(kc, thread) == other and shown["spmdRank"] == other
        values[other] = value_of(kc, thread, "y")
        assert values == {0: "5", 1: "15"}
        frames = debug(kc, "stackTrace", {"threadId": mains[1]})["body"]["stackFrames"]
        evaluated = debug(kc, "evaluate", {"expression": "y * 2", "frameId": frames[0]["id"],
                                           "context": "repl"})
        assert evaluated["body"]["result"] == "30"
        # continue: every rank finishes the cell
        assert debug(kc, "continue", {"threadId": mains[0]})["success"]
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert "[rank 0] after 5" in text and "[rank 1] after 15" in text
        # the breakpoints cleared, the same cell runs through
        r = debug(kc, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})
        assert r["success"] and not debug(kc, "debugInfo")["body"]["breakpoints"]
        reply, text = kernel_stream(kc, CELL, timeout=60)
        assert reply["content"]["status"] == "ok" and "after 15" in text
        assert debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})["success"]
        reply, text = kernel_stream(kc, "print(rank)")
        assert text == "[rank 0] 0\n[rank 1] 1\n"


def test_no_cluster_no_debugger_one_sentence():
    with spmd_kernel() as (km, kc):
        reply, _ = kernel_stream(kc, "%spmd stop")
        assert reply["content"]["status"] == "ok", reply["content"]
        r = debug(kc, "initialize", {"clientID": "test"})
        assert not r["success"] and "No cluster runs" in r["message"]
        assert "kernel subshells" not in kc.kernel_info(reply=True)["content"][
            "supported_features"]


def test_interrupt_while_ranks_are_paused_ends_the_pause_and_the_cell():
    with debugged_kernel() as (km, kc):
        _, msg_id, _ = stop_at(kc, CELL + "\nimport time; time.sleep(60)", 4)
        paused(kc, 2)
        km.interrupt_kernel()
        reply, text = reply_to(kc, msg_id, timeout=60)
        # JupyterLab is told, without asking, that the paused ranks went on
        assert any(e["event"] == "continued" for e in kc.spmd_events), kc.spmd_events
        assert reply["content"]["status"] == "error"
        report = "\n".join(reply["content"]["traceback"])
        assert "Ranks 0-1 were paused in the debugger: the interrupt let them go on" in report
        # (raised in the cell: the pause ended first, and nobody is left stuck)
        assert "KeyboardInterrupt" in text + report, text + report
        assert "did not respond" not in report, report
        assert not debug(kc, "debugInfo")["body"]["stoppedThreads"]
        reply, text = kernel_stream(kc, "%spmd restart")
        assert reply["content"]["status"] == "ok", text
        reply, text = kernel_stream(kc, "print('fine')")
        assert text == "[ranks 0-1] fine\n"


def test_a_restart_while_ranks_are_paused_leaves_none_paused_and_breakpoints_work_again():
    with debugged_kernel() as (km, kc):
        path, msg_id, _ = stop_at(kc, CELL, 4)
        # a front end's restart is a shutdown of the cell: %spmd restart needs the main
        # thread, which waits in the cell; Interrupt first, as a person would
        km.interrupt_kernel()
        reply_to(kc, msg_id, timeout=60)
        reply, text = kernel_stream(kc, "%spmd restart")
        assert reply["content"]["status"] == "ok", text
        assert not debug(kc, "debugInfo")["body"]["stoppedThreads"]
        # the new ranks get the debugger and its breakpoint before the next cell
        msg_id = kc.execute(CELL)
        stopped = event(kc, "stopped")
        frames = debug(kc, "stackTrace", {"threadId": stopped["body"]["threadId"]})
        assert frames["body"]["stackFrames"][0]["source"]["path"] == path
        assert debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})["success"]
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok", reply["content"]


def test_breakpoint_stops_in_the_visual_debugger_while_it_is_attached():
    with debugged_kernel() as (km, kc):
        assert debug(kc, "configurationDone")["success"]
        code = "z = 7\nbreakpoint()\nprint('z is', z)"
        msg_id = kc.execute(code)
        stopped = event(kc, "stopped")
        frames = debug(kc, "stackTrace", {"threadId": stopped["body"]["threadId"]})
        top = frames["body"]["stackFrames"][0]
        assert top["source"]["path"] == cell_path(kc, code), top
        show(kc, 1 - rank_of(kc, stopped["body"]["threadId"]))  # (both ranks stopped there)
        assert debug(kc, "continue", {"threadId": stopped["body"]["threadId"]})["success"]
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok" and "z is 7" in text


@pytest.fixture
def short_grace():
    """An SPMD kernelspec whose cluster's watchdog grace is 0.5 s (the default's 2 s, set
    shorter by the option that sets it: a grace is a grace)."""
    from spmd.kernel.kernelspec import install, remove

    install("spmd-short-grace", user=True, processes=2, cluster="--grace 0.5")
    yield "spmd-short-grace"
    remove("spmd-short-grace")


def test_a_rank_paused_in_the_debugger_is_not_diverged(short_grace):
    """Rank 1 stops at a breakpoint that rank 0 never reaches; rank 0 ends the cell. Past the
    watchdog's grace (0.5 s here) nothing is reported: a person is debugging rank 1."""
    with debugged_kernel(short_grace) as (km, kc):
        code = "import jax\nrank = jax.process_index()\nif rank == 1:\n    w = 'one'\nprint('done')"
        _, msg_id, stopped = stop_at(kc, code, 4)
        time.sleep(1.5)  # (past two graces, and a third)
        with pytest.raises(queue.Empty):  # the cell has not ended: no reply yet
            kc.get_shell_msg(timeout=0.5)
        assert rank_of(kc, stopped["body"]["threadId"]) == 1
        assert debug(kc, "continue", {"threadId": stopped["body"]["threadId"]})["success"]
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok", text
        assert text == "[ranks 0-1] done\n" or sorted(text.splitlines()) == [
            "[rank 0] done", "[rank 1] done"]


def rank_pids(kc) -> dict[int, int]:
    reply, text = kernel_stream(kc, "import os\nprint(os.getpid())")
    assert reply["content"]["status"] == "ok", text
    return {int(r): int(p) for r, p in re.findall(r"\[rank (\d)\] (\d+)", text)}


def test_a_rank_that_cannot_answer_holds_a_burst_of_requests_once():
    """Rank 1 is stopped (SIGSTOP) while both ranks are paused: JupyterLab's burst of requests
    waits for it once, each answered with one sentence; a step sent to no rank forgets none."""
    with debugged_kernel() as (km, kc):
        # (2 s, not 10: the burst is over before the controller's 3 s of missed heartbeats
        # drop rank 1's engine, so it is the debugger's own leaving out that answers)
        quick = 2.0
        debugger_waits(kc, quick)
        pids = rank_pids(kc)
        # (a cell that goes on after the pause: the interrupt at the end lands in its sleep)
        _, msg_id, _ = stop_at(kc, CELL + "\nimport time; time.sleep(60)", 4)
        paused(kc, 2)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            said = [debug(kc, "threads"), debug(kc, "threads"),
                    debug(kc, "continue", {"threadId": paused(kc, 2)[0]})]
            burst = time.monotonic() - t0
            for r in said:
                # (the controller drops its engine after 3 s of missed heartbeats)
                assert not r["success"] and re.match(
                    r"Rank 1 (did not answer the debugger|has ended)", r["message"]), r
                assert "\n" not in r["message"] and r["message"].count(": ") <= 1, r
            # (each request had waited for it: 3 waits of ``quick`` here)
            assert burst < 2.5 * quick, burst
            assert len(paused(kc, 2)) == 2  # (the continue told no rank: both still paused)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        km.interrupt_kernel()
        reply, text = reply_to(kc, msg_id, timeout=60)
        report = "\n".join(reply["content"]["traceback"])
        assert "Ranks 0-1 were paused in the debugger: the interrupt let them go on" in report


def test_a_step_that_cannot_reach_a_rank_leaves_the_others_known_as_paused():
    """Rank 1 stops first, then its engine is lost to the controller (stopped past its
    heartbeats): a continue cannot reach it, and rank 0, never told to go on, is still
    known as paused (an interrupt can then let it go)."""
    with debugged_kernel() as (km, kc):
        # (the first request waits 2 s for rank 1, not 10; then each finds it left out, until
        # the controller has let its engine go)
        debugger_waits(kc, 2.0)
        pids = rank_pids(kc)
        code = ("import jax, time\nrank = jax.process_index()\ntime.sleep(1.5 * (1 - rank))\n"
                "y = rank * 10 + 5\nprint('after', y)")
        _, msg_id, stopped = stop_at(kc, code, 4)
        assert rank_of(kc, stopped["body"]["threadId"]) == 1
        paused(kc, 2)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while True:  # (until the controller has let rank 1's engine go)
                said = debug(kc, "threads")
                if not said["success"] and re.search(r"(?i)rank 1 (is gone|has ended)",
                                                     said["message"]):
                    break
                assert time.monotonic() < deadline, said
                time.sleep(0.1)
            said = debug(kc, "continue", {"threadId": stopped["body"]["threadId"]})
            assert not said["success"], said
            # (a step that failed at rank 1 had forgotten rank 0 without telling it to go on)
            assert len(paused(kc, 2, timeout=5)) == 2
        finally:
            os.kill(pids[1], signal.SIGCONT)


def test_after_a_restart_a_request_and_the_first_cell_wait_for_the_debuggers_set_up():
    """After a restart, a debug request and the first cell come at once: the cell runs once
    the new ranks have debugpy and the breakpoints, and stops at them."""
    with debugged_kernel() as (km, kc):
        path, msg_id, _ = stop_at(kc, CELL, 4)
        assert debug(kc, "continue", {"threadId": paused(kc, 2)[0]})["success"]
        reply_to(kc, msg_id)
        reply, text = kernel_stream(kc, "%spmd restart")
        assert reply["content"]["status"] == "ok", text
        request = kc.session.msg("debug_request", {"type": "request", "seq": next(_seq),
                                                   "command": "threads", "arguments": {}})
        kc.control_channel.send(request)  # (the control thread brings the new ranks up)
        msg_id = kc.execute(CELL)
        stopped = event(kc, "stopped", timeout=60)
        frames = debug(kc, "stackTrace", {"threadId": stopped["body"]["threadId"]})
        assert frames["body"]["stackFrames"][0]["source"]["path"] == path
        assert debug(kc, "disconnect", {"restart": False, "terminateDebuggee": False})["success"]
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok", reply["content"]


# (in the kernel's own process: each rank's main thread's trace function between two cells,
# asked by the kernel with an apply, which runs there between cells)
TRACES_BETWEEN_CELLS = (
    "%%local\nimport sys\n_magics = get_ipython().kernel.spmd\n"
    "_session = _magics.session or _magics.pending.session\n"
    "print([_session.call(r.rank, sys.gettrace, timeout=30) for r in _session.ranks])")


def test_the_ranks_trace_the_cells_code_not_their_way_to_it():
    """While the debugger is on, a rank's main thread runs debugpy's tracing in a cell's code
    (breakpoints, and a function an earlier cell defined, stop there), and not between cells:
    the rank's own way to a cell and back is not traced."""
    with debugged_kernel() as (km, kc):
        reply, text = kernel_stream(kc, "import sys\ndef f():\n    return 7\n"
                                        "print(sys.gettrace() is not None)")
        assert text == "[ranks 0-1] True\n", text
        reply, text = kernel_stream(kc, TRACES_BETWEEN_CELLS)
        assert text == "[None, None]\n", text
        # a breakpoint in a function an earlier cell defined stops a later cell's call
        code = "import sys\ndef g(x):\n    y = x + 1\n    return y\n"
        assert kernel_stream(kc, code)[0]["content"]["status"] == "ok"
        path = debug(kc, "dumpCell", {"code": code})["body"]["sourcePath"]
        assert debug(kc, "setBreakpoints", {"source": {"path": path},
                                            "breakpoints": [{"line": 4}]})["success"]
        msg_id = kc.execute("print(g(1))")
        stopped = event(kc, "stopped")
        frames = debug(kc, "stackTrace", {"threadId": stopped["body"]["threadId"]})[
            "body"]["stackFrames"]
        assert frames[0]["line"] == 4 and frames[0]["source"]["path"] == path, frames[0]
        paused(kc, 2)
        debug(kc, "setBreakpoints", {"source": {"path": path}, "breakpoints": []})
        for thread in debug(kc, "debugInfo")["body"]["stoppedThreads"]:
            debug(kc, "continue", {"threadId": thread})
        reply, text = reply_to(kc, msg_id)
        assert reply["content"]["status"] == "ok" and text == "[ranks 0-1] 2\n", text
        reply, text = kernel_stream(kc, TRACES_BETWEEN_CELLS)
        assert text == "[None, None]\n", text
