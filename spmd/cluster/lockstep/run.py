"""Run one cell on a set of ranks and collect what each rank produced, in order.

The cell goes out once for all its ranks, through the controller's fan-out, and the client's
IO thread hears each rank's outputs, in the order the rank produced them, and when the rank
has finished (channel/client.py; its routes are in place before the request leaves, so
no early output is missed). The IO thread only puts events on a queue: the notebook's main
thread consumes them, which is where streaming to the notebook must happen (ipykernel routes
output by the main thread's current cell).

``CellRun`` is the cell while it runs: the session's cell runner polls it, its observer (the
live view) sees it, and the session keeps it while ranks are still
busy in it (``unfinished``: a later interrupt polls it). ``CellResult`` is what the cell was
once the notebook's wait for it ended (``CellRun.result``): a frozen record that the magics,
the panel and the cell's report read, on the main thread.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from spmd import wire
from spmd.cluster.channel import control
from spmd.cluster.channel.client import DONE
from spmd.cluster.lockstep.outputs import RankCell, output_from_message, unmarked
from spmd.cluster.records import CellObserver, CellResult


@dataclass
class CellRun:
    """One cell sent to some ranks, while it runs; ``poll`` advances it, ``cells`` holds what
    each rank produced so far, ``result`` freezes it."""

    client: object
    engine_ids: dict[int, int]  # rank -> ipyparallel engine id
    code: str
    # What watches the cell (records.CellObserver: the magics' live view): every output as
    # it comes, and a rank's input(), getpass or pdb prompt to answer ({"text": ...} or
    # {"error": why}); None: outputs are only kept, and ranks that ask get
    # StdinNotImplementedError.
    observer: CellObserver | None = None
    max_lines: int | None = None  # stream lines kept per rank (RankCell.max_lines)
    log: object | None = None  # a RankLogs: every stream line of every rank
    breakpoints: str = "lowest"  # which ranks stop at breakpoint(): the lowest, or all
    paused: float = 0.0  # seconds spent waiting for the person at a prompt
    prompting: set = field(default_factory=set)  # ranks waiting at a prompt
    _stopper: int | None = None  # the rank that stops at breakpoints in this cell
    prompt_interrupted: bool = False  # the person interrupted a prompt of this cell
    _requests: list = field(default_factory=list)  # (rank, request), not answered yet
    cells: dict[int, RankCell] = field(default_factory=dict)
    started: float = 0.0
    first_done: float | None = None  # when the first rank finished (time.monotonic())
    last_output: float | None = None  # when a rank's latest output came (time.monotonic())
    stall: object | None = None  # a stall.Stall when the wait ended before every rank did
    # Ranks still busy past the grace whose launches so far begin the finished ranks' (the
    # watchdog's last look, cells.py): only slower, waited for, and shown so in the live view.
    stragglers: list = field(default_factory=list)
    # Those of them inside a call of jax or torch at the watchdog's last look: rank -> (its
    # where.Stack, since when it is in that same call, time.monotonic()).
    inside: dict = field(default_factory=dict)
    census: dict = field(default_factory=dict)  # rank -> [launches, digest] (engine/watch/census.py)
    printed: dict = field(default_factory=dict)  # rank -> its printed arrays (engine/arrays/printed.py)
    requests: dict = field(default_factory=dict)  # rank -> the msg_id of its execute request
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _pending: set = field(default_factory=set)  # ranks not finished

    def send(self) -> None:
        client = self.client
        self.started = time.monotonic()
        for rank in self.engine_ids:
            self.cells[rank] = RankCell(rank, max_lines=self.max_lines)
            self._pending.add(rank)
        # (the ranks count their outputs into their replies, and send no idle)
        self.requests = client.cells.send(self.code, {wire.COUNTED: True}, self.engine_ids,
                                          self._events.put)

    def debugger_paused(self) -> list[int]:
        """Ranks of this cell paused in JupyterLab's debugger (the client hears their stops)."""
        paused = getattr(self.client, "paused", None) or {}
        return [rank for rank, eid in self.engine_ids.items()
                if eid in paused and not self.cells[rank].done] if paused else []

    @property
    def busy_ranks(self) -> list[int]:
        return sorted(self._pending)

    @property
    def finished(self) -> bool:
        return not self.busy_ranks

    def poll(self, wait: float, answer: bool = True) -> None:
        """Handle every event that arrives within ``wait`` seconds (at least one, if any),
        and answer the ranks' prompts that came with them, lowest rank first (``answer``
        False: they wait for a poll that answers; a keypress's completion must not)."""
        self._take(wait)
        while answer and self._requests:
            self._take(0.05)  # (prompts of several ranks come together: all of them first)
            self._requests.sort(key=lambda pair: pair[0])
            self._answer(*self._requests.pop(0))

    def _take(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            try:
                rank, kind, content = self._events.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                return
            self._handle(rank, kind, content)
            if self.finished or time.monotonic() >= deadline:
                # drain what is already here without waiting more
                while not self._events.empty():
                    self._handle(*self._events.get_nowait())
                return

    def _handle(self, rank: int, kind: str, content: dict | None) -> None:
        cell = self.cells[rank]
        if kind == DONE:
            content = content or {}
            if content.get("census") is not None:
                self.census[rank] = content["census"]
            if content.get("printed") is not None:
                self.printed[rank] = content["printed"]
            self._pending.discard(rank)
            now = time.monotonic()
            cell.seconds = now - self.started
            cell.finish()
            if self.first_done is None:
                self.first_done = now
            return
        out = output_from_message(kind, content or {})
        if out is None:
            return
        self.last_output = time.monotonic()
        if out.kind == "display" and wire.PROMPT_MIME in out.data:
            self._requests.append((rank, out.data[wire.PROMPT_MIME]))
            self.prompting.add(rank)
            return
        if self.log is not None and out.kind in ("stdout", "stderr"):
            self.log.write(rank, unmarked(out.text))  # (the log: the text as jax made it)
        cell.add(out)
        if self.observer is not None:
            self.observer.output(rank, out)

    def _answer(self, rank: int, request: dict) -> None:
        """Answer one prompt: a breakpoint by the rule, input by the person."""
        started = time.monotonic()
        try:
            if self.prompt_interrupted:  # (the person interrupted: no more questions this cell)
                answer = {"error": "interrupt"}
            elif request["kind"] == "breakpoint":
                if self._stopper is None:
                    # the first to ask: of those that asked within 50 ms (poll collects
                    # them), the lowest; a lower rank that comes later is not waited for
                    self._stopper = rank
                answer = {"stop": self.breakpoints == "all" or rank == self._stopper}
            elif self.observer is None:
                answer = {"error": "input was called on a rank, but nothing answers it."}
            else:
                try:
                    answer = self.observer.prompt(rank, request, self)
                except KeyboardInterrupt:
                    # the rank's prompt ends too, and every other rank's: no rank is left
                    # waiting for an answer
                    self.prompt_interrupted = True
                    self._send(rank, request, {"error": "interrupt"})
                    for other, waiting in self._requests:
                        self._send(other, waiting, {"error": "interrupt"})
                    self._requests.clear()
                    raise
            self._send(rank, request, answer)
        finally:
            self.prompting.discard(rank)
            # The watchdog's clocks stop while the person answers: waiting at a prompt is
            # not diverging.
            waited = time.monotonic() - started
            self.paused += waited
            if self.first_done is not None:
                self.first_done += waited

    def _send(self, rank: int, request: dict, answer: dict) -> None:
        control.request(
            self.client,
            [self.engine_ids[rank]],
            wire.PROMPT_ANSWER,
            {**answer, "id": request["id"]},
            timeout=5.0,
        )

    def result(self) -> CellResult:
        """The cell as it is now, frozen: what the cell runner hands back once its wait is
        over (the ranks still busy in it are kept as they are at this moment)."""
        return CellResult(
            code=self.code,
            cells=MappingProxyType({rank: _as_it_is(cell) for rank, cell in self.cells.items()}),
            engine_ids=MappingProxyType(dict(self.engine_ids)),
            requests=MappingProxyType(dict(self.requests)),
            census=MappingProxyType(dict(self.census)),
            printed=MappingProxyType(dict(self.printed)),
            stall=self.stall,
            started=self.started,
            prompting=frozenset(self.prompting),
            in_debugger=tuple(self.debugger_paused()),
        )

    def wait(
        self,
        until: float | None = None,
        poll: float = 0.1,
    ) -> bool:
        """Wait until every rank finished (True) or the monotonic time ``until`` (False)."""
        while not self.finished:
            if until is not None and time.monotonic() >= until:
                return False
            self.poll(poll if until is None else min(poll, max(0.0, until - time.monotonic())))
        return True


def _as_it_is(cell: RankCell) -> RankCell:
    """A rank's part of a cell as it is now. A finished one no longer changes; a busy one's
    outputs are copied: the live run goes on hearing that rank (the session's
    ``unfinished``), and a result must not change under its reader."""
    if cell.done:
        return cell
    return RankCell(
        cell.rank,
        [replace(out) for out in cell.outputs],
        seconds=cell.seconds,
        max_lines=cell.max_lines,
        left_out=cell.left_out,
    )
