"""``python -m spmd mcp``: an MCP server, over stdio, through which an agent reads and drives
every rank of the user's SPMD kernels.

Built on the Model Context Protocol's own Python SDK (``mcp``), speaking over stdin and stdout
only: nothing listens on a port. The agent's configuration starts it; it finds the user's SPMD
kernels by their connection files (kernels.py) and lingering clusters as ``python -m spmd
list`` does. Every answer is short by default (each rank's text cut to its first and last
lines, a traceback to its last lines) and says how to ask for more (``full=true``).

Threads: the SDK runs the tools on its event loop; each tool does its blocking work in a
worker thread, so that the loop keeps reading the agent's messages (an ``interrupt`` while a
``run_cell`` waits), with a client of its own to the kernel: tools share nothing.
"""

from __future__ import annotations

import re

from spmd.agents import kernels

SHORT = 600  # characters of a rank's text shown by default
MAX_TIMEOUT = 600.0  # seconds a tool may wait for a cell (the server outlives no agent longer)
RANKS = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")  # '0,2', '1-3' (%%spmd --ranks)
TRACEBACK_LINES = 6  # the last lines of a traceback shown by default
MORE = ("full=true shows each rank's whole text and traceback, and the cell as the notebook "
        "shows it (its notes, a global array's values)")


def short(text: str, full: bool, limit: int = SHORT) -> str:
    """``text``, or its first and last characters with how many were left out between."""
    if full or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}... ({len(text) - 2 * half} characters left out) ...{text[-half:]}"


def per_rank(data: dict | None, full: bool) -> dict:
    """A cell's per-rank data (magics/cells/cell.py), short unless ``full``."""
    if data is None:
        return {"ranks": [], "note": "this cell ran nothing on the ranks"}
    ranks, cut = [], False
    for r in data["ranks"]:
        row = {"rank": r["rank"], "ended": r["ended"], "seconds": r["seconds"]}
        for stream in ("stdout", "stderr"):
            if r[stream]:
                row[stream] = short(r[stream], full)
                cut |= row[stream] != r[stream]
        if r["lines_left_out"]:
            row["lines_left_out"] = r["lines_left_out"]
        if r["value"] is not None:
            row["value"] = short(r["value"]["text"], full)
            cut |= row["value"] != r["value"]["text"]
        if r["displays"]:
            row["displays"] = [d["text"] or ", ".join(d["mime"]) for d in r["displays"]]
        if r["error"] is not None:
            error = r["error"]
            lines = error["traceback"] if full else error["traceback"][-TRACEBACK_LINES:]
            cut |= len(lines) < len(error["traceback"])
            row["error"] = {"ename": error["ename"], "evalue": error["evalue"],
                            "traceback": lines}
        ranks.append(row)
    said = {"execution_count": data["execution_count"], "ranks": ranks}
    if data["stall"] is not None:
        said["stall"] = data["stall"]
    if cut:
        said["more"] = MORE
    return said


def _with(kernel: str | None, work):
    """``work(k)`` for the SPMD kernel ``kernel`` (its id, or its first characters; None: the
    only one); a kernel that is not there is a sentence, not an error."""
    try:
        k = kernels.find(kernel)
    except kernels.NoKernel as exc:
        return {"error": str(exc)}
    try:
        return {"kernel": k.id, **work(k)}
    except kernels.NoKernel as exc:
        return {"kernel": k.id, "error": str(exc)}
    finally:
        k.close()


def _idle(k: kernels.Kernel) -> dict | None:
    """None where no cell runs in kernel ``k``; else what to say instead of sending one.
    (Ranks still in a cell the notebook stopped waiting for are not a cell that runs: a cell
    sent then gets the kernel's own answer, and restart is the way out.)"""
    if k.ask("spmdAbout").get("cell") == "running":
        return {"status": "busy", "say": "A cell runs in this kernel now (the notebook's, or "
                "one sent before): where shows where each rank is, interrupt stops it."}
    return None


# -- the tools (plain functions: the SDK's wrappers are made in ``server``) -----------------


def list_kernels() -> dict:
    """The user's SPMD kernels (id, notebook, ranks, hosts, backend, whether a cell runs) and
    the clusters that linger after their notebook ended."""
    from spmd.cluster import linger

    found = [k for k in kernels.every() if k.pop("spmd")]
    clusters = [{"id": r.id, "notebook": r.notebook, "ranks": r.n(),
                 "ends_in": linger.ends_in(r)} for r in linger.lingering()]
    return {"kernels": found, "clusters": clusters}


