"""SIGINT during a change of the cluster's life: held until the change has finished.

A stop, a restart, a start's last steps and a cell's report are short, and one cut halfway
leaves processes running or a rank table that names ended processes. The notebook's Interrupt
is a SIGINT, and Python raises it on the main thread wherever that thread happens to be. So
inside ``held(what)`` a SIGINT is noted instead of raised (as gunicorn's arbiter queues its
signals rather than acting where they land), and when the outermost held stretch ends the
cell is told, once, what the interrupt waited for. ``interruptible()`` opens a stretch inside
one where SIGINT raises again: a start's engines and join, which an interrupt may cancel
(the start then ends what it began).

Main thread only: Python runs signal handlers there, and on other threads these do nothing.
The module's state (the depth of held stretches, what was noted) is the main thread's.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

_held: list[str] = []  # what is under way, outermost first
_noted: list[str] = []  # what each SIGINT landed in, since the outermost stretch began
_outside = None  # the SIGINT handler to restore (and to use in an interruptible stretch)


def _note(signum, frame) -> None:
    _noted.append(_held[-1] if _held else "")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def held(what: str):
    """SIGINT waits until the block ends; ``what`` ("the stop") is named if one came. Inside
    an interruptible stretch, one that came is raised when the block ends."""
    global _outside
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _note)
    if not _held:
        _outside = previous
        _noted.clear()
    _held.append(what)
    try:
        yield
    finally:
        _held.pop()
        signal.signal(signal.SIGINT, previous)
        if _noted and not _held:
            sys.stderr.write(
                f"Interrupt held until {what} finished: {what} is never cut halfway.\n"
            )
            _noted.clear()
        elif _noted and previous is not _note:  # (held inside interruptible: raise it now)
            _noted.clear()
            raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible():
    """Inside a held stretch: SIGINT raises KeyboardInterrupt again for this block (at once,
    if one came before it). Outside one: nothing changes."""
    if not _main_thread() or not _held:
        yield
        return
    came = bool(_noted)
    _noted.clear()
    handler = _outside if callable(_outside) else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler)
    try:
        if came:
            raise KeyboardInterrupt
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
