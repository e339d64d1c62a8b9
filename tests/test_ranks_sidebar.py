"""The Ranks sidebar's side in the SPMD kernel (spmd/kernel/sidebar.py), driven as the
JupyterLab extension drives it: a comm of target ``spmd.ranks`` opened to a real SPMD kernel
with 4 ranks, whose messages say each rank's host, pid and state, and, in a hang, which rank
blocks the others; and the clicks, ``debug_request``s on the control channel that answer
while the cell hangs.

4 ranks: the point is one rank holding three back. The rest is on hand-made data (no
processes): which ranks block the others, what is sent when, and that nothing the sidebar
does can fail a cell or a click.
"""

from __future__ import annotations

import logging
import re
import time
import types
import uuid

import pytest
from conftest import kernel_stream, spmd_kernel

from spmd.cluster.lockstep.where import Frame, Stack
from spmd.kernel.sidebar import RanksSidebar, blockers, line_of

pytestmark = pytest.mark.timeout(240)

KERNEL = "spmd-test-sidebar"
GATHER = ("import time, jax, jax.numpy as jnp\n"
          "from jax.experimental import multihost_utils\n"
          "def gather():\n"
          "    return multihost_utils.process_allgather(jnp.ones(1))\n"
          "gather()\n")  # (compiled once here: the hang below waits, it does not compile)
HANG = ("if jax.process_index() == 1:\n"
        "    time.sleep(120)\n"
        "gather()\n")
# (the others finish at once; rank 1 is waited for, as a rank behind, not diverged)
BEHIND = "time.sleep(3 if jax.process_index() == 1 else 0)"


@pytest.fixture
def spmd_kernelspec_4(spmd_kernelspec):
    from spmd.kernel.kernelspec import install

    install(KERNEL, user=True, processes=4)
    yield KERNEL


def open_sidebar(kc) -> str:
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {
        "comm_id": comm_id, "target_name": "spmd.ranks", "data": {}}))
    return comm_id


def states(kc, comm_id: str, timeout: float):
    """The sidebar's messages as they come, until ``timeout``: (when, its state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.1)
        except Exception:  # (queue.Empty)
            continue
        if msg["msg_type"] == "comm_msg" and msg["content"]["comm_id"] == comm_id:
            yield time.monotonic(), msg["content"]["data"]


def _until(states, done):
    """The sidebar's states up to the first that is ``done`` (that one too)."""
    for _, state in states:
        yield state
        if done(state):
            return


def click(kc, command: str, rank: int) -> str:
    msg = kc.session.msg("debug_request", {"type": "request", "seq": 1, "command": command,
                                           "arguments": {"rank": rank}})
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["content"]["success"], reply["content"]
            return reply["content"]["body"]["result"]


