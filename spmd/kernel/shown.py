"""Which paused rank JupyterLab shows: the relay's stops, and the events that tell of them.

JupyterLab shows one stopped thread at a time, the one its last ``stopped`` event named, and
never asks for ``threads``. So every rank's stop is kept here, and JupyterLab is told of one
at a time: the first to stop, another when none is shown, or the one ``%rank N`` picks in
the debugger's console or a click picks in the debugger's Ranks panel (``spmdShowRank``,
labextension/src/debugger.ts); and that a rank went on when it went on without being asked (an
interrupt) or is gone (a restart).

A mixin of RankDebugger (debugger.py), whose state it uses; the threads' rules are there:
``_stopped`` and ``shown`` are touched under ``_lock`` only.
"""

from __future__ import annotations

import re

from spmd.kernel.dap import reply

PICK = re.compile(r"^\s*%rank\s+(\d+)\s*$")
SHOW = "spmdShowRank"  # the Ranks panel's click (its reply: as %rank N's)


class Shown:
    """RankDebugger's stops (a mixin: the state is RankDebugger's, see debugger.py)."""

    def _prune(self) -> None:
        """Forget the stops of ranks that went on without this relay (an interrupt ended the
        pause) or are gone (a restart, a stop); JupyterLab is told they continued."""
        session = self._live()
        client = self._client
        with self._lock:
            if client is None or session is None or session.record().client is not client \
                    or session.gen is not self._gen:
                gone = list(self._stopped)
            else:
                paused = client.paused
                gone = [r for r in self._stopped
                        if r >= len(session.ranks) or session.ranks[r].engine_id not in paused]
            threads = [self.refs.ours("thread", r, t) for r in gone for t in self._stopped.pop(r)]
            if self.shown in gone:
                self.shown = None
        self._tell_continued(threads)

    def _tell_continued(self, threads: list) -> None:
        """JupyterLab lets go of these threads (ranks that went on, or are gone)."""
        for thread in filter(None, threads):
            self.kernel._publish_debug_event({"type": "event", "seq": 0, "event": "continued",
                                              "body": {"threadId": thread,
                                                       "allThreadsContinued": True}})

    def after_cell(self) -> None:
        """(the kernel's main thread, when a cell has ended) Ranks that an interrupt let go
        on are no longer shown as paused."""
        if self.started:
            self._prune()

    def _pick(self, session, request: dict) -> dict:
        """``%rank N`` in the Evaluate box, or a click on rank N in the debugger's Ranks
        panel (``spmdShowRank``, labextension/src/debugger.ts): JupyterLab shows rank N's stop."""
        if request["command"] == SHOW:
            rank = int((request.get("arguments") or {}).get("rank", -1))
        else:
            rank = int(PICK.match(request["arguments"]["expression"]).group(1))
        with self._lock:
            stop = self._stopped.get(rank)
            paused = sorted(self._stopped)
        if stop is None:
            said = (f"rank {rank} is not paused; paused: {', '.join(map(str, paused))}"
                    if paused else f"rank {rank} is not paused, and no rank is")
        else:
            said = (f"showing rank {rank}" if self._show(rank)
                    else f"rank {rank} went on meanwhile")
        return reply(request, {"result": said, "variablesReference": 0})

    def _event(self, engine_id: int, event: dict) -> None:
        rank = rank_of(self._live(), engine_id)
        if rank is None:
            return
        name = event.get("event")
        if name in ("initialized", "process", "terminated", "exited") and rank != 0:
            return  # (one debuggee, as JupyterLab sees it)
        body = dict(event.get("body") or {})
        if name == "stopped":
            with self._lock:  # (every stopped thread of the rank is kept; the last is shown)
                stops = self._stopped.setdefault(rank, {})
                stops.pop(body.get("threadId", 0), None)
                stops[body.get("threadId", 0)] = event
                showing = self.shown is not None and self.shown in self._stopped
            if not showing:
                self._show(rank)
            return
        if name == "continued":
            # Passed on only for a rank that went on without being asked here (an interrupt):
            # JupyterLab empties its Variables at any thread's continued, and lets go of the
            # threads it steps by itself (those left _stopped before the step was sent).
            with self._lock:
                stops = self._stopped.get(rank, {})
                went = (list(stops) if body.get("allThreadsContinued", True)
                        else [t for t in stops if t == body.get("threadId")])
                for thread in went:
                    del stops[thread]
                if went and not stops:
                    self._stopped.pop(rank, None)
                    if self.shown == rank:
                        self.shown = None
            self._tell_continued([self.refs.ours("thread", rank, t) for t in went])
            return
        if "threadId" in body:
            body["threadId"] = self.refs.ours("thread", rank, body["threadId"])
        if "variablesReference" in body:
            body["variablesReference"] = self.refs.ours("var", rank, body["variablesReference"])
        self.kernel._publish_debug_event({**event, "body": body})

    def _show(self, rank: int) -> bool:
        """Tell JupyterLab of rank ``rank``'s stop: it then asks for that rank's stack."""
        with self._lock:
            stops = self._stopped.get(rank)
            if not stops:  # (it went on meanwhile)
                return False
            thread, event = list(stops.items())[-1]
            self.shown = rank
        # (new ids for its frames: JupyterLab refreshes its Variables only for a frame it has
        # not shown yet, and it emptied them at the last evaluate)
        self.refs.forget_frames(rank)
        body = dict(event.get("body") or {})
        body["threadId"] = self.refs.ours("thread", rank, thread)
        body["description"] = f"rank {rank}: " + str(body.get("description") or body.get(
            "reason", "paused"))
        body["allThreadsStopped"] = False
        body["spmdRank"] = rank  # (the Ranks panel marks the rank shown)
        self.kernel._publish_debug_event({**event, "body": body})
        return True

    def _rank_shown(self, session) -> int:
        with self._lock:
            if self.shown is not None:
                return self.shown
            if self._stopped:
                return min(self._stopped)
        return 0

    def _main_thread(self, rank: int) -> int:
        with self._lock:
            stops = self._stopped.get(rank)
        return next(iter(stops)) if stops else 1  # (debugpy numbers the main thread 1)


def rank_of(session, engine_id: int) -> int | None:
    """The rank whose engine is ``engine_id`` now (None: none, or no session)."""
    for r in session.ranks if session is not None else ():
        if r.engine_id == engine_id:
            return r.rank
    return None
