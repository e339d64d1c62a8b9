"""The Ranks sidebar's facts, sent to JupyterLab over a comm: each rank's host, pid, devices and
state, the line it is on while a cell runs, and the ranks that block the others.

JupyterLab's Ranks sidebar opens a comm of target ``spmd.ranks`` to an SPMD kernel; the kernel
sends it the whole state (one row per rank: small) when it opens, after every cell (a start,
a stop or a restart among them), and while a cell runs as it changes, at most every
``send_every`` seconds. The facts are
the live panel's and ``%spmd where``'s: the ranks' records and the cell's run (the panel's
rows, magics/cells/panel.py), and, once a cell has run ``look_after`` seconds, a look at its
busy ranks' stacks every ``look_every`` seconds, asked of the ranks on their control channels
by the kernel (the browser never asks the ranks). A busy rank that is not inside a call of
jax or torch while other busy ranks wait inside one blocks them: it is named, with where the
others wait.

A rank's stack or its log, clicked in the sidebar, is asked with a ``debug_request`` of
command ``spmdRankStack`` or ``spmdRankLog`` (``answer``): requests on the control channel are
answered while a cell runs, where a comm message would wait for the cell to end.

Threads: comms open and close on the kernel's main thread (its shell messages), and ``tick``
and ``cell_ended`` run there too (the cell's wait, magics/cells/render.py): ``comms`` and
the last state sent are the main thread's. ``answer`` runs on ipykernel's control thread and
reads only the session's records; so does the thread that sends a sidebar opened during the
kernel's own start its ranks once they are up (``_when_started``: it sends on its one comm,
which ipykernel's IOPub thread carries, and keeps nothing).
"""

from __future__ import annotations

import threading
import time

TARGET = "spmd.ranks"
COMMANDS = ("spmdRankStack", "spmdRankLog")


