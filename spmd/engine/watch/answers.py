"""On a rank: answer "where are you?" and take signals over ipyparallel's control channel.

A rank on another host has no process handle and no stack file the notebook can read. The
control channel reaches every rank wherever it runs, is signed with the cluster's key (and
encrypted with CurveZMQ when the cluster leaves the loopback), and is served by the kernel's
control thread: it answers while the main thread runs a cell, as long as the cell lets go of
the GIL, which a rank waiting in a collective does. Replies are JSON, never pickles.

The rank's kernel (rank_kernel.py) takes the requests (``wire.WHERE_REQUEST``,
``wire.SIGNAL_REQUEST``) and replies; what it answers is made here.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading

from spmd.engine.life.orphans import exit_now


def stack_of(thread_id: int, most: int = 100) -> list[list]:
    """A thread's Python stack, outermost first: [file, line, function, source line], its
    innermost ``most`` frames (as faulthandler's dump keeps them)."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None and len(frames) < most:
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        frames.append([code.co_filename, frame.f_lineno, code.co_name, source])
        frame = frame.f_back
    return frames[::-1]


def signal_self(stream, signum: int) -> None:
    """(the control thread, its reply sent on ``stream``) ``signum`` to this process."""
    if signum == signal.SIGTERM:
        # Python runs signal handlers on the main thread only, and a rank blocked in a
        # collective never gets there: a stop ends the process from here instead, once
        # zmq's own thread has had a moment to send the reply.
        stream.flush()
        threading.Timer(0.05, exit_now, (signum,)).start()
        return
    os.kill(os.getpid(), signum)
