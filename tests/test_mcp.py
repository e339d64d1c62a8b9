"""``python -m spmd mcp``, driven by the MCP SDK's own client over stdio, against a real SPMD
kernel with 2 ranks (started here as Jupyter starts one, its connection file in a runtime
folder of the test's own): list, run a cell where rank 1 raises and one on rank 1 only, the
census, where during a hang (the rank that blocks the other, and its line), the hang
interrupted, restart."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import pytest
from conftest import SPMD_KERNEL

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("spmd_kernelspec")]

HANG = [
    # (the collective compiled here: in the next cell rank 0 waits in it at once)
    "import time, jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
    "def gather():\n    return multihost_utils.process_allgather(jnp.ones(1))\ngather();",
    "if jax.process_index() == 1:\n    time.sleep(120)\ngather();",
]


async def _call(session, tool: str, **arguments) -> dict:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result
    said = result.structured_content
    if said is None:
        said = json.loads(result.content[0].text)
    return said.get("result", said) if set(said) == {"result"} else said


async def _drive(runtime: str) -> None:
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "spmd", "mcp"],
                                   env={**os.environ, "JUPYTER_RUNTIME_DIR": runtime})
    async with stdio_client(params) as streams, ClientSession(*streams) as session:
        await session.initialize()
        names = {t.name for t in (await session.list_tools()).tools}
        assert {"list_kernels", "run_cell", "last_cells", "where", "census", "rank_log",
                "interrupt", "restart"} <= names, names

        listed = await _call(session, "list_kernels")
        (kernel,) = listed["kernels"]
        assert kernel["cluster"] == "running" and len(kernel["ranks"]) == 2, kernel
        pids = [r["pid"] for r in kernel["ranks"]]

        ran = await _call(session, "run_cell", code=(
            "import jax\nr = jax.process_index()\nprint('hello from', r)\n"
            "if r == 1:\n    raise ValueError('only rank 1')\nr"))
        zero, one = ran["ranks"]
        assert ran["status"] == "error", ran
        assert zero["ended"] == "ok" and zero["stdout"] == "hello from 0\n" and zero["value"] == "0"
        assert one["ended"] == "error" and one["stdout"] == "hello from 1\n"
        assert one["error"]["ename"] == "ValueError" and one["error"]["evalue"] == "only rank 1"
        last = await _call(session, "last_cells")
        assert last["cells"][-1]["ranks"][1]["error"]["evalue"] == "only rank 1"
        some = await _call(session, "run_cell", code="print('only here', r)", ranks="1")
        assert some["status"] == "ok" and [r["rank"] for r in some["ranks"]] == [1], some
        assert some["ranks"][0]["stdout"] == "only here 1\n", some
        missing = await _call(session, "where", kernel="no-such-kernel")
        assert "no-such-kernel" in missing["error"], missing

        # a hang, sent by the agent too: rank 1 sleeps, rank 0 waits in a gather; where and
        # interrupt answer while the agent's run_cell waits for it
        assert (await _call(session, "run_cell", code=HANG[0]))["status"] == "ok"
        census = (await _call(session, "census"))["text"]
        assert "Ranks 0-1: 1 cross-process launch" in census, census
        hang = asyncio.ensure_future(_call(session, "run_cell", code=HANG[1], timeout=120))
        for _ in range(120):
            where = await _call(session, "where")
            if where.get("blocking"):
                break
            await asyncio.sleep(0.5)
        assert where["blocking"] == [1], where
        assert "time.sleep(120)" in where["ranks"][1]["line"], where
        assert "wait in" in where["why"], where
        busy = await _call(session, "run_cell", code="1 + 1")
        assert busy["status"] == "busy", busy

        assert (await _call(session, "interrupt"))["status"] == "interrupted"
        hung = await asyncio.wait_for(hang, 120)
        assert hung["status"] == "error" and hung["cell_error"]["ename"] == "RankErrors", hung
        assert {r["ended"] for r in hung["ranks"]} == {"interrupted"}, hung
        assert hung["stall"]["reason"] == "interrupted", hung
        # rank 0 stays in the gather rank 1 never joins (the interrupt does not reach into
        # it): the kernel says so, and restart is the way out
        stuck = (await _call(session, "list_kernels"))["kernels"][0]
        assert stuck["cell"] == "idle" and stuck.get("still_in_a_cell") == [0], stuck

        restarted = await _call(session, "restart")
        assert restarted["status"] == "ok", restarted
        kernel = (await _call(session, "list_kernels"))["kernels"][0]
        assert len(kernel["ranks"]) == 2 and not set(pids) & {r["pid"] for r in kernel["ranks"]}
        log = await _call(session, "rank_log", rank=0, lines=5)
        assert log["rank"] == 0 and isinstance(log["log"], str)


def test_an_agent_lists_runs_finds_the_blocking_rank_interrupts_and_restarts(tmp_path):
    from jupyter_client.manager import KernelManager

    runtime = str(tmp_path / "runtime")
    os.makedirs(runtime)
    # (as Jupyter Server starts a kernel: its connection file in the runtime folder)
    km = KernelManager(kernel_name=SPMD_KERNEL,
                       connection_file=os.path.join(runtime, f"kernel-{uuid.uuid4()}.json"))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply = kc.execute_interactive("import jax", timeout=120)  # (the ranks are up)
        assert reply["content"]["status"] == "ok", reply["content"]
        asyncio.run(_drive(runtime))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
