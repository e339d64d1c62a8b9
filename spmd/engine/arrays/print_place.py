"""On a rank: where a print is, in words every rank that runs the same cells makes alike
(engine/arrays/print_marks.py marks each printed placeholder with it, and the notebook matches the ranks'
parts by it, never by the order each rank printed in).

Threads: called on the thread that writes (or reprs); ``_loops``, a cache of each file's
``for`` loops, is filled whole and then published, so any thread may read it.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import os
import re
import sys
import threading
import zlib

import spmd


def is_cell(name: str) -> bool:
    return "ipykernel_" in name or name.startswith("<ipython-input")


def cell_line() -> tuple[int, int] | None:
    """The cell's frame and the line it is on now (None outside a cell): a placeholder is
    marked only in what is written from the line that made it (``print(x)``, an f-string,
    ``pprint``), never in text written later that holds the same words (``str(x)`` written
    to a file, then the file printed)."""
    frame = sys._getframe(2)
    while frame is not None:
        if is_cell(frame.f_code.co_filename):
            return id(frame), frame.f_lineno
        frame = frame.f_back
    return None


# Pools run whichever task comes next on whichever worker is free: a print's place there
# says nothing of which task made it, which differs from rank to rank.
_POOLS = (os.path.join("concurrent", "futures", "thread.py"),
          os.path.join("multiprocessing", "pool.py"))
_EVENT_LOOP = os.path.join("asyncio", "events.py")
_THREAD_COUNT = re.compile(r"^Thread-\d+")
# Frames whose ``for`` loops are not the program's: Python's, the libraries', spmd's own.
_LIBRARIES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix,
                    os.path.dirname(os.path.abspath(spmd.__file__))})


def place() -> str | None:
    """Where the print is, the same words on every rank that runs the same cells: the thread
    that prints (for one of its own), and every frame from the outermost cell frame down to
    the print (its file, function and line: a function of the user's module called from two
    lines is two places, and so is each line of that function), with the values of the
    ``for`` loops around each line of the program's own code (a rank that skips a step of a
    loop does not pair its next print with another rank's print of that step). A cell's file
    is named by its code's hash (ipykernel), never by the rank's pid. None where no place can
    be told alike: a pool's worker, an asyncio task, or a thread whose name another thread
    has."""
    frames, outermost, loop = [], None, False
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_POOLS):
            return None
        loop = loop or name.endswith(_EVENT_LOOP)
        frames.append(frame)
        if is_cell(name):
            outermost = len(frames)
        frame = frame.f_back
    if loop and outermost is not None and frames[outermost - 1].f_code.co_name != "<module>":
        return None  # (an asyncio task of the cell's: tasks run in the order I/O allows)
    thread = threading.current_thread()
    who = ""
    if thread is not threading.main_thread():
        # (a thread's name without the process's count of threads made so far, which the
        # ranks need not share: "Thread-7 (worker)" is "Thread (worker)")
        who = _THREAD_COUNT.sub("Thread", thread.name)
        if sum(_THREAD_COUNT.sub("Thread", other.name) == who
               for other in threading.enumerate()) > 1:
            return None
    words = [who]
    for frame in reversed(frames[:outermost]):
        name, line = frame.f_code.co_filename, frame.f_lineno
        steps = "" if name.startswith(_LIBRARIES) and not is_cell(name) else ",".join(
            _step(frame, loop) for loop in _loops_around(name, line))
        words.append(f"{os.path.basename(name)}:{frame.f_code.co_name}:{line}:{steps}")
    return f"{zlib.crc32('|'.join(words).encode()):08x}"


_loops: dict[str, dict[int, list[str]]] = {}  # a file -> line -> its loops' names


def _loops_around(filename: str, line: int) -> list[str]:
    """The names each ``for`` loop around ``line`` assigns (a file is read once)."""
    table = _loops.get(filename)
    if table is None:
        table = {}  # (filled here, then published whole: any writer's thread reads it)
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                names = [n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)]
                where = node if not isinstance(node, ast.comprehension) else node.target
                for at in range(where.lineno, (getattr(node, "end_lineno", None)
                                               or where.end_lineno) + 1):
                    table.setdefault(at, []).extend(names)
        if len(_loops) > 256:
            _loops.clear()
        _loops[filename] = table
    return table.get(line, [])


def _step(frame, name: str) -> str:
    """A loop variable's value, where it is a plain one (a count, a name); else '?'. Read
    from a cell's or a module's namespace only: before Python 3.13 reading a function's
    ``f_locals`` keeps a copy of all its locals on the frame (the step's arrays, alive after
    ``del x``), so a function's loops count by their line alone there."""
    if frame.f_code.co_flags & inspect.CO_OPTIMIZED and sys.version_info < (3, 13):
        return "?"
    value = frame.f_locals.get(name)
    if isinstance(value, (bool, int, float, str)) and len(repr(value)) < 100:
        return repr(value)
    return "?"
