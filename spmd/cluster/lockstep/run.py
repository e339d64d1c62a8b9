"""Run one cell on a set of ranks and collect what each rank produced, in order.

The cell goes out once for all its ranks, through the controller's fan-out, and the client's
IO thread hears each rank's outputs, in the order the rank produced them, and when the rank
has finished (channel/client.py; its routes are in place before the request leaves, so
no early output is missed). The IO thread only puts events on a queue: the notebook's main
thread consumes them, which is where streaming to the notebook must happen (ipykernel routes
output by the main thread's current cell).

``CellRun`` is the cell while it runs: the face's cell runner polls it, its observer (the
live view) sees it, and the face keeps it while ranks are still busy in it (``unfinished``:
a later interrupt polls it). ``RankCell`` is one rank's part of it, in the order the rank
produced it, a flood kept short (the rank's log keeps every line). ``records.CellResult`` is
what the cell was once the notebook's wait for it ended (``CellRun.result``): a frozen record
that the magics, the panel and the cell's report read, on the main thread.
"""

from __future__ import annotations

import collections
import queue
import re
import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from spmd import wire
from spmd.cluster.channel import control
from spmd.cluster.channel.client import DONE
from spmd.cluster.records import CellObserver, CellResult, Output, left_out_line

# -- one rank's part of a cell -----------------------------------------------------------------

# Gloo writes this to the C-level stdout of every process when it connects; it says nothing
# the user asked for. Two device threads connecting at once interleave their lines, so any
# line with a piece of it goes.
_GLOO_CHATTER = re.compile(
    r"^.*(?:\[Gloo\] Rank|Expected number of connected peer ranks).*(?:\n|$)", re.M
)


# A printed array's placeholder between its marks (wire.PRINTED_BEGIN, wire.PRINTED_MARK):
# the placeholder, the print's mark (its place in the cell and its number there), its form.
PRINTED = re.compile(re.escape(wire.PRINTED_BEGIN) + "(.*?)" + re.escape(wire.PRINTED_MARK)
                     .replace(r"\{\}", "{}").format(r"([0-9a-f]+-\d+)([srf])"), re.S)
_MARKS = re.compile(re.escape(wire.PRINTED_BEGIN) + "|" + re.escape(wire.PRINTED_MARK)
                    .replace(r"\{\}", "{}").format(r"[0-9a-f]+-\d+[srf]"))


def unmarked(text: str) -> str:
    """The text as the rank's program made it: placeholders without their marks."""
    return _MARKS.sub("", text) if "\x00" in text else text


def drop_chatter(text: str) -> str:
    if "[Gloo]" not in text and "Expected number of connected" not in text:
        return text
    return _GLOO_CHATTER.sub("", text)


