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
and ``cell_ended`` run there too (the cell's wait, magics/cells/render.py): ``comms``, the
last state sent and the panel whose rows it reads are the main thread's. ``answer`` runs on
ipykernel's control thread and reads only the session's records; so does the thread that
sends a sidebar opened during the kernel's own start its ranks once they are up
(``_when_started``: it sends on its one comm, which ipykernel's IOPub thread carries, and
keeps nothing).

Nothing here may fail a cell or a click: what goes wrong in the sidebar's own work is logged
(the kernel's log, once per kind of error) and the cell goes on; a closed comm is dropped. A
KeyboardInterrupt is not caught: it is the cell's.
"""

from __future__ import annotations

import threading
import time

TARGET = "spmd.ranks"
COMMANDS = ("spmdRankStack", "spmdRankLog")
# What changes in a row at every look whatever the ranks do: a change of these alone is sent
# at most every ``clock_every`` seconds.
_CLOCKS = ("seconds", "memory")


class RanksSidebar:
    """The comms of the Ranks sidebars open on this kernel, and what they were last sent."""

    look_after = 0.5  # seconds a cell runs before its busy ranks' stacks are looked at
    look_every = 0.5  # seconds between two looks
    send_every = 0.25  # seconds between two updates while a cell runs
    clock_every = 1.0  # ... where only the seconds (and memory) changed

    def __init__(self, kernel, magics) -> None:
        self.kernel, self.magics = kernel, magics
        self.comms: dict[str, object] = {}
        self._sent: dict | None = None
        self._sent_at = 0.0
        self._panel = None  # the live panel's rows of the session shown (panel.Panel)
        self._failed: set[str] = set()  # the kinds of error logged already
        self._look_at = 0.0  # when the next look may come (monotonic)
        self._stacks: dict = {}  # rank -> its Stack at the last look (this cell's)
        # the cell running now (its lockstep run), set at each tick of its wait, None between
        # cells: agents.py reads it, as one reference, on the control thread
        self.run = None
        kernel.comm_manager.register_target(TARGET, self._opened)

    def _opened(self, comm, msg) -> None:
        self.comms[comm.comm_id] = comm
        comm.on_close(lambda _msg, cid=comm.comm_id: self.comms.pop(cid, None))
        self._safely("open", lambda: self._send(self.state(None), force=True))
        pending = self.magics.pending
        if pending is not None and not pending.done:  # (the kernel's own start, under way)
            threading.Thread(target=self._when_started, args=(comm, pending), daemon=True,
                             name="spmd-sidebar-start").start()

    def _when_started(self, comm, pending) -> None:
        """(a thread of its own) The ranks, once the kernel's own start has them: sent to the
        sidebar that opened before (the state is read, nothing here is kept)."""
        while not pending.done:
            time.sleep(0.1)
        from spmd.magics.cells.panel import Panel

        # (a comm closed meanwhile fails its send: logged, as anything else here)
        self._safely("send", lambda: comm.send(
            self.state(None, pending.session, Panel(pending.session))))

    # -- the cell's wait (the main thread) ----------------------------------------------------

    def tick(self, session, run) -> None:
        """A cell runs: its rows, and its busy ranks' lines once it has run a while."""
        self.run = run
        if self.comms:
            self._safely("tick", self._tick, session, run)

    def _tick(self, session, run) -> None:
        now = time.monotonic()
        busy = list(run.busy_ranks)
        if not busy:
            self._stacks = {}
        elif now - run.started >= self.look_after and now >= self._look_at:
            self._look_at = now + self.look_every  # (a look that fails is not tried at once)
            self._stacks = {r: s for r, s in session.stacks(busy).items() if s is not None}
            # (a rank that holds the GIL answers only after a wait: look less often then)
            took = time.monotonic() - now
            self._look_at = now + max(self.look_every, 10 * took)
        if now - self._sent_at >= self.send_every:
            self._send(self.state(run, session, self._panel_of(session)))

    def cell_ended(self) -> None:
        """(after every cell, and after a command that started, stopped or restarted the
        ranks) The ranks as they are now."""
        self._stacks, self._look_at, self.run = {}, 0.0, None
        if self.comms:
            self._safely("cell_ended", lambda: self._send(self.state(None), force=True))

    def _safely(self, what: str, fn, *args) -> None:
        """``fn(*args)``; an error is logged (once per kind), never raised: the sidebar
        must not fail a cell, nor the kernel's handling of a message. (Any thread: a kind
        logged twice, by two threads at once, is the worst a race does here.)"""
        try:
            fn(*args)
        except Exception as exc:
            kind = f"{what}: {type(exc).__name__}"
            if kind not in self._failed:
                self._failed.add(kind)
                self.kernel.log.warning("The Ranks sidebar's %s failed (%s: %s); the kernel "
                                        "goes on without it.", what, type(exc).__name__, exc,
                                        exc_info=True)

    # -- the state ------------------------------------------------------------------------

    def state(self, run, session=None, panel=None) -> dict:
        """What the sidebar shows: {"ranks": [row], "blocking": [ranks], "why": str,
        "cell": "running" | "idle", "cluster": str}. ``panel``: the panel.Panel of
        ``session`` to read the rows from (the main thread's own where not given)."""
        session = session or self.session()
        if session is None or not session.running:
            starting = self.magics.pending is not None and not self.magics.pending.done
            return {"cluster": "starting" if starting else "none", "cell": "idle", "ranks": [],
                    "blocking": [], "why": ""}
        rows = (panel or self._panel_of(session)).rows(run)
        records = {r.rank: r for r in session.ranks}
        for row in rows:
            record, stack = records[row["rank"]], self._stacks.get(row["rank"])
            row["devices"] = record.gpus if record.gpus else record.local_devices
            row["line"] = line_of(stack) if stack is not None else ""
            row["seconds"] = round(row["seconds"], 1) if row["seconds"] is not None else None
        busy = [row["rank"] for row in rows if row["state"] in ("busy", "straggler")]
        blocking, why = blockers(rows, self._stacks)
        return {"cluster": f"{session.settings.n} ranks ({session.settings.backend})",
                "cell": "running" if run is not None and busy else "idle",
                "ranks": rows, "blocking": blocking, "why": why}

    def session(self):
        """The session whose ranks run cells: the kernel's own start's until a cell takes it
        (any thread: a read)."""
        magics = self.magics
        if magics.pending is not None:  # (the kernel's own start, not yet taken by a cell)
            return magics.pending.session if magics.pending.done else None
        return magics.session

    def _panel_of(self, session):
        """(the main thread) The panel whose rows are ``session``'s: one per session, so that
        it keeps its handles on the ranks' processes (their memory) from look to look."""
        from spmd.magics.cells.panel import Panel

        if self._panel is None or self._panel.session is not session:
            self._panel = Panel(session)
        return self._panel

    def _send(self, state: dict, force: bool = False) -> None:
        """``state`` to every sidebar, where it changed (only the clocks: at most every
        ``clock_every`` seconds)."""
        now = time.monotonic()
        if not force and (state == self._sent or (
                _without_clocks(state) == _without_clocks(self._sent)
                and now - self._sent_at < self.clock_every)):
            return
        self._sent, self._sent_at = state, now
        for cid, comm in list(self.comms.items()):
            try:
                comm.send(state)
            except Exception:  # (a front end gone: its comm goes, the cell never fails)
                self.comms.pop(cid, None)

    # -- clicks (the control thread) --------------------------------------------------------

    def answer(self, command: str, arguments: dict) -> str:
        """A rank's stack (``spmdRankStack``) or the end of its log (``spmdRankLog``); why
        not, in a sentence (the extension waits for a reply: this never raises)."""
        try:
            return self._answer(command, arguments)
        except Exception as exc:  # (a rank gone between two lines, a closed client)
            what = "stack" if command == "spmdRankStack" else "log"
            return f"The rank's {what} could not be read ({type(exc).__name__}: {exc})."

    def _answer(self, command: str, arguments: dict) -> str:
        session = self.session()
        if session is None or not session.running:
            return "No cluster runs."
        rank = int(arguments.get("rank", -1))
        if not 0 <= rank < session.settings.n:
            return f"This cluster has ranks 0-{session.settings.n - 1}."
        if command == "spmdRankLog":
            # (a buffered file's flush and writes take its own lock: any thread)
            lines = max(1, int(arguments.get("lines", 40)))
            return session.logs.read(rank, lines)[0] or f"Rank {rank} wrote nothing."
        stack = session.stacks([rank]).get(rank)
        if stack is None:
            return f"Rank {rank} did not answer."
        return "\n".join(stack.lines()) or f"Rank {rank} is between cells."


def blockers(rows: list[dict], stacks: dict) -> tuple[list[int], str]:
    """The ranks the others wait for, and why in a few words, from the live panel's ``rows``
    (panel.Panel.rows) and the busy ranks' ``stacks`` at the last look. Ranks still in the
    cell after others finished it (the panel's stragglers, or a straggler at a prompt or
    paused in the debugger) hold the finished ones back; where none has finished, the busy
    ranks outside jax and torch hold back those that wait inside a call of theirs (not
    building a program), and the words say where those wait."""
    from spmd.words import rank_words

    finished = [row for row in rows if row["state"] in ("done", "error")]
    unfinished = [row["rank"] for row in rows if row["state"] in IN_THE_CELL]
    if finished and unfinished:
        # (the seconds since the first finished: a cell's ranks finish within moments of
        # each other, which is no one waiting)
        behind = max(row["seconds"] or 0.0 for row in rows if row["rank"] in unfinished) - min(
            row["seconds"] or 0.0 for row in finished)
        if behind < STRAGGLER_SECONDS:
            return [], ""
        finished = [row["rank"] for row in finished]
        one = len(finished) == 1
        return unfinished, (f"{rank_words(finished)} {'has' if one else 'have'} finished the "
                            f"cell and {'waits' if one else 'wait'} for "
                            f"{'it' if len(unfinished) == 1 else 'them'}")
    waiting = [r for r in unfinished if r in stacks and stacks[r].inside is not None
               and not stacks[r].inside.building]
    late = [r for r in unfinished if r not in waiting and r in stacks]
    if not waiting or not late:
        return [], ""
    return late, f"{rank_words(waiting)} wait in {stacks[waiting[0]].inside.where}"


# How long after the first rank finished the cell the ranks still in it are said to block it.
STRAGGLER_SECONDS = 0.5
# The panel's states of a rank that has not finished the cell (panel.Panel.rows).
IN_THE_CELL = ("busy", "straggler", "input", "debugger")


def _without_clocks(state: dict | None) -> dict | None:
    """``state`` less what changes at every look whatever the ranks do (``_CLOCKS``)."""
    if state is None:
        return None
    return {**state, "ranks": [{k: v for k, v in row.items() if k not in _CLOCKS}
                               for row in state.get("ranks", [])]}


def line_of(stack) -> str:
    """'cell line 3: time.sleep(30)', 'cell line 4 in gather: return ...' (a function a cell
    defined, maybe an earlier cell: its line is not the running cell's), or the innermost
    frame where no cell's is."""
    at = stack.cell_line
    if at is not None:
        where = f"cell line {at.line}" + (f" in {at.function}" if at.function != "<module>"
                                          else "")
        return f"{where}: {at.source}" if at.source else where
    if stack.frames:
        f = stack.frames[-1]
        return f"{f.function}, line {f.line}"
    return ""
