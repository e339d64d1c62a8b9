"""Where a busy rank is: its main thread's Python stack, read without its cooperation.

Each engine registers faulthandler on a signal (see ``spmd.engine.watch.stacks``): the notebook
sends the signal and reads the dump the rank appends to its stack file. This works while the
rank is blocked in a collective, in C++ that holds the GIL, or in a loop, because faulthandler
writes from inside the signal handler. The notebook asks this way only a rank that did not
answer on its control channel (``CellRunner.stacks``): such a dump reads the other threads'
frames while they run, which can crash a rank whose threads come and go.

Frames of cells have ipykernel's file names (``/tmp/ipykernel_<pid>/<hash>.py``, the hash of
the cell's text). The notebook knows the text of the cells it sent, so it shows their lines;
library frames get their lines from the same files the rank runs (local clusters).
"""

from __future__ import annotations

import linecache
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from spmd.engine.watch.stacks import WHERE_SIGNAL

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_CELL_FILE = re.compile(r"[/\\]ipykernel_\d+[/\\](\d+)\.py$")
# Where installed packages live; frames there are "library" frames, collapsed in reports.
_PACKAGES = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")
_STDLIB = os.path.dirname(os.__file__)
_CENSUS_FILE = os.path.join("spmd", "engine", "watch", "launches.py")

