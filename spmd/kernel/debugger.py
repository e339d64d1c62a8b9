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

JupyterLab shows one stopped thread at a time: which rank's stop it is told of is shown.py's.

Threads: requests run on ipykernel's control thread; events come on ipyparallel's IO thread;
the kernel's main thread calls ``before_cell`` (new ranks after a restart get the debugger)
and ``after_cell``. All hold ``_lock`` while they touch ``_stopped`` and ``shown``, and read
``breakpoints`` and ``_setup`` (the control thread's) as copies; the reference tables have a
lock of their own. Nothing here waits for the session's lock, which a running cell holds.
"""

from __future__ import annotations

import asyncio
import sys
import threading

from IPython.core.inputtransformer2 import leading_empty_lines

from spmd.engine import debugging
from spmd.kernel.dap import reply, with_arguments
from spmd.kernel.references import References
from spmd.kernel.shown import PICK, Shown

BROADCAST = ("initialize", "attach", "configurationDone", "setBreakpoints",
             "setExceptionBreakpoints", "setFunctionBreakpoints", "dumpCell", "disconnect")
STEPS = ("continue", "next", "stepIn", "stepOut", "stepBack", "reverseContinue")
ANSWER_SECONDS = 30.0  # a rank's reply (attach starts debugpy's adapter; evaluate computes)
START_SECONDS = 15.0  # how long the debugger waits for the kernel's own start


class NoRanks(RuntimeError):
    """The debugger cannot reach the ranks now; the text says why and what to do."""


class RankDebugger(Shown):
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
        """The reply to one of JupyterLab's requests; never raises (JupyterLab would wait for
        a reply for ever)."""
        command = request.get("command", "")
        self._prune()
        try:
            return await self._process(command, request)
        except NoRanks as exc:
            return reply(request, None, message=str(exc))
        except Exception as exc:  # (a rank gone between two lines, a closed client)
            return reply(request, None, message=f"The debugger could not do {command} on the "
                         f"ranks ({type(exc).__name__}: {exc}).")

    async def _process(self, command: str, request: dict) -> dict:
        if command == "debugInfo":
            with self._lock:  # (the rank shown first: JupyterLab takes the first)
                stopped = [self.refs.ours("thread", r, t) for r, (t, _) in sorted(
                    self._stopped.items(), key=lambda item: item[0] != self.shown)]
            return reply(request, debug_info(self.started, self.cells_folder,
                                             self.breakpoints, stopped))
        session = await self._session(command)
        if command == "initialize":
            await self._listen(session)
        elif self.started and not self._listening(session):
            await self.bring_up(session)  # (new ranks since: a restart)
        if command in BROADCAST:
            return await self._broadcast(session, request)
        if command in STEPS:
            return await self._step(session, request)
        if command == "threads":
            return await self._threads(session, request)
        expression = (request.get("arguments") or {}).get("expression", "")
        if command == "evaluate" and PICK.match(expression):
            return self._pick(session, request)
        if command == "pause":
            return await self._pause(session, request)
        return await self._one(session, request)

    async def _session(self, command: str):
        pending = self.magics.pending  # (the kernel's own start, not yet taken by a cell)
        if pending is not None:
            deadline = asyncio.get_running_loop().time() + START_SECONDS
            while not pending.done and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)  # (JupyterLab turns the debugger on at once)
            if not pending.done:
                raise NoRanks("The ranks are still starting: turn the debugger on again in a "
                              "moment.")
        session = self._live()
        if session is None or not session.running:
            raise NoRanks("No cluster runs, and the debugger debugs the ranks: "
                          "%spmd start (or %spmd restart) starts them, then turn the "
                          "debugger on again.")
        if not self._listening(session) and (command in ("initialize", "attach")
                                               or self.started):
            # (the ranks start debugpy between cells, on their main thread; never wait here
            # for the cell's lock: this is ipykernel's control thread, which shutdown needs)
            free = session._life.acquire(blocking=False)
            if free:
                session._life.release()
            if not free or session.gen.unfinished is not None:
                raise NoRanks("A cell is running on the ranks: turn the debugger on once it "
                              "has ended.")
        return session

    def _listening(self, session) -> bool:
        return self._gen is session.gen and self._client is session.client

    async def _listen(self, session) -> None:
        """Every rank runs debugpy (once per generation of ranks)."""
        if self._listening(session):
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
        except Exception as exc:  # (the cell runs all the same, without the debugger)
            print(f"The debugger is not on the new ranks: {exc}", file=sys.stderr)

    async def bring_up(self, session) -> None:
        """New ranks (after a restart) while the debugger is on: they listen and get what
        the ranks before them were told (attach, breakpoints)."""
        await self._listen(session)
        setup, breakpoints_now = dict(self._setup), dict(self.breakpoints)
        for command in ("initialize", "attach", "setExceptionBreakpoints"):
            if command in setup:
                await ask_all(session, setup[command])
        for path, breakpoints in breakpoints_now.items():
            await ask_all(session, {"type": "request", "seq": 0, "command": "setBreakpoints",
                                      "arguments": {"source": {"path": path},
                                                    "breakpoints": breakpoints}})

    async def _broadcast(self, session, request: dict) -> dict:
        command = request["command"]
        if command == "disconnect":
            try:
                return (await ask_all(session, request))[0]
            finally:
                self._disconnected()
        replies = await ask_all(session, request)
        first = replies[0]
        if first.get("success") is False:
            return first
        failed = [r for r, said in replies.items() if not said.get("success")]
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
        return first

    def _disconnected(self) -> None:
        """The debugger is off, whatever the ranks said: nothing kept, no rank paused."""
        self.started = False
        keep_leading_lines(self.kernel.shell, False)
        self.breakpoints.clear()
        self._setup.clear()
        with self._lock:
            threads = [self.refs.ours("thread", r, t) for r, (t, _) in self._stopped.items()]
            self._stopped.clear()
            self.shown = None
        self._tell_continued(threads)
        self.refs.clear()
        if self._client is not None:
            self._client.resume(list(self._client.paused))

    async def _step(self, session, request: dict) -> dict:
        """Continue or step every paused rank, each its own stopped thread."""
        with self._lock:
            stopped = dict(self._stopped)
            asked = self.refs.rank_and_id("thread", request["arguments"].get("threadId", 0))
        if not stopped:
            return reply(request, {"allThreadsContinued": True})
        sends = {}
        for rank, (thread, _) in stopped.items():
            sends[rank] = with_arguments(request, threadId=thread)
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
            r.rank: with_arguments(request, threadId=self._main_thread(r.rank)) for r in session.ranks})
        return replies[0]

    async def _threads(self, session, request: dict) -> dict:
        threads = []
        for rank, said in (await ask_all(session, request)).items():
            for thread in said.get("body", {}).get("threads", []):
                threads.append({"id": self.refs.ours("thread", rank, thread["id"]),
                                "name": f"rank {rank}: {thread['name']}"})
        return reply(request, {"threads": threads})

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


    # -- sending ---------------------------------------------------------------------------

    def _live(self):
        """The session whose ranks run cells: the kernel's own start's until a cell takes it
        (any thread: a read)."""
        pending = self.magics.pending
        if pending is not None:
            return pending.session if pending.done and pending.error is None else None
        return self.magics.session



async def ask_all(session, request: dict) -> dict[int, dict]:
    """Every rank's debug_reply to ``request``."""
    return await ask_each(session, {r.rank: request for r in session.ranks})


async def ask_each(session, requests: dict[int, dict]) -> dict[int, dict]:
    """Each rank's debug_reply to its request, in rank order."""
    client = session.client
    futures = {}
    for rank, request in requests.items():
        try:
            ident = client._engines[session.ranks[rank].engine_id].encode("utf8")
        except (KeyError, IndexError):
            raise NoRanks(f"rank {rank} is gone: %spmd restart starts the ranks again, then "
                          "turn the debugger on again.") from None
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
