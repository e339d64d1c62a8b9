"""JupyterLab's debugger on the ranks: the SPMD kernel's side of the debug protocol.

JupyterLab speaks DAP to the kernel (``debug_request`` on the control channel, ``debug_event``
on IOPub). The cells run on the ranks, so the ranks are the debuggees: each runs debugpy and
ipykernel's own Debugger (spmd/engine/debugging.py), reached on ipyparallel's control channel
(signed, encrypted off the loopback). This relay shows them to JupyterLab as one debuggee
whose threads are the ranks' threads:

- to every rank: initialize, attach, configurationDone, setBreakpoints, the exception
  breakpoints, dumpCell, disconnect (rank 0's reply answers);
- to every paused rank: continue, next, stepIn, stepOut (each steps its own stopped thread);
- to the rank that a thread, frame or variable names: stackTrace, scopes, variables,
  evaluate, setVariable, source, richInspectVariables, copyToGlobals; where none is named,
  to the rank shown (the last to stop, or the one picked with ``%rank N`` in the debugger's
  Evaluate box), and inspectVariables and modules the same way;
- answered here: debugInfo (one cell folder for every rank: this kernel's), threads (every
  rank's, named ``rank 1: MainThread``).

References: each rank numbers its threads, frames and variables from 1, so every id a rank
gives is swapped for one of this relay's (references.py), and back on the way in.

JupyterLab shows one stopped thread at a time, the one its last ``stopped`` event named, and
never asks for ``threads``: the relay tells it of one rank's stop at a time, and after
``continue`` or a step it names another paused rank, if one is left, with a new ``stopped``.

Threads: requests run on ipykernel's control thread, one at a time; events come on
ipyparallel's IO thread. Both hold ``_lock`` while they touch ``_stopped`` and ``shown``;
the reference tables have a lock of their own.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading

from IPython.core.inputtransformer2 import leading_empty_lines

from spmd.engine import debugging
from spmd.kernel.references import References

BROADCAST = ("initialize", "attach", "configurationDone", "setBreakpoints",
             "setExceptionBreakpoints", "setFunctionBreakpoints", "dumpCell", "disconnect")
STEPS = ("continue", "next", "stepIn", "stepOut", "stepBack", "reverseContinue")
ANSWER_SECONDS = 30.0
START_SECONDS = 120.0  # how long the debugger waits for the kernel's own start  # (attach starts debugpy's adapter; an evaluate may compute)
_PICK = re.compile(r"^\s*%rank\s+(\d+)\s*$")


class NoRanks(RuntimeError):
    """The debugger cannot reach the ranks now; the text says why and what to do."""


class RankDebugger:
    """The SPMD kernel's debugger: one per kernel, made at its start."""

    def __init__(self, kernel, magics, cells_folder: str) -> None:
        self.kernel = kernel
        self.magics = magics
        self.cells_folder = cells_folder  # JupyterLab's tmpFilePrefix, without the last '/'
        self._lock = threading.Lock()
        self.refs = References()  # every rank's thread, frame and variable ids, made ours
        self._stopped: dict[int, tuple[int, dict]] = {}  # rank -> (its thread, its event)
        self.shown: int | None = None  # the rank whose stop JupyterLab shows
        self.started = False
        self.breakpoints: dict[str, list] = {}  # cell path -> breakpoints (rank 0's reply)
        self._setup: dict[str, dict] = {}  # the requests that set a rank up, to replay
        self._client = None  # the client whose events come here
        self._gen = None  # the generation whose ranks listen

    # -- requests (ipykernel's control thread) -------------------------------------------

    async def process(self, request: dict) -> dict:
        command = request.get("command", "")
        self._prune()
        try:
            if command == "debugInfo":
                with self._lock:  # (the rank shown first: JupyterLab takes the first)
                    stopped = [self.refs.ours("thread", r, t) for r, (t, _) in sorted(
                        self._stopped.items(), key=lambda item: item[0] != self.shown)]
                return reply(request, debug_info(self.started, self.cells_folder,
                                                 self.breakpoints, stopped))
            session = await self._session(command)
            if command == "initialize":
                await self._listen(session)
            if command in BROADCAST:
                return await self._broadcast(session, request)
            if command in STEPS:
                return await self._step(session, request)
            if command == "threads":
                return await self._threads(session, request)
            if command == "evaluate" and _PICK.match(request["arguments"].get("expression", "")):
                return self._pick(session, request)
            if command == "pause":
                return await self._pause(session, request)
            return await self._one(session, request)
        except NoRanks as exc:
            return reply(request, None, message=str(exc))

    async def _session(self, command: str):
        pending = self.magics.pending  # (the kernel's own start, not yet taken by a cell)
        if pending is not None:
            deadline = asyncio.get_running_loop().time() + START_SECONDS
            while not pending.done and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)  # (JupyterLab turns the debugger on at once)
        session = self._live()
        if session is None or not session.running:
            raise NoRanks("No cluster runs, and the debugger debugs the ranks: "
                          "%spmd start (or %spmd restart) starts them, then turn the "
                          "debugger on again.")
        if command == "initialize" and session.busy_ranks():
            raise NoRanks("The ranks are still running an earlier cell: turn the debugger "
                          "on once it has ended.")
        return session

    async def _listen(self, session) -> None:
        """Every rank runs debugpy (once per generation of ranks)."""
        if self._gen is session.gen and self._client is session.client:
            return
        client = session.client
        client.on_debug_event = self._event
        self._client, self._gen = client, session.gen
        with self._lock:
            self._stopped.clear()
            self.shown = None
            self.refs.clear()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*[loop.run_in_executor(None, lambda r=rank.rank: session.call(
                r, debugging.listen, self.cells_folder, timeout=ANSWER_SECONDS))
                for rank in session.ranks])
        except Exception as exc:
            self._gen = None
            raise NoRanks(f"The ranks could not start debugpy ({type(exc).__name__}: {exc}).") from None

    def _prune(self) -> None:
        """Forget the stops of ranks that went on without this relay (an interrupt ended the
        pause) or are gone (a restart, a stop); JupyterLab is told they continued."""
        session = self._live()
        client = self._client
        with self._lock:
            if client is None or session is None or session.client is not client \
                    or session.gen is not self._gen:
                gone = list(self._stopped)
            else:
                paused = client.paused
                gone = [r for r in self._stopped
                        if r >= len(session.ranks) or session.ranks[r].engine_id not in paused]
            threads = [self.refs.ours("thread", r, self._stopped.pop(r)[0]) for r in gone]
            if self.shown in gone:
                self.shown = None
        for thread in filter(None, threads):
            self.kernel._publish_debug_event({"type": "event", "seq": 0, "event": "continued",
                                              "body": {"threadId": thread,
                                                       "allThreadsContinued": True}})

    async def before_cell(self) -> None:
        """(the kernel's main thread, before a cell while the debugger is on) Ranks started
        since the debugger was turned on are brought up too, with its breakpoints."""
        session = self._live()
        if session is None or not session.running:
            return
        if self._gen is session.gen and self._client is session.client:
            return
        try:
            await self.bring_up(session)
        except NoRanks as exc:
            print(f"The debugger is not on the new ranks: {exc}", file=sys.stderr)

    async def bring_up(self, session) -> None:
        """New ranks (after a restart) while the debugger is on: they listen and get what
        the ranks before them were told (attach, breakpoints)."""
        await self._listen(session)
        for command in ("initialize", "attach", "setExceptionBreakpoints"):
            if command in self._setup:
                await ask_all(session, self._setup[command])
        for path, breakpoints in self.breakpoints.items():
            await ask_all(session, {"type": "request", "seq": 0, "command": "setBreakpoints",
                                      "arguments": {"source": {"path": path},
                                                    "breakpoints": breakpoints}})

    async def _broadcast(self, session, request: dict) -> dict:
        command = request["command"]
        replies = await ask_all(session, request)
        first = replies[0]
        if not first.get("success", True):
            return first
        failed = [r for r, said in replies.items() if not said.get("success", True)]
        if failed:
            return reply(request, None, message=f"rank {failed[0]}: "
                               + str(replies[failed[0]].get("message", "failed")))
        if command in ("initialize", "attach", "setExceptionBreakpoints"):
            self._setup[command] = request
            if not self.started:
                self.started = True
                keep_leading_lines(self.kernel.shell, True)
        if command == "setBreakpoints":
            path = request["arguments"]["source"]["path"]
            self.breakpoints[path] = [{"line": b["line"]}
                                      for b in first.get("body", {}).get("breakpoints", [])]
            if not self.breakpoints[path]:
                del self.breakpoints[path]
        if command == "disconnect":
            self.started = False
            keep_leading_lines(self.kernel.shell, False)
            self.breakpoints.clear()
            self._setup.clear()
            with self._lock:
                self._stopped.clear()
                self.shown = None
            self.refs.clear()
            if self._client is not None:
                self._client.resume(list(self._client.paused))
        return first

    async def _step(self, session, request: dict) -> dict:
        """Continue or step every paused rank, each its own stopped thread."""
        with self._lock:
            stopped = dict(self._stopped)
            asked = self.refs.rank_and_id("thread", request["arguments"].get("threadId", 0))
        if not stopped:
            return reply(request, {"allThreadsContinued": True})
        sends = {}
        for rank, (thread, _) in stopped.items():
            sends[rank] = _with(request, threadId=thread)
        # (forgotten before the ranks go on: a step's own stop may come before its reply)
        with self._lock:
            for rank in stopped:
                self._stopped.pop(rank, None)
            self.refs.forget_frames()
            self.shown = None
        self._client.resume([session.ranks[r].engine_id for r in stopped])
        replies = await ask_each(session, sends)
        asked_rank = asked[0] if asked else min(stopped)
        said = replies.get(asked_rank) or next(iter(replies.values()))
        return self.refs.from_rank(asked_rank, said)

    async def _pause(self, session, request: dict) -> dict:
        replies = await ask_each(session, {
            r.rank: _with(request, threadId=self._main_thread(r.rank)) for r in session.ranks})
        return replies[0]

    async def _threads(self, session, request: dict) -> dict:
        threads = []
        for rank, said in (await ask_all(session, request)).items():
            for thread in said.get("body", {}).get("threads", []):
                threads.append({"id": self.refs.ours("thread", rank, thread["id"]),
                                "name": f"rank {rank}: {thread['name']}"})
        return reply(request, {"threads": threads})

    def _pick(self, session, request: dict) -> dict:
        """``%rank N`` in the Evaluate box: JupyterLab shows rank N's stop."""
        rank = int(_PICK.match(request["arguments"]["expression"]).group(1))
        with self._lock:
            stop = self._stopped.get(rank)
        if stop is None:
            with self._lock:
                paused = sorted(self._stopped)
            said = (f"rank {rank} is not paused; paused: {', '.join(map(str, paused))}"
                    if paused else f"rank {rank} is not paused, and no rank is")
            return reply(request, {"result": said, "variablesReference": 0})
        self._show(rank)
        return reply(request, {"result": f"showing rank {rank}", "variablesReference": 0})

    async def _one(self, session, request: dict) -> dict:
        try:
            rank, request = self.refs.to_rank(request)
        except LookupError as exc:
            raise NoRanks(str(exc)) from None
        if rank is None:
            rank = self._rank_shown(session)
        if request["command"] == "stackTrace":
            with self._lock:
                running = rank not in self._stopped
            if running:  # (a rank going on from a step: its stack would be the old one)
                return reply(request, {"stackFrames": [], "totalFrames": 0})
        said = (await ask_each(session, {rank: request}))[rank]
        return self.refs.from_rank(rank, said)

    # -- events (ipyparallel's IO thread) -------------------------------------------------

    def _event(self, engine_id: int, event: dict) -> None:
        rank = rank_of(self._live(), engine_id)
        if rank is None:
            return
        name = event.get("event")
        if name in ("initialized", "process", "terminated", "exited") and rank != 0:
            return  # (one debuggee, as JupyterLab sees it)
        body = dict(event.get("body") or {})
        if name == "stopped":
            with self._lock:
                self._stopped[rank] = (body.get("threadId", 0), event)
                showing = self.shown is not None and self.shown in self._stopped
            if not showing:
                self._show(rank)
            return
        if name == "continued":
            # (not passed on: JupyterLab clears its Variables at any thread's continued, and
            # it lets go of the thread it steps by itself; a rank that went on otherwise is
            # told by _prune)
            with self._lock:
                self._stopped.pop(rank, None)
            return
        if "threadId" in body:
            body["threadId"] = self.refs.ours("thread", rank, body["threadId"])
        if "variablesReference" in body:
            body["variablesReference"] = self.refs.ours("var", rank, body["variablesReference"])
        self.kernel._publish_debug_event({**event, "body": body})

    def _show(self, rank: int) -> None:
        """Tell JupyterLab of rank ``rank``'s stop: it then asks for that rank's stack."""
        with self._lock:
            thread, event = self._stopped[rank]
            self.shown = rank
        # (new ids for its frames: JupyterLab refreshes its Variables only for a frame it has
        # not shown yet, and it emptied them at the last evaluate)
        self.refs.forget_frames(rank)
        body = dict(event.get("body") or {})
        body["threadId"] = self.refs.ours("thread", rank, thread)
        body["description"] = f"rank {rank}: " + str(body.get("description") or body.get(
            "reason", "paused"))
        body["allThreadsStopped"] = False
        self.kernel._publish_debug_event({**event, "body": body})

    # -- sending ---------------------------------------------------------------------------

    def _rank_shown(self, session) -> int:
        with self._lock:
            if self.shown is not None:
                return self.shown
            if self._stopped:
                return min(self._stopped)
        return 0

    def _live(self):
        """The session whose ranks run cells: the kernel's own start's until a cell takes it
        (any thread: a read)."""
        pending = self.magics.pending
        if pending is not None:
            return pending.session if pending.done and pending.error is None else None
        return self.magics.session

    def _main_thread(self, rank: int) -> int:
        with self._lock:
            stop = self._stopped.get(rank)
        return stop[0] if stop else 1  # (debugpy numbers the main thread 1)