@pytest.mark.slow
@pytest.mark.usefixtures("spmd_kernelspec_4")
def test_the_sidebar_names_the_rank_that_blocks_the_others_and_shows_its_stack():
    with spmd_kernel(KERNEL) as (km, kc):
        reply, text = kernel_stream(kc, GATHER + "import os\nprint(os.getpid())")
        assert reply["content"]["status"] == "ok", text
        pids = {int(r): int(p) for r, p in re.findall(r"\[rank (\d)\] (\d+)", text)}
        comm_id = open_sidebar(kc)
        _, first = next(states(kc, comm_id, 30))
        assert first["cluster"] == "4 ranks (jax)" and first["cell"] == "idle"
        assert [(r["rank"], r["pid"], r["state"]) for r in first["ranks"]] == [
            (r, pids[r], "idle") for r in range(4)]
        assert all(r["host"] and r["devices"] == 1 for r in first["ranks"])

        # a rank still in the cell after the others finished it: named as the panel's straggler
        kc.execute(BEHIND)
        said = list(_until(states(kc, comm_id, 60), lambda state: state["cell"] == "idle"))
        behind = [state for state in said if state["blocking"]]
        assert behind and behind[0]["blocking"] == [1], said
        assert behind[0]["why"] == "ranks 0,2-3 have finished the cell and wait for it", said
        assert said[-1]["blocking"] == [] and said[-1]["cell"] == "idle", said

        sent = time.monotonic()
        msg_id = kc.execute(HANG)
        named = None
        for at, state in states(kc, comm_id, 60):
            if state["blocking"]:
                named = at - sent, state
                break
        assert named is not None, "the sidebar never named a blocking rank"
        seconds, state = named
        assert state["blocking"] == [1], state
        assert state["why"].startswith("ranks 0,2-3 wait in "), state
        rows = {r["rank"]: r for r in state["ranks"]}
        assert rows[1]["line"] == "cell line 2: time.sleep(120)", rows[1]
        assert all(rows[r]["state"] == "busy" for r in range(4))
        print(f"the blocking rank named {seconds:.2f} s after the cell was sent")
        # within 2 s of the cell (its collective was compiled before: the others wait at once)
        assert seconds < 2.0, seconds

        # a click, while the cell hangs: rank 1's stack, and its log
        stack = click(kc, "spmdRankStack", 1)
        assert "time.sleep(120)" in stack, stack
        assert click(kc, "spmdRankLog", 1)  # (the first cell's pid, at least)
        assert click(kc, "spmdRankStack", 7) == "This cluster has ranks 0-3."

        km.interrupt_kernel()
        for _, state in states(kc, comm_id, 60):
            if state["cell"] == "idle":
                break
        assert state["cell"] == "idle" and state["blocking"] == [], state
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"

        # a restart (a command, not a cell on the ranks): the sidebar shows the new ranks
        kc.execute("%spmd restart")
        for _, state in states(kc, comm_id, 120):
            now = {r["rank"]: r["pid"] for r in state["ranks"]}
            if len(now) == 4 and set(now.values()).isdisjoint(pids.values()):
                break
        else:
            raise AssertionError("the sidebar never showed the restarted ranks")


# -- on hand-made data ----------------------------------------------------------------------

JAX = "/venv/lib/python3.12/site-packages/jax/_src/array.py"
COMPILER = "/venv/lib/python3.12/site-packages/jax/_src/compiler.py"
CELL = "/tmp/ipykernel_42/123.py"


def _rows(*states: str, late: float = 3.0) -> list[dict]:
    """Rows of a cell that has run 5 s, its finished ranks done ``late`` s ago."""
    return [{"rank": r, "state": state, "seconds": 5.0 - late if state in ("done", "error")
             else 5.0} for r, state in enumerate(states)]


def _in_jax(rank: int, *files: str) -> Stack:
    return Stack(rank, [Frame(CELL, 4, "<module>", "gather()"),
                        *(Frame(f, 10, "call") for f in files), Frame(JAX, 623, "_value")])


def _in_cell(rank: int) -> Stack:
    return Stack(rank, [Frame(CELL, 2, "<module>", "time.sleep(120)")])


def test_a_rank_outside_jax_blocks_the_others_waiting_inside_a_call():
    stacks = {0: _in_jax(0), 1: _in_cell(1), 2: _in_jax(2), 3: _in_jax(3)}
    assert blockers(_rows("busy", "busy", "busy", "busy"), stacks) == (
        [1], "ranks 0,2-3 wait in _value, jax/_src/array.py line 623")
    # (a rank at a prompt holds them back as much)
    assert blockers(_rows("busy", "input", "busy", "busy"), stacks)[0] == [1]
    # ranks that compile work, and ranks all outside jax or all inside it block no one
    building = {r: _in_jax(r, COMPILER) for r in (0, 2, 3)}
    assert blockers(_rows("busy", "busy", "busy", "busy"), {**building, 1: _in_cell(1)}) == (
        [], "")
    assert blockers(_rows("busy", "busy"), {0: _in_cell(0), 1: _in_cell(1)}) == ([], "")
    assert blockers(_rows("busy", "busy"), {0: _in_jax(0), 1: _in_jax(1)}) == ([], "")
    # (no look yet: nothing is said)
    assert blockers(_rows("busy", "busy"), {}) == ([], "")
    # between cells
    assert blockers(_rows("idle", "idle"), {}) == ([], "")


