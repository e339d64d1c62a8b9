"""On a rank: ``print(x)`` and ``display(x)`` of a jax.Array (or torch DTensor) over several
processes, shown in the notebook as one process of all the devices prints it.

jax prints such an array as a placeholder (``Array(shape=(4, 8), dtype=float32)``): its
``__str__``, ``__format__`` and ``__repr__`` all come down to ``repr``. A DTensor prints the
shard this process holds (``DTensor(local_tensor=...)``), different on every rank. The rank's
own text is left as the library makes it, so ``str(x)`` written to a file, logged or compared is
jax's (or torch's). What changes is only what reaches the notebook: ``repr`` notes each
placeholder it makes (on the thread that made it), and the rank's stdout and stderr
(engine/streams.py), when their text holds such a placeholder, put marks around it
(``wire.PRINTED_BEGIN``, ``wire.PRINTED_MARK``) and keep the parts of the array's printed form
this rank holds, as a cell's value does (engine/results.py). ``display(x)`` is the same, its
text/plain marked (``display_text``). The parts go to the notebook in the cell's reply
(``wire.PRINTED_ARRAYS``): no collective, no round trip, and nothing for an array no output
shows. An array is sent once per cell however often it is printed; at most ``MAX_ARRAYS``
arrays a cell (the rest stay placeholders, and the notebook says so).

Threads: ``repr`` notes on the thread that calls it (thread-local); the streams' ``write``
runs on the writer's thread and takes the cell's table under ``_lock``; the main thread takes
the table at the cell's reply (``into``).
"""

from __future__ import annotations

import sys
import threading

from spmd import wire

MAX_ARRAYS = 100  # arrays rebuilt per cell (each one's corners are copied from its devices)

# .pending: [(placeholder, array, form)] made since this thread's last write; .form: "s"
# while str() or format() runs (numpy's form), "-" for a format spec of its own, else "r"
_noted = threading.local()
_lock = threading.Lock()
_parts: dict[int, dict] = {}  # this cell's: mark number -> the parts (None: none to send)
_marks: dict[int, tuple[int, object]] = {}  # id(array) -> (mark number, the array, kept alive)
_left_out = 0  # arrays of this cell past MAX_ARRAYS
_installed: set[str] = set()  # the libraries whose arrays are noted: "jax", "torch"


def install() -> None:
    """Note the placeholders jax's (and torch's DTensor's) ``repr`` makes, once each library
    is imported (called before every cell: cheap once both are)."""
    if "jax" not in _installed and "jax._src.array" in sys.modules:
        _install_jax(sys.modules["jax._src.array"].ArrayImpl)
        _installed.add("jax")
    if "torch" not in _installed and "torch.distributed.tensor" in sys.modules:
        _install_torch(sys.modules["torch.distributed.tensor"].DTensor)
        _installed.add("torch")
    if _installed:
        from spmd.engine import results

        results.marked_display = display_text


def _note(text: str, array) -> None:
    """(the thread calling repr) ``text`` is the placeholder of ``array``: noted for the
    thread's next write."""
    pending = getattr(_noted, "pending", None)
    if pending is None:
        pending = _noted.pending = []
    # (str() and format() of such an array are its repr: which one asked decides the form one
    # process prints, numpy's str or jax's Array(...))
    pending.append((text, array, getattr(_noted, "form", "r"), _cell_line()))
    del pending[:-64]  # (a repr no output shows is forgotten soon)


def _install_jax(impl) -> None:
    original_repr, original_str, original_format = impl.__repr__, impl.__str__, impl.__format__

    def __repr__(self):
        text = original_repr(self)
        try:
            if text.startswith("Array(shape=") and not (
                    self.is_fully_addressable or self.is_fully_replicated):
                _note(text, self)
        except Exception:  # (an array being deleted: jax's text, unmarked)
            pass
        return text

    def as_str(call):
        def wrapped(self, *args):
            before = getattr(_noted, "form", "r")
            # (a format spec of its own: numpy's would refuse it, so it is left as it is)
            _noted.form = "s" if not args or not args[0] else "-"
            try:
                return call(self, *args)
            finally:
                _noted.form = before
        return wrapped

    impl.__repr__ = __repr__
    impl.__str__ = as_str(original_str)
    impl.__format__ = as_str(original_format)