def _with(request: dict, **arguments) -> dict:
    return {**request, "arguments": {**(request.get("arguments") or {}), **arguments}}


async def ask_all(session, request: dict) -> dict[int, dict]:
    """Every rank's debug_reply to ``request``."""
    return await ask_each(session, {r.rank: request for r in session.ranks})


async def ask_each(session, requests: dict[int, dict]) -> dict[int, dict]:
    """Each rank's debug_reply to its request, in rank order."""
    client = session.client
    futures = {}
    for rank, request in requests.items():
        ident = client._engines[session.ranks[rank].engine_id].encode("utf8")
        futures[rank] = asyncio.wrap_future(
            client._send(client._control_stream, "debug_request", content=request,
                         ident=ident))
    replies = {}
    for rank, future in futures.items():
        try:
            msg = await asyncio.wait_for(future, ANSWER_SECONDS)
        except asyncio.TimeoutError:
            raise NoRanks(f"rank {rank} did not answer the debugger within "
                          f"{ANSWER_SECONDS:.0f} s") from None
        replies[rank] = msg["content"]
    return replies


def reply(request: dict, body: dict | None, message: str = "") -> dict:
    """A DAP response to ``request``: ``body``, or a failure that says ``message``."""
    said = {"type": "response", "request_seq": request.get("seq", 0), "seq": 0,
            "command": request.get("command", ""), "success": not message}
    if message:
        said["message"] = message
        said["body"] = {"error": {"id": 1, "format": message}}
    else:
        said["body"] = body or {}
    return said


