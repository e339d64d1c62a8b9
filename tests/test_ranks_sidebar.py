"""The Ranks sidebar's side in the SPMD kernel (spmd/kernel/sidebar.py), driven as the
JupyterLab extension drives it: a comm of target ``spmd.ranks`` opened to a real SPMD kernel
with 4 ranks, whose messages say each rank's host, pid and state, and, in a hang, which rank
blocks the others; and the clicks, ``debug_request``s on the control channel that answer
while the cell hangs.

4 ranks: the point is one rank holding three back.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from conftest import kernel_stream, spmd_kernel

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("spmd_kernelspec_4")]

KERNEL = "spmd-test-sidebar"
GATHER = ("import time, jax, jax.numpy as jnp\n"
          "from jax.experimental import multihost_utils\n"
          "def gather():\n"
          "    return multihost_utils.process_allgather(jnp.ones(1))\n"
          "gather()\n")  # (compiled once here: the hang below waits, it does not compile)
HANG = ("if jax.process_index() == 1:\n"
        "    time.sleep(120)\n"
        "gather()\n")


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


def click(kc, command: str, rank: int) -> str:
    msg = kc.session.msg("debug_request", {"type": "request", "seq": 1, "command": command,
                                           "arguments": {"rank": rank}})
    kc.control_channel.send(msg)
    while True:
        reply = kc.get_control_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["content"]["success"], reply["content"]
            return reply["content"]["body"]["result"]


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