@dataclass
class RankCell:
    """One rank's part of one cell.

    With ``max_lines``, at most that many lines of its streams are kept (the first half and
    the last half, with a line that says how many were left out in between): a rank that
    prints a million lines must not fill the notebook. Its log keeps them all.
    """

    rank: int
    outputs: list[Output] = field(default_factory=list)
    done: bool = False
    seconds: float | None = None
    max_lines: int | None = None
    left_out: int = 0  # stream lines not kept
    _head: int = 0  # stream lines kept from the start
    _head_chars: int = 0  # ... and their characters
    _tail: collections.deque | None = None  # (stream, line) kept since the head was full

    @property
    def error(self) -> Output | None:
        return next((o for o in self.outputs if o.kind == "error"), None)

    def add(self, out: Output) -> None:
        """Append, merging a stream chunk into the previous chunk of the same stream."""
        if out.kind in ("stdout", "stderr") and self.max_lines is not None:
            out = self._keep_head(out)
            if out is None:
                return
        self._append(out)

    def _append(self, out: Output) -> None:
        if out.kind in ("stdout", "stderr") and self.outputs and self.outputs[-1].kind == out.kind:
            self.outputs[-1].text += out.text
        else:
            self.outputs.append(out)

    def _keep_head(self, out: Output) -> Output | None:
        """The part of a stream chunk that fits in the head; the rest goes to the tail.
        Lines and characters both count: output with no newline is capped too."""
        half = max(1, self.max_lines // 2)
        if self._tail is None:
            room = half - self._head
            chars = half * LINE_WIDTH - self._head_chars  # (what the head may still hold)
            lines = pieces(out.text)
            if len(lines) <= room and len(out.text) <= chars:
                self._head += out.text.count("\n")
                self._head_chars += len(out.text)
                return out
            keep = 0
            for piece in lines[:room]:
                if len(piece) > chars:
                    break
                keep, chars = keep + 1, chars - len(piece)
            self._head += keep
            self._tail = collections.deque(maxlen=max(1, self.max_lines - half))
            if keep:
                self._append(Output(out.kind, "".join(lines[:keep])))
            rest = lines[keep:]
        else:
            rest = pieces(out.text)
        tail = self._tail
        if rest and tail and tail[-1][0] == out.kind and not tail[-1][1].endswith("\n"):
            # the rest of a line begun before (cut again where it grew past LINE_WIDTH)
            rest = pieces(tail.pop()[1] + rest[0]) + rest[1:]
        if len(rest) >= tail.maxlen:  # (a million lines come in big chunks: skip, don't loop)
            self.left_out += len(tail) + len(rest) - tail.maxlen
            tail.clear()
            rest = rest[-tail.maxlen :]
        else:
            self.left_out += max(0, len(tail) + len(rest) - tail.maxlen)
        tail.extend((out.kind, line) for line in rest)
        return None

    def finish(self) -> None:
        if self._tail is not None and self.left_out:
            self._append(Output("stderr", left_out_line(self.left_out)))
        for kind, line in self._tail or ():
            self._append(Output(kind, line))
        self._tail = None
        for out in self.outputs:
            if out.kind in ("stdout", "stderr"):
                out.text = drop_chatter(out.text)
        self.outputs = [o for o in self.outputs if o.kind not in ("stdout", "stderr") or o.text]
        self.done = True


# Where --max-output counts lines, a longer line counts as several of at most this many
# characters: output without newlines (print('.', end='') in a loop) is capped as well.
LINE_WIDTH = 500


def pieces(text: str) -> list[str]:
    """``text`` as lines (with their ends), each cut into pieces of at most LINE_WIDTH."""
    found = []
    for line in text.splitlines(keepends=True):
        while len(line) > LINE_WIDTH:
            found.append(line[:LINE_WIDTH])
            line = line[LINE_WIDTH:]
        found.append(line)
    return found


# ipykernel names each cell's code after the process's pid (/tmp/ipykernel_4242/31337.py), so
# a warning about line 1 of a cell would differ on every rank only by that name.
_CELL_PATH = re.compile(r"\S*[/\\]ipykernel_\d+[/\\]\d+\.py")


def same_on_every_rank(text: str) -> str:
    """``text`` with the per-process names of cells replaced by '<cell>'."""
    return _CELL_PATH.sub("<cell>", text) if "ipykernel_" in text else text


def output_from_message(msg_type: str, content: dict) -> Output | None:
    """Turn one iopub message of an engine into an Output (None for the rest)."""
    if msg_type == "stream":
        return Output(kind=content["name"], text=same_on_every_rank(content["text"]))
    if msg_type == "display_data":
        # (a global array's parts are for a cell's value only: a display of one is marked as
        # a print of it is, its parts sent with the cell's reply: engine/arrays/print_marks.py)
        data = {k: v for k, v in content["data"].items() if k != wire.GLOBAL_ARRAY_MIME}
        return Output("display", data=data, metadata=content.get("metadata", {}))
    if msg_type == "execute_result":
        return Output("result", data=content["data"], metadata=content.get("metadata", {}))
    if msg_type == "clear_output":
        return Output("clear", data={"wait": bool(content.get("wait", False))})
    if msg_type == "error":
        return Output(
            "error",
            ename=content.get("ename", ""),
            evalue=content.get("evalue", ""),
            traceback=[same_on_every_rank(line) for line in content.get("traceback", [])],
        )
    return None


# -- the cell on its ranks --------------------------------------------------------------------


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
    stall: object | None = None  # a records.Stall when the wait ended before every rank did
    # Ranks still busy past the grace whose launches so far begin the finished ranks' (the
    # watchdog's last look, cells.py): only slower, waited for, and shown so in the live view.
    stragglers: list = field(default_factory=list)
    # Those of them inside a call of jax or torch at the watchdog's last look: rank -> (its
    # where.Stack, since when it is in that same call, time.monotonic()).
    inside: dict = field(default_factory=dict)
    census: dict = field(default_factory=dict)  # rank -> [launches, digest] (engine/watch/launches.py)
    printed: dict = field(default_factory=dict)  # rank -> its printed arrays (engine/arrays/print_marks.py)
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