class RanksSidebar:
    """The comms of the Ranks sidebars open on this kernel, and what they were last sent."""

    look_after = 0.5  # seconds a cell runs before its busy ranks' stacks are looked at
    look_every = 0.5  # seconds between two looks
    send_every = 0.25  # seconds between two updates while a cell runs

    def __init__(self, kernel, magics) -> None:
        self.kernel, self.magics = kernel, magics
        self.comms: dict[str, object] = {}
        self._sent: dict | None = None
        self._sent_at = 0.0
        self._look_at = 0.0  # when the next look may come (monotonic)
        self._stacks: dict = {}  # rank -> its Stack at the last look (this cell's)
        kernel.comm_manager.register_target(TARGET, self._opened)

    def _opened(self, comm, msg) -> None:
        self.comms[comm.comm_id] = comm
        comm.on_close(lambda _msg, cid=comm.comm_id: self.comms.pop(cid, None))
        self._send(self.state(None), force=True)
        pending = self.magics.pending
        if pending is not None and not pending.done:  # (the kernel's own start, under way)
            threading.Thread(target=self._when_started, args=(comm, pending), daemon=True,
                             name="spmd-sidebar-start").start()

    def _when_started(self, comm, pending) -> None:
        """(a thread of its own) The ranks, once the kernel's own start has them: sent to the
        sidebar that opened before (the state is read, nothing here is kept)."""
        while not pending.done:
            time.sleep(0.1)
        try:
            comm.send(self.state(None, pending.session))
        except Exception:  # (closed meanwhile)
            pass

    # -- the cell's wait (the main thread) ----------------------------------------------------

    def tick(self, session, run) -> None:
        """A cell runs: its rows, and its busy ranks' lines once it has run a while."""
        if not self.comms:
            return
        now = time.monotonic()
        busy = list(run.busy_ranks)
        if not busy:
            self._stacks = {}
        elif now - run.started >= self.look_after and now >= self._look_at:
            self._stacks = {r: s for r, s in session.stacks(busy).items() if s is not None}
            # (a rank that holds the GIL answers only after a wait: look less often then)
            took = time.monotonic() - now
            self._look_at = now + max(self.look_every, 10 * took)
        if now - self._sent_at >= self.send_every:
            self._send(self.state(run, session))

    def cell_ended(self) -> None:
        """(after every cell, and after a command that started, stopped or restarted the
        ranks) The ranks as they are now."""
        self._stacks, self._look_at = {}, 0.0
        if self.comms:
            self._send(self.state(None), force=True)

    # -- the state ------------------------------------------------------------------------

    def state(self, run, session=None) -> dict:
        """What the sidebar shows: {"ranks": [row], "blocking": [ranks], "why": str,
        "cell": "running" | "idle", "cluster": str}."""
        from spmd.magics.cells.panel import Panel

        session = session or self._session()
        if session is None or not session.running:
            starting = self.magics.pending is not None and not self.magics.pending.done
            return {"cluster": "starting" if starting else "none", "cell": "idle", "ranks": [],
                    "blocking": [], "why": ""}
        rows = Panel(session).rows(run)
        records = {r.rank: r for r in session.ranks}
        for row in rows:
            record, stack = records[row["rank"]], self._stacks.get(row["rank"])
            row["devices"] = record.gpus if record.gpus else record.local_devices
            row["line"] = _line_of(stack) if stack is not None else ""
            row["seconds"] = round(row["seconds"], 1) if row["seconds"] is not None else None
        busy = [row["rank"] for row in rows if row["state"] in ("busy", "straggler")]
        blocking, why = blockers(self._stacks, busy)
        return {"cluster": f"{session.settings.n} ranks ({session.settings.backend})",
                "cell": "running" if run is not None and busy else "idle",
                "ranks": rows, "blocking": blocking, "why": why}

    def _session(self):
        magics = self.magics
        if magics.pending is not None:  # (the kernel's own start, not yet taken by a cell)
            return magics.pending.session if magics.pending.done else None
        return magics.session

    def _send(self, state: dict, force: bool = False) -> None:
        if state == self._sent and not force:
            return
        self._sent, self._sent_at = state, time.monotonic()
        for cid, comm in list(self.comms.items()):
            try:
                comm.send(state)
            except Exception:  # (a front end gone: its comm goes, the cell never fails)
                self.comms.pop(cid, None)

    # -- clicks (the control thread) --------------------------------------------------------

    def answer(self, command: str, arguments: dict) -> str:
        """A rank's stack (``spmdRankStack``) or the end of its log (``spmdRankLog``)."""
        session = self._session()
        if session is None or not session.running:
            return "No cluster runs."
        rank = int(arguments.get("rank", -1))
        if not 0 <= rank < session.settings.n:
            return f"This cluster has ranks 0-{session.settings.n - 1}."
        if command == "spmdRankLog":
            # (a buffered file's flush and writes take its own lock: any thread)
            return session.logs.read(rank, 40)[0] or f"Rank {rank} wrote nothing."
        stack = session.stacks([rank]).get(rank)
        if stack is None:
            return f"Rank {rank} did not answer."
        return "\n".join(stack.lines()) or f"Rank {rank} is between cells."


def blockers(stacks: dict, busy: list[int]) -> tuple[list[int], str]:
    """The busy ranks the others wait for: those outside jax and torch while other busy ranks
    wait inside a call of theirs (not building a program), and where those wait."""
    waiting = [r for r in busy if r in stacks and stacks[r].inside is not None
               and not stacks[r].inside.building]
    late = [r for r in busy if r not in waiting and r in stacks]
    if not waiting or not late:
        return [], ""
    from spmd.words import rank_words

    return late, f"{rank_words(waiting)} wait in {stacks[waiting[0]].inside.where}"


def _line_of(stack) -> str:
    """'cell line 3: time.sleep(30)', or the innermost frame where no cell's is."""
    at = stack.cell_line
    if at is not None:
        return f"cell line {at.line}: {at.source}" if at.source else f"cell line {at.line}"
    if stack.frames:
        f = stack.frames[-1]
        return f"{f.function}, line {f.line}"
    return ""
