"""What one cell produced on each rank, in the order the rank produced it."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

from spmd import wire
from spmd.cluster.records import Output

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


def left_out_line(lines: int) -> str:
    """The same on every rank that left out as many lines, so that it groups."""
    return f"... {lines:,} lines left out here (%spmd log RANK shows a rank's whole output) ...\n"


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
        # a print of it is, its parts sent with the cell's reply: engine/arrays/printed.py)
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