def debug_info(started: bool, cells_folder: str, breakpoints: dict, stopped: list) -> dict:
    """``debugInfo``'s body, as ipykernel's own, for one cell folder shared by every rank."""
    from ipykernel.compiler import get_tmp_hash_seed

    return {
        "isStarted": started,
        "hashMethod": "Murmur2",
        "hashSeed": get_tmp_hash_seed(),
        "tmpFilePrefix": cells_folder + "/",
        "tmpFileSuffix": ".py",
        "breakpoints": [{"source": path, "breakpoints": b} for path, b in breakpoints.items()],
        "stoppedThreads": [t for t in stopped if t],
        "richRendering": True,
        "exceptionPaths": ["Python Exceptions"],
        "copyToGlobals": True,
    }


def keep_leading_lines(shell, keep: bool) -> None:
    """While the debugger is on, a cell's leading blank lines stay (as ipykernel's own
    debugger does): the ranks' line numbers are then the editor's."""
    cleanup = shell.input_transformer_manager.cleanup_transforms
    if keep and leading_empty_lines in cleanup:
        cleanup.remove(leading_empty_lines)
    elif not keep and leading_empty_lines not in cleanup:
        cleanup.insert(0, leading_empty_lines)


def rank_of(session, engine_id: int) -> int | None:
    """The rank whose engine is ``engine_id`` now (None: none, or no session)."""
    for r in session.ranks if session is not None else ():
        if r.engine_id == engine_id:
            return r.rank
    return None