def test_the_line_a_rank_is_on():
    assert line_of(_in_cell(1)) == "cell line 2: time.sleep(120)"
    # (in a function that a cell defined: which one, as its line is that cell's)
    in_gather = Stack(0, [Frame(CELL, 3, "<module>", "gather()"),
                          Frame(CELL, 4, "gather", "return process_allgather(x)"),
                          Frame(JAX, 623, "_value")])
    assert line_of(in_gather) == "cell line 4 in gather: return process_allgather(x)"
    assert line_of(Stack(0, [Frame(JAX, 623, "_value")])) == "_value, line 623"
    assert line_of(Stack(0, [])) == ""


def test_ranks_still_in_the_cell_after_others_finished_it_block_them():
    """The live panel's stragglers: named at once, stacks or not."""
    assert blockers(_rows("done", "straggler", "done", "error"), {}) == (
        [1], "ranks 0,2-3 have finished the cell and wait for it")
    assert blockers(_rows("done", "straggler", "debugger"), {}) == (
        [1, 2], "rank 0 has finished the cell and waits for them")
    # ranks not in this cell (%%spmd --ranks) are no one's to wait for
    assert blockers(_rows("done", "idle"), {}) == ([], "")
    # a rank a moment behind is not yet waited for
    assert blockers(_rows("done", "straggler", late=0.2), {}) == ([], "")


class _Comm:
    def __init__(self, fails: bool = False) -> None:
        self.comm_id, self.fails, self.sent = uuid.uuid4().hex, fails, []

    def on_close(self, callback) -> None:
        pass

    def send(self, data) -> None:
        if self.fails:
            raise RuntimeError("the front end went away")
        self.sent.append(data)


def _sidebar(session, caplog) -> RanksSidebar:
    kernel = types.SimpleNamespace(
        comm_manager=types.SimpleNamespace(register_target=lambda target, callback: None),
        log=logging.getLogger("test-sidebar"))
    magics = types.SimpleNamespace(pending=None, session=session)
    caplog.set_level(logging.WARNING, "test-sidebar")
    return RanksSidebar(kernel, magics)


def _state(seconds: float, blocking: list[int]) -> dict:
    return {"cluster": "2 ranks (jax)", "cell": "running", "blocking": blocking, "why": "",
            "ranks": [{"rank": r, "state": "busy", "seconds": seconds, "memory": 1 + r}
                      for r in range(2)]}


def test_what_changes_is_sent_at_once_and_the_clocks_alone_once_a_second(caplog):
    sidebar = _sidebar(None, caplog)
    comm, gone = _Comm(), _Comm(fails=True)
    sidebar.comms = {comm.comm_id: comm, gone.comm_id: gone}
    sidebar._send(_state(1.0, []))
    assert len(comm.sent) == 1 and list(sidebar.comms) == [comm.comm_id]  # (gone: dropped)
    sidebar._send(_state(1.0, []))
    sidebar._send(_state(1.3, []))  # (only the seconds)
    assert len(comm.sent) == 1
    sidebar._send(_state(1.3, [1]))  # a rank blocks: at once
    assert comm.sent[-1]["blocking"] == [1] and len(comm.sent) == 2
    sidebar._sent_at -= sidebar.clock_every
    sidebar._send(_state(2.4, [1]))
    assert comm.sent[-1]["ranks"][0]["seconds"] == 2.4


class _Broken:
    """A session whose every read fails, as a cluster ending under the sidebar's feet might."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name} now")


def test_nothing_the_sidebar_does_fails_a_cell_or_a_click(caplog):
    sidebar = _sidebar(_Broken(), caplog)
    comm = _Comm()
    sidebar.comms = {comm.comm_id: comm}
    run = types.SimpleNamespace(busy_ranks=[0, 1], started=time.monotonic() - 5)
    sidebar.tick(_Broken(), run)  # (its look at the stacks fails)
    sidebar.tick(_Broken(), run)
    sidebar.cell_ended()  # (reading the ranks fails)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # (once per kind)
    assert said[0].startswith("The Ranks sidebar's tick failed (RuntimeError: no stacks now)")
    assert said[1].startswith("The Ranks sidebar's cell_ended failed (RuntimeError: no running")
    assert sidebar.answer("spmdRankStack", {"rank": 1}) == (
        "The rank's stack could not be read (RuntimeError: no running now).")