def run_cell(code: str, kernel: str | None = None, ranks: str | None = None,
             timeout: float = 60.0, full: bool = False) -> dict:
    """Run ``code`` as a cell on the ranks of one SPMD kernel (``ranks``: some of them, as
    '0,2' or '1-3'); each rank's text, value, error and how the cell ended on it (``timeout``:
    seconds to wait for it, up to 600; it goes on after)."""
    if ranks and not RANKS.fullmatch(ranks.replace(" ", "")):
        return {"error": f"ranks={ranks!r} is not a list of ranks: give them as '0,2' or '1-3'."}
    if not 0 < timeout <= MAX_TIMEOUT:
        return {"error": f"timeout={timeout:g} is out of range: give 0 < timeout <= "
                         f"{MAX_TIMEOUT:g} seconds (the cell goes on after it)."}
    if ranks:
        code = f"%%spmd --ranks {ranks.replace(' ', '')}\n{code}"

    def work(k):
        busy = _idle(k)
        if busy is not None:
            return busy
        ran = k.run(code, timeout)
        if ran["status"] == "running":
            return {"status": "running", "say": f"The cell had not ended after {timeout:g} s; "
                    "it goes on: where shows where each rank is, interrupt stops it, "
                    "last_cells reads it once it ended."}
        said = {"status": ran["status"], **per_rank(ran["data"], full)}
        if ran["data"] is None or full:  # (a cell of the kernel itself: a magic, %%local)
            said["text"] = short(ran["text"], full)
        elif ran["text"].strip():  # (the notebook's own notes, a global array's values)
            said["more"] = MORE
        if ran["error"] is not None:
            said["cell_error"] = ran["error"]
        return said

    return _with(kernel, work)


def last_cells(kernel: str | None = None, cells: int = 1, full: bool = False) -> dict:
    """Each rank's outputs of the last ``cells`` cells that ran on the ranks, newest last."""
    def work(k):
        kept = k.ask("spmdLastCells", {"cells": cells})["cells"]
        said = {"cells": [per_rank(c, full) for c in kept]}
        if len(kept) < cells:
            said["note"] = f"the kernel keeps the last {len(kept)} cells that ran on the ranks"
        return said

    return _with(kernel, work)


def where(kernel: str | None = None, full: bool = False) -> dict:
    """Where every rank is now: its state and line, the ranks that block the others and why;
    ``full``: each busy rank's stack."""
    def work(k):
        said = k.ask("spmdWhere", {"full": full}, seconds=30)
        if not full and any(r.get("line") for r in said.get("ranks", [])):
            said["more"] = "full=true shows each busy rank's stack"
        return said

    return _with(kernel, work)


def census(kernel: str | None = None) -> dict:
    """What the ranks launched in the last cell (jitted programs, collectives), and where they
    differ (``%spmd census``)."""
    def work(k):
        busy = _idle(k)
        return busy or {"text": k.run("%spmd census", 60)["text"]}

    return _with(kernel, work)


def rank_log(rank: int, kernel: str | None = None, lines: int = 40) -> dict:
    """The last ``lines`` lines rank ``rank`` wrote (its log keeps every line)."""
    return _with(kernel, lambda k: {"rank": rank, "log": k.ask(
        "spmdRankLog", {"rank": rank, "lines": lines})["result"],
        "more": "lines=N shows its last N lines"})


def interrupt(kernel: str | None = None) -> dict:
    """Interrupt the cell that runs (Kernel > Interrupt): every rank stops, and the cell's
    report says where each was."""
    def work(k):
        k.interrupt()
        return {"status": "interrupted"}

    return _with(kernel, work)


def restart(kernel: str | None = None) -> dict:
    """Start the ranks again (``%spmd restart``): new processes, same settings; the kernel and
    the notebook's own variables stay."""
    def work(k):
        busy = _idle(k)
        if busy is not None:
            return busy
        ran = k.run("%spmd restart", 300)
        return {"status": ran["status"], "text": ran["text"].strip(),
                **({"cell_error": ran["error"]} if ran["error"] else {})}

    return _with(kernel, work)


TOOLS = (list_kernels, run_cell, last_cells, where, census, rank_log, interrupt, restart)


def server():
    """The MCP server with every tool, each run in a worker thread."""
    import functools

    import anyio
    from mcp.server.mcpserver import MCPServer

    made = MCPServer("jupyter-spmd", instructions=(
        "Read and drive the ranks of the user's SPMD kernels (multi-process JAX or PyTorch in "
        "Jupyter). list_kernels first; every tool takes a kernel id (or its first "
        "characters), or none where one SPMD kernel runs."))
    for tool in TOOLS:
        @functools.wraps(tool)
        async def threaded(*args, _tool=tool, **kwargs):
            return await anyio.to_thread.run_sync(lambda: _tool(*args, **kwargs))

        made.tool()(threaded)
    return made


def main() -> int:
    try:
        made = server()
    except ImportError:
        import sys

        print("python -m spmd mcp needs the MCP SDK: pip install 'jupyter-spmd[agents]'.",
              file=sys.stderr)
        return 1
    try:
        made.run("stdio")
    except KeyboardInterrupt:  # (^C where a person started it in a terminal: no traceback)
        return 130
    return 0
