"""On a rank: answer "where are you?" and take signals over ipyparallel's control channel.

A rank on another host has no process handle and no stack file the notebook can read. The
control channel reaches every rank wherever it runs, is signed with the cluster's key (and
encrypted with CurveZMQ when the cluster leaves the loopback), and is served by the kernel's
control thread: it answers while the main thread runs a cell, as long as the cell lets go of
the GIL, which a rank waiting in a collective does. Replies are JSON, never pickles.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading

from spmd.engine.orphans import end_children

WHERE = "spmd_where_request"
SIGNAL = "spmd_signal_request"


def stack_of(thread_id: int) -> list[list]:
    """A thread's Python stack, outermost first: [file, line, function, source line]."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        code = frame.f_code
        source = linecache.getline(code.co_filename, frame.f_lineno).strip()
        frames.append([code.co_filename, frame.f_lineno, code.co_name, source])
        frame = frame.f_back
    return frames[::-1]


def _exit_now(signum: int) -> None:
    end_children()
    os._exit(128 + signum)


def install(kernel, main_thread: int) -> None:
    """Add the two requests to this engine's kernel (from the main thread, once joined)."""

    def where(stream, ident, parent) -> None:
        content = {"status": "ok", "frames": stack_of(main_thread)}
        kernel.session.send(stream, "spmd_where_reply", content, parent, ident)

    def send_signal(stream, ident, parent) -> None:
        signum = int(parent["content"]["signum"])
        kernel.session.send(stream, "spmd_signal_reply", {"status": "ok"}, parent, ident)
        if signum == signal.SIGTERM:
            # Python runs signal handlers on the main thread only, and a rank blocked in a
            # collective never gets there: a stop ends the process from here instead, once
            # zmq's own thread has had a moment to send the reply.
            stream.flush()
            threading.Timer(0.05, _exit_now, (signum,)).start()
            return
        os.kill(os.getpid(), signum)

    kernel.control_handlers[WHERE] = where
    kernel.control_handlers[SIGNAL] = send_signal