def _install_torch(dtensor) -> None:
    original_repr = dtensor.__repr__

    def __repr__(self, *args, **kwargs):
        text = original_repr(self, *args, **kwargs)
        try:  # (sharded over several processes: Partial has no block to show, as a value)
            if self.device_mesh.size() > 1 and any(p.is_shard() for p in self.placements) \
                    and not any(p.is_partial() for p in self.placements):
                _note(text, self)
        except Exception:  # (a DTensor this does not know: torch's text, unmarked)
            pass
        return text

    dtensor.__repr__ = __repr__


def display_text(array) -> str | None:
    """(the main thread, display(x)) The array's text/plain marked for the notebook, as a
    print of it is (None: not an array over several processes, or past the cap)."""
    text = repr(array)
    pending = getattr(_noted, "pending", None)
    if not pending or pending[-1][1] is not array:
        return None
    line = pending.pop()[3]
    if line is None:  # (not a cell's display: a variable inspector's, the debugger's)
        return None
    mark = _mark_of(array)
    if mark is None:
        return None
    return wire.PRINTED_BEGIN + text + wire.PRINTED_MARK.format(f"{mark}r")


def marked(text: str) -> str:
    """(the writer's thread) ``text`` with a mark after each placeholder of an array this
    thread's ``repr`` made since its last write, the latest matched last."""
    pending = getattr(_noted, "pending", None)
    if not pending:
        return text
    _noted.pending = []
    end = len(text)
    found = []
    here = _cell_line()
    for placeholder, array, form, line in reversed(pending):
        if line != here:  # (made on another line of the cell: str(x) for the program's own use)
            continue
        at = text.rfind(placeholder, 0, end)
        if at < 0:
            continue
        end = at
        mark = _mark_of(array) if form != "-" else None
        if mark is not None:
            found.append((at, at + len(placeholder), f"{mark}{form}"))
    for at, where, mark in sorted(found, reverse=True):
        text = (text[:at] + wire.PRINTED_BEGIN + text[at:where] + wire.PRINTED_MARK.format(mark)
                + text[where:])
    return text


def _cell_line() -> tuple[int, int] | None:
    """The cell's frame and the line it is on now (None outside a cell): a placeholder is
    marked only in what is written from the line that made it (``print(x)``, an f-string,
    ``pprint``), never in text written later that holds the same words (``str(x)`` written
    to a file, then the file printed)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "ipykernel_" in name or name.startswith("<ipython-input"):
            return id(frame), frame.f_lineno
        frame = frame.f_back
    return None


def _mark_of(array) -> int | None:
    """The array's number in this cell, its parts made the first time (None: past the cap,
    or no printed form can be made of it)."""
    global _left_out
    with _lock:
        known = _marks.get(id(array))
        if known is not None and known[1] is array:
            return known[0]
        if len(_marks) >= MAX_ARRAYS:
            _left_out += 1
            return None
        mark = len(_marks)
        _marks[id(array)] = (mark, array)
    from spmd.engine import results

    try:
        torch = type(array).__module__.startswith("torch")
        parts = results._torch_parts(array) if torch else results._parts(array)
    except Exception:  # (a kind of array this does not know: jax's placeholder stays)
        parts = None
    with _lock:
        _parts[mark] = parts[results.MIME] if parts else None
    return mark


def into(metadata: dict) -> None:
    """(the main thread, at the cell's reply) The cell's printed arrays into its reply's
    metadata; the table starts again for the next cell."""
    global _left_out
    with _lock:
        if _parts or _left_out:
            metadata[wire.PRINTED_ARRAYS] = {
                "parts": {str(k): v for k, v in _parts.items() if v is not None},
                "left_out": _left_out,
            }
        _parts.clear()
        _marks.clear()
        _left_out = 0