# The libraries whose frames mean "waiting on the other ranks" when a rank is stuck in them.
COLLECTIVE_LIBRARIES = ("jax", "jaxlib", "torch", "flax", "optax", "equinox")
# The rank's own machinery between the user's code and jax (the census's wrapper of jax.jit,
# the printing of global arrays): looked through, neither the user's code nor a library's.
_ENGINE = re.compile(r"[/\\]spmd[/\\]engine[/\\](?:[^/\\]+[/\\])*[^/\\]+\.py$")
# Where jax and torch build a program (trace, lower, compile): a rank there works, not waits.
_BUILDING = re.compile(
    r"[/\\]jax[/\\]_src[/\\](?:interpreters[/\\](?:partial_eval|mlir)|compiler"
    r"|compilation_cache)\.py$|[/\\]torch[/\\]_(?:dynamo|inductor)[/\\]"
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    source: str = ""  # the line's text, when known

    @property
    def in_cell(self) -> bool:
        return _CELL_FILE.search(self.file) is not None

    @property
    def library(self) -> str:
        """The installed package this frame runs in ('jax'), 'python' for the standard
        library, or '' for the user's own code."""
        m = _PACKAGES.search(self.file)
        if m:
            return m.group(1).split(".")[0].split("-")[0]
        if self.file.startswith(_STDLIB):
            return "python"
        return ""


@dataclass(frozen=True)
class Inside:
    """A rank's main thread inside a call of jax or torch (``Stack.inside``)."""

    library: str  # 'jax'
    frame: Frame  # the library's innermost frame: where the call is now
    building: bool  # tracing, lowering or compiling a program: working, not waiting
    # (jax's compiler, its lowering to MLIR and its tracing; torch.compile's dynamo, inductor)

    @property
    def where(self) -> str:
        """'_value, jax/_src/array.py line 623'."""
        f = self.frame
        m = _PACKAGES.search(f.file)
        return f"{f.function}, {f.file[m.start(1):] if m else f.file} line {f.line}"


@dataclass
class Stack:
    """One rank's main-thread stack, outermost frame first, from the cell on."""

    rank: int
    frames: list[Frame]

    @property
    def waiting_in(self) -> str:
        """The library of collectives ('jax') the rank is inside, innermost first; ''."""
        for f in reversed(self.frames):
            if f.library in COLLECTIVE_LIBRARIES:
                return f.library
        return ""

    @property
    def inside(self) -> Inside | None:
        """The call into jax or torch (``COLLECTIVE_LIBRARIES``) the rank is in, where its
        innermost frames are that library's; None where they are the user's own code (the
        cell, a function of another file), another library's or the kernel's. The standard
        library's frames and spmd's engine (the census, printing a global array) are looked
        through: ``print(x)`` of a global array blocks in jax below them."""
        for f in reversed(self.frames):
            if f.library == "python" or _ENGINE.search(f.file):
                continue
            if f.library not in COLLECTIVE_LIBRARIES:  # (the user's code, another library)
                return None
            # (building anywhere on the stack: tracing runs the user's function inside jax)
            return Inside(f.library, f, any(_BUILDING.search(g.file) for g in self.frames))
        return None

    @property
    def cell_line(self) -> Frame | None:
        """The innermost frame of the user's cells: the line the rank is blocked on."""
        user = [f for f in self.frames if f.in_cell]
        return user[-1] if user else None

    @property
    def at_cell_line(self) -> str:
        """'at cell line 4: print(total)', or '' when no cell frame is on the stack."""
        at = self.cell_line
        if at is None:
            return ""
        return f"at cell line {at.line}: {at.source}" if at.source else f"at cell line {at.line}"

    def lines(self) -> list[str]:
        """The stack in traceback style, with runs of library frames collapsed."""
        out: list[str] = []
        # (the census's wrapper of jax.jit and torch's collectives: not the user's code)
        frames = [f for f in self.frames if not f.file.endswith(_CENSUS_FILE)]
        i = 0
        while i < len(frames):
            f = frames[i]
            if not f.library:
                out.extend(_frame_lines(f))
                i += 1
                continue
            j = i
            while j + 1 < len(frames) and frames[j + 1].library:
                j += 1
            # A run of library frames: the call into it, and where it is now.
            out.extend(_frame_lines(frames[i]))
            hidden = j - i - 1
            if hidden > 0:
                libs = sorted({fr.library for fr in frames[i + 1 : j]})
                frames_word = "frame" if hidden == 1 else "frames"
                out.append(f"    ... {hidden} more {frames_word} in {', '.join(libs)} ...")
            if j > i:
                out.extend(_frame_lines(frames[j]))
            i = j + 1
        return out


def _frame_lines(f: Frame) -> list[str]:
    if f.in_cell:
        where = "Cell"
    else:
        # an installed package's file from its package on ('jax/_src/array.py')
        m = _PACKAGES.search(f.file)
        where = f'File "{f.file[m.start(1) :] if m else f.file}"'
    head = f"  {where}, line {f.line}, in {f.function}"
    return [head, f"    {f.source}"] if f.source else [head]


def parse_dump(text: str, thread: int | None) -> list[Frame]:
    """The frames of one thread in a faulthandler dump, outermost first.

    ``thread`` is the thread's ident; None takes the thread that received the signal.
    """
    parts = _THREAD.split(text)  # [before, kind, ident, body, kind, ident, body, ...]
    chosen = None
    for kind, ident, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        if (int(ident, 16) == thread) if thread is not None else kind == "Current thread":
            chosen = body
    if chosen is None:
        return []
    frames = []
    for line in chosen.splitlines():
        m = _FRAME.match(line)
        if m:
            frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    frames.reverse()  # faulthandler writes the most recent call first
    return frames


def cell_stack(rank: int, frames: list[Frame], cells: Iterable[str]) -> Stack:
    """A rank's frames from the cell on, with the lines of the cells the notebook sent."""
    return Stack(rank, with_sources(from_cell_on(frames), cells))


def from_cell_on(frames: list[Frame]) -> list[Frame]:
    """Drop the kernel's own frames (the event loop, ipykernel, IPython) above the cell."""
    for i, f in enumerate(frames):
        if f.in_cell:
            return frames[i:]
    return frames[-8:]


def with_sources(frames: list[Frame], cells: Iterable[str]) -> list[Frame]:
    """Fill in each frame's source line: cells from their text, files from disk."""
    by_name: dict[str, list[str]] | None = None
    out = []
    for f in frames:
        m = _CELL_FILE.search(f.file)
        if m:
            if by_name is None:
                by_name = {cell_file_name(code): _as_run(code) for code in cells}
            lines = by_name.get(m.group(1), [])
            text = lines[f.line - 1] if 0 < f.line <= len(lines) else ""
        else:
            # (a rank on another host sends its own line: the file may not exist here)
            text = f.source or linecache.getline(f.file, f.line)
        out.append(Frame(f.file, f.line, f.function, text.strip()))
    return out


def _as_run(code: str) -> list[str]:
    """The lines of a cell as the rank compiled it: IPython drops leading blank lines and
    turns magics into calls, which moves line numbers."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(code).splitlines()


def cell_file_name(code: str) -> str:
    """The number ipykernel names a cell's file by (``<number>.py``)."""
    from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86

    return str(murmur2_x86(code, get_tmp_hash_seed()))


def dump(
    targets: dict[int, tuple[object, str, int | None]], timeout: float = 1.0
) -> dict[int, list[Frame] | None]:
    """Ask ranks for their stacks at once and read the answers.

    ``targets`` maps rank -> (a psutil process, its stack file, its main thread's ident).
    A rank that does not answer within ``timeout`` maps to None.
    """
    start = {rank: _size(path) for rank, (_, path, _) in targets.items()}
    for process, _, _ in targets.values():
        try:
            process.send_signal(WHERE_SIGNAL)
        except Exception:  # already gone: it will not answer
            pass
    sizes, grew_at = dict(start), {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = time.monotonic()
        waiting = 0
        for rank, (process, path, _) in targets.items():
            size = _size(path)
            if size > sizes[rank]:
                sizes[rank], grew_at[rank] = size, now
            # faulthandler writes a dump within one signal handler: 20 ms without growth
            # after the first bytes means it is complete. A process that is gone never answers.
            answered = rank in grew_at and now - grew_at[rank] > 0.02
            if not answered and _alive(process):
                waiting += 1
        if not waiting:
            break
    result: dict[int, list[Frame] | None] = {}
    for rank, (_, path, thread) in targets.items():
        if sizes[rank] <= start[rank]:
            result[rank] = None
            continue
        with open(path, errors="replace") as f:
            f.seek(start[rank])
            result[rank] = parse_dump(f.read(), thread)
    return result


def _alive(process) -> bool:
    try:
        return process.is_running() and process.status() != "zombie"
    except Exception:  # psutil.NoSuchProcess and friends
        return False


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
