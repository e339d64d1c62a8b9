"""What a program asks an SPMD kernel of its ranks, on the control channel: the MCP server's
questions (spmd/agents/), answered while a cell runs or hangs.

Each is a ``debug_request`` of a command of its own, as the Ranks sidebar's clicks are
(sidebar.py): requests on the control channel are answered while the shell runs a cell, and
are signed with the connection file's key like every message, so only the user who owns the
kernel can ask.

- ``spmdAbout``: the notebook, the cluster (ranks, hosts, backend), each rank's state,
  whether a cell runs, and the ranks still in one the notebook stopped waiting for;
- ``spmdWhere``: where every rank is now, the rank that blocks the others and why (the live
  panel's and ``%spmd where``'s facts: the cell's rows, and a look at the busy ranks' stacks);
- ``spmdLastCells``: the per-rank data of the last cells (magics/cells/cell.py), newest last.

Threads: these run on ipykernel's control thread. They read the magics' session and the
cell's run, which the main thread owns: the run is the sidebar's (``RanksSidebar.run``, set at
each tick of a cell's wait, None between cells) or, once the notebook gave up waiting for
some ranks, the session's unfinished one (``session.unfinished``, which never waits), each
read as one reference; whether the kernel runs a cell at all (``SpmdKernel.executing``: a
%%local cell, a start) is one bool. The kept cells' data is copied in one step (a deque's copy
is one C call). They never raise: a
sentence says what went wrong (the asker waits for a reply).
"""

from __future__ import annotations

import os

COMMANDS = ("spmdAbout", "spmdWhere", "spmdLastCells")


def answer(kernel, command: str, arguments: dict) -> dict:
    """The reply's body for ``command``; ``{"error": sentence}`` where it cannot be read."""
    try:
        if command == "spmdLastCells":
            kept = list(kernel.spmd.cells_data)
            return {"cells": kept[-max(1, int(arguments.get("cells", 1))):]}
        about = _about(kernel)
        if command == "spmdAbout" or about["cluster"] != "running":
            return about
        return {**about, **_where(kernel, bool(arguments.get("full")))}
    except Exception as exc:  # (a rank gone between two lines, a closed client)
        return {"error": f"The kernel could not answer {command} ({type(exc).__name__}: {exc})."}


def _about(kernel) -> dict:
    magics = kernel.spmd
    sidebar = magics.sidebar
    session = sidebar.session()
    about = {"notebook": os.environ.get("JPY_SESSION_NAME", ""), "kernel_pid": os.getpid()}
    if session is None or not session.running:
        starting = magics.pending is not None and not magics.pending.done
        return {**about, "cluster": "starting" if starting else "none", "ranks": [],
                "cell": "running" if kernel.executing else "idle"}
    run = _run(sidebar, session)
    stuck = sorted(run.busy_ranks) if run is not None and not kernel.executing else []
    if stuck:  # (the notebook stopped waiting for them: a timeout, a divergence)
        about["still_in_a_cell"] = stuck
    return {**about, "cluster": "running", "backend": session.settings.backend,
            "hosts": sorted({r.host for r in session.ranks}),
            "cell": "running" if kernel.executing else "idle",
            "ranks": [{"rank": r.rank, "host": r.host, "pid": r.pid, "state": r.state}
                      for r in session.ranks]}


def _where(kernel, full: bool) -> dict:
    """Every rank's state and line now, the ranks that block the others, and (``full``) each
    busy rank's stack."""
    from spmd.kernel.sidebar import IN_THE_CELL, blockers, line_of
    from spmd.magics.cells.panel import Panel

    sidebar = kernel.spmd.sidebar
    session = sidebar.session()
    rows = Panel(session).rows(_run(sidebar, session))
    busy = [row["rank"] for row in rows if row["state"] in IN_THE_CELL]
    stacks = {r: s for r, s in session.stacks(busy).items() if s is not None} if busy else {}
    blocking, why = blockers(rows, stacks)
    ranks = []
    for row in rows:
        stack = stacks.get(row["rank"])
        shown = {"rank": row["rank"], "state": row["state"],
                 "seconds": round(row["seconds"], 1) if row["seconds"] is not None else None,
                 "line": line_of(stack) if stack is not None else ""}
        if full and stack is not None:
            shown["stack"] = stack.lines()
        ranks.append(shown)
    return {"ranks": ranks, "blocking": blocking, "why": why,
            "silent": [r for r in busy if r not in stacks]}


def _run(sidebar, session):
    """The cell the ranks run now: the one the notebook waits for, else one it gave up
    waiting for (a timeout, a divergence) that some ranks still run."""
    from spmd.cluster.session import unfinished

    return sidebar.run or unfinished(session)
