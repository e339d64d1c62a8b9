"""JupyterLab's debugger on the ranks: the SPMD kernel's side of the debug protocol.

JupyterLab speaks DAP to the kernel (``debug_request`` on the control channel, ``debug_event``
on IOPub). The cells run on the ranks, so the ranks are the debuggees: each runs debugpy and
ipykernel's own Debugger (spmd/engine/shell/debugging.py), reached on ipyparallel's control channel
(signed, encrypted off the loopback). This relay shows them to JupyterLab as one debuggee
whose threads are the ranks' threads:

- to every rank: initialize, attach, configurationDone, setBreakpoints, the exception
  breakpoints, dumpCell, disconnect (rank 0's reply answers);
- to every paused rank: continue, next, stepIn, stepOut (each steps its own stopped thread);
- to the rank that a thread, frame or variable names: stackTrace, scopes, variables,
  evaluate, setVariable, source, richInspectVariables, copyToGlobals; where none is named,
  to the rank shown (the last to stop, or the one picked with ``%rank N`` in the debugger's
  Evaluate box or in the extension's Ranks panel: ``spmdShowRank``), and inspectVariables
  and modules the same way;
- answered here: debugInfo (one cell folder for every rank: this kernel's), threads (every
  rank's, named ``rank 1: MainThread``).

References: each rank numbers its threads, frames and variables from 1, so every id a rank
gives is swapped for one of this relay's (references.py), and back on the way in.

JupyterLab shows one stopped thread at a time: which rank's stop it is told of is shown.py's.

Threads: requests run on ipykernel's control thread; events come on ipyparallel's IO thread;
the kernel's main thread calls ``before_cell`` (new ranks after a restart get the debugger)
and ``after_cell``. All hold ``_lock`` while they touch ``_stopped``, ``shown`` and
``_silent``, and read ``breakpoints`` and ``_setup`` (the control thread's) as copies; the
reference tables have a lock of their own. New ranks are brought up by one thread at a time
(``_up``: the other waits for it), and counted as listening only once set up, so neither a
request nor a cell reaches ranks half set up. Nothing here waits for the session's lock, which
a running cell holds.

Waits: a request waits once for all its ranks, ``QUICK_SECONDS`` (``ANSWER_SECONDS`` where
the ranks start something or compute); a rank that ended fails it at once, and one that did
not answer is left out for ``SILENT_SECONDS`` (until it sends an event or answers): the rest of
JupyterLab's burst of requests, and a Shut Down queued behind it, do not wait for it again.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from IPython.core.inputtransformer2 import leading_empty_lines

from spmd.engine.shell import debugging
from spmd.kernel.dap import reply, with_arguments
from spmd.kernel.references import References
from spmd.kernel.shown import PICK, SHOW, Shown, rank_of

BROADCAST = ("initialize", "attach", "configurationDone", "setBreakpoints",
             "setExceptionBreakpoints", "setFunctionBreakpoints", "dumpCell", "disconnect")
STEPS = ("continue", "next", "stepIn", "stepOut", "stepBack", "reverseContinue")
ANSWER_SECONDS = 30.0  # a rank's reply where it starts something or computes:
SLOW = ("initialize", "attach", "evaluate", "setVariable", "setExpression", "copyToGlobals",
        "variables", "inspectVariables", "richInspectVariables")  # (reprs of big arrays)
QUICK_SECONDS = 10.0  # any other reply: debugpy answers from what it holds
SILENT_SECONDS = 30.0  # a rank that did not answer is asked nothing for this long
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
        self._stopped: dict[int, dict[int, dict]] = {}  # rank -> {its thread: its event}
        self._silent: dict[int, float] = {}  # rank -> when it did not answer (monotonic)
        self._up = threading.Lock()  # held while new ranks are brought up
        self.shown: int | None = None  # the rank whose stop JupyterLab shows
        self.started = False
        self.breakpoints: dict[str, list] = {}  # cell path -> breakpoints (rank 0's reply)
        self._setup: dict[str, dict] = {}  # what set a rank up, and the cells, to replay
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
                stopped = [self.refs.ours("thread", r, t) for r, threads in sorted(
                    self._stopped.items(), key=lambda item: item[0] != self.shown)
                    for t in reversed(threads)]
            return reply(request, debug_info(self.started, self.cells_folder,
                                             self.breakpoints, stopped))
        session = await self._session(command)
        if not self._listening(session) and (command in ("initialize", "attach")
                                               or self.started):
            # (new ranks since, a restart: they get what the ones before were told)
            await self.bring_up(session, replay=command != "initialize")
        if command in BROADCAST:
            return await self._broadcast(session, request)
        if command in STEPS:
            return await self._step(session, request)
        if command == "threads":
            return await self._threads(session, request)
        expression = (request.get("arguments") or {}).get("expression", "")
        if command == SHOW or command == "evaluate" and PICK.match(expression):
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
            # for the cell's lock: this is ipykernel's control thread, which shutdown needs;
            # busy: or ranks still run a cell the notebook stopped waiting for)
            if session.busy():
                raise NoRanks("A cell is running on the ranks: turn the debugger on once it "
                              "has ended.")
        return session

    def _listening(self, session) -> bool:
        return self._gen is session.gen and self._client is session.record().client

    async def before_cell(self) -> None:
        """(the kernel's main thread, before a cell while the debugger is on) Ranks started
        since the debugger was turned on are brought up too, with its breakpoints."""
        session = self._live()
        if session is None or not session.running or self._listening(session):
            return
        try:
            await self.bring_up(session, replay=True)
        except Exception as exc:  # (the cell runs all the same, without the debugger)
            print(f"The debugger is not on the new ranks: {exc}", file=sys.stderr)

    async def bring_up(self, session, replay: bool) -> None:
        """Every rank runs debugpy (once per generation of ranks) and, with ``replay``, gets
        what the ranks before it were told (attach, breakpoints); only then do its requests
        and cells count it as listening. One thread at a time: the other waits."""
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._up.acquire, True, 2 * ANSWER_SECONDS):
            raise NoRanks("The debugger is still being set up on the ranks: try again in a "
                          "moment.")
        try:
            if self._listening(session):  # (the other thread did it meanwhile)
                return
            client = session.record().client
            client.on_debug_event = self._on_event
            with self._lock:
                self._stopped.clear()
                self._silent.clear()
                self.shown = None
                self.refs.clear()
            try:
                await asyncio.gather(*[loop.run_in_executor(
                    None, lambda r=rank.rank: session.call(
                        r, debugging.listen, self.cells_folder, timeout=ANSWER_SECONDS))
                    for rank in session.ranks])
            except Exception as exc:
                raise NoRanks(f"The ranks could not start debugpy ({type(exc).__name__}: "
                              f"{exc}).") from None
            if replay:
                setup, breakpoints_now = dict(self._setup), dict(self.breakpoints)
                for request in setup.values():  # (in their order: initialize first)
                    await self._ask_all(session, request)
                for path, breakpoints in breakpoints_now.items():
                    await self._ask_all(session, {
                        "type": "request", "seq": 0, "command": "setBreakpoints",
                        "arguments": {"source": {"path": path}, "breakpoints": breakpoints}})
            self._client, self._gen = client, session.gen
        finally:
            self._up.release()

    def _on_event(self, engine_id: int, event: dict) -> None:
        """(ipyparallel's IO thread) A rank's debug event: it answers again."""
        rank = rank_of(self._live(), engine_id)
        with self._lock:
            self._silent.pop(rank, None)
        self._event(engine_id, event)

    async def _broadcast(self, session, request: dict) -> dict:
        command = request["command"]
        if command == "disconnect":
            try:
                return (await self._ask_all(session, request))[0]
            finally:
                self._disconnected()
        replies = await self._ask_all(session, request)
        first = replies[0]
        if first.get("success") is False:
            return first
        failed = [r for r, said in replies.items() if not said.get("success")]
        if failed:
            return reply(request, None, message=f"rank {failed[0]}: "
                               + str(replies[failed[0]].get("message", "failed")))
        if command in ("initialize", "attach", "setExceptionBreakpoints", "dumpCell"):
            # (a cell's file too: a rank that ends removes the cells' files of its host)
            self._setup[first.get("body", {}).get("sourcePath", command)] = request
            if not self.started and command != "dumpCell":
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
        """The debugger is off, whatever the ranks said: nothing kept, no rank paused; the
        ranks let debugpy go (engine/shell/debugging.py), so turning it on again sets them up
        anew."""
        self.started = False
        self._gen = None
        keep_leading_lines(self.kernel.shell, False)
        self.breakpoints.clear()
        self._setup.clear()
        with self._lock:
            threads = [self.refs.ours("thread", r, t)
                       for r, stops in self._stopped.items() for t in stops]
            self._stopped.clear()
            self.shown = None
        self._tell_continued(threads)
        self.refs.clear()
        if self._client is not None:
            self._client.resume(list(self._client.paused))

    async def _step(self, session, request: dict) -> dict:
        """Continue or step every paused rank: the thread asked for on its rank, the first
        to stop on each other rank (debugpy lets a rank's other threads go on with it)."""
        with self._lock:
            stopped = {rank: list(stops) for rank, stops in self._stopped.items()}
            asked = self.refs.rank_and_id("thread", request["arguments"].get("threadId", 0))
        if not stopped:
            return reply(request, {"allThreadsContinued": True})
        sends = {}
        for rank, threads in stopped.items():
            thread = asked[1] if asked and asked[0] == rank and asked[1] in threads else threads[0]
            sends[rank] = with_arguments(request, threadId=thread)

        def told(rank: int) -> None:
            # (forgotten as it is told to go on, before its request leaves: a step's own stop
            # may come before its reply; a rank never told stays paused, and known as such)
            with self._lock:
                self._stopped.pop(rank, None)
                if self.shown == rank:
                    self.shown = None
            self.refs.forget_frames(rank)
            self._client.resume([session.ranks[rank].engine_id])

        replies = await self._ask_each(session, sends, told)
        asked_rank = asked[0] if asked and asked[0] in replies else min(stopped)
        said = replies.get(asked_rank) or next(iter(replies.values()))
        return self.refs.from_rank(asked_rank, said)

    async def _pause(self, session, request: dict) -> dict:
        return (await self._ask_each(session, {r.rank: with_arguments(
            request, threadId=self._main_thread(r.rank)) for r in session.ranks}))[0]

    async def _threads(self, session, request: dict) -> dict:
        threads = []
        for rank, said in (await self._ask_all(session, request)).items():
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
        said = (await self._ask_each(session, {rank: request}))[rank]
        return self.refs.from_rank(rank, said)


    # -- sending ---------------------------------------------------------------------------

    async def _ask_all(self, session, request: dict) -> dict[int, dict]:
        """Every rank's debug_reply to ``request``."""
        return await self._ask_each(session, {r.rank: request for r in session.ranks})

    async def _ask_each(self, session, requests: dict[int, dict], told=None) -> dict[int, dict]:
        """Each rank's debug_reply to its request, in rank order; ``told(rank)`` is called just
        before a rank's request is sent. Nothing is sent where a rank has ended or is left out
        (it did not answer lately); one wait for all the replies, which a rank's end cuts
        short. Raises NoRanks, its text one sentence."""
        client = session.record().client
        dead, now = session.deaths.dead_ranks(session.gen), time.monotonic()
        engines = {}
        for rank in requests:
            try:
                engines[rank] = session.ranks[rank].engine_id
                client.engine_ident(engines[rank])  # (KeyError: not registered now)
            except (KeyError, IndexError):
                dead.add(rank)
            with self._lock:
                since = self._silent.get(rank)
            if rank in dead:
                raise NoRanks(ended([rank]))
            if since is not None and now - since < SILENT_SECONDS:
                raise NoRanks(left_out(rank, SILENT_SECONDS - (now - since)))
        futures = {}
        for rank, request in requests.items():
            if told is not None:
                told(rank)
            try:
                futures[rank] = client.control(engines[rank], "debug_request", request)
            except KeyError:  # (it ended since it was looked up above)
                _drop(client, futures, {r: r for r in futures})
                raise NoRanks(ended([rank])) from None
        slow = any(r.get("command") in SLOW for r in requests.values())
        seconds = ANSWER_SECONDS if slow else QUICK_SECONDS
        late = await _wait(session, futures, seconds)
        if late:
            with self._lock:
                self._silent.update({rank: time.monotonic() for rank in late})
            raise NoRanks(no_answer(late, seconds))
        with self._lock:
            for rank in futures:
                self._silent.pop(rank, None)
        return {rank: futures[rank].result()["content"] for rank in sorted(futures)}

    def _live(self):
        """The session whose ranks run cells: the kernel's own start's until taken (a read)."""
        pending = self.magics.pending
        if pending is not None:
            return pending.session if pending.done and pending.error is None else None
        return self.magics.session



async def _wait(session, futures: dict, seconds: float) -> list[int]:
    """Wait up to ``seconds`` for every rank's reply ({rank: future}); the ranks that did not
    answer (their requests leave the client's futures). Raises NoRanks as soon as a rank
    that has not answered ends."""
    waiting = {asyncio.wrap_future(f): rank for rank, f in futures.items()}
    deadline = time.monotonic() + seconds
    while waiting and time.monotonic() < deadline:
        await asyncio.wait(list(waiting), timeout=min(0.25, deadline - time.monotonic()))
        waiting = {w: rank for w, rank in waiting.items() if not w.done()}
        gone = session.deaths.dead_ranks(session.gen) & set(waiting.values()) if waiting else set()
        if gone:
            _drop(session.record().client, futures, waiting)
            raise NoRanks(ended(sorted(gone)))
    _drop(session.record().client, futures, waiting)
    return sorted(waiting.values())


def _drop(client, futures: dict, waiting: dict) -> None:
    """The requests still unanswered leave the client's futures."""
    for rank in waiting.values():
        client.drop(futures[rank])


def left_out(rank: int, seconds: float) -> str:
    """The sentence for a rank left out, for ``seconds`` more, as it did not answer."""
    return (f"Rank {rank} did not answer the debugger lately (stopped, or stuck outside "
            f"Python?), so it is asked nothing for {seconds:.0f} s more: interrupt the kernel, "
            "or %spmd restart.")


def no_answer(late: list[int], seconds: float) -> str:
    """The sentence for ranks that did not answer within ``seconds``."""
    who = f"Rank {late[0]}" if len(late) == 1 else "Ranks " + ", ".join(map(str, late))
    return (f"{who} did not answer the debugger within {seconds:.0f} s (stopped, or stuck "
            f"outside Python?), and {'is' if len(late) == 1 else 'are'} asked nothing for "
            f"{SILENT_SECONDS:.0f} s: interrupt the kernel, or %spmd restart.")


def ended(ranks: list[int]) -> str:
    """The sentence for ranks that have ended."""
    who = f"Rank {ranks[0]} has" if len(ranks) == 1 else f"Ranks {', '.join(map(str, ranks))} have"
    return (f"{who} ended, or the controller lost {'it' if len(ranks) == 1 else 'them'}: "
            "%spmd restart starts the ranks again, then turn the debugger on "
            "again.")


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
