"""On a rank: ``input()``, ``getpass`` and pdb's prompt, answered by the person at the notebook.

A rank's kernel has no front end of its own (ipyparallel never allows stdin), so its
``raw_input`` and ``getpass`` are these (engine/rank_kernel.py): the prompt goes to the notebook as
a display message of its own type (``wire.PROMPT_MIME``) on the rank's output channel, and the
answer comes back on the control channel (``wire.PROMPT_ANSWER``), which the kernel serves on
its own thread while the cell waits here. Both channels are ipyparallel's: signed with the
cluster's key, encrypted off the loopback; no new socket.

``breakpoint()`` and ``pdb.set_trace()`` first ask the notebook whether this rank should stop:
by default only the lowest rank that reaches a breakpoint in a cell stops, and the others go on
(to wait in their next collective).
"""

from __future__ import annotations

import pdb
import queue
import sys
import uuid

from spmd import wire
from spmd.engine.shell import debugging

_waiting: dict[str, queue.SimpleQueue] = {}


def ask(kind: str, prompt: str = "", password: bool = False) -> dict:
    """Send one request to the notebook and wait for its answer (a dict)."""
    from IPython.display import display

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()  # (what pdb printed comes before its prompt)
    rid = uuid.uuid4().hex
    answers = _waiting[rid] = queue.SimpleQueue()
    try:
        request = {"id": rid, "kind": kind, "prompt": prompt, "password": password}
        display({wire.PROMPT_MIME: request, "text/plain": ""}, raw=True)
        while True:
            try:  # (a timeout, so that SIGINT gets through)
                return answers.get(timeout=0.1)
            except queue.Empty:
                continue
    finally:
        _waiting.pop(rid, None)


def _text(answer: dict, prompt: str, password: bool) -> str:
    __tracebackhide__ = True  # (IPython leaves these frames out of the rank's traceback)
    error = answer.get("error")
    if error == "interrupt":
        raise KeyboardInterrupt("interrupted at the prompt")
    if error:
        from IPython.core.error import StdinNotImplementedError

        raise StdinNotImplementedError(error)
    text = answer.get("text", "")
    if text == "\x04":
        raise EOFError
    # the transcript: the prompt and what was typed, as a terminal shows them
    sys.stdout.write(f"{prompt}{'' if password else text}\n")
    return text


def raw_input(prompt: str = "") -> str:
    __tracebackhide__ = True
    prompt = str(prompt)
    return _text(ask("input", prompt), prompt, False)


def getpass(prompt: str = "Password: ", stream=None, **_ignored) -> str:
    __tracebackhide__ = True
    return _text(ask("input", prompt, password=True), prompt, True)


def _stop_here(frame, header: str | None = None) -> None:
    """pdb at ``frame`` when the notebook says this rank is the one to stop."""
    if ask("breakpoint").get("stop"):
        debugger = pdb.Pdb()
        if header is not None:
            debugger.message(header)
        debugger.set_trace(frame)


def breakpoint_hook(*args, **kwargs) -> None:
    """``breakpoint()``: in JupyterLab's debugger where it is attached to this rank, else pdb
    answered in the notebook."""
    if debugging.attached():
        debugging.stop_here(sys._getframe(1))
        return
    _stop_here(sys._getframe(1))


def _set_trace(*, header=None) -> None:
    """``pdb.set_trace()``."""
    _stop_here(sys._getframe(1), header)


def answer(content: dict) -> bool:
    """(the control thread) The notebook's answer, to the prompt waiting for it: whether one
    was."""
    waiting = _waiting.get(content.get("id", ""))
    if waiting is not None:
        waiting.put(content)
    return waiting is not None


def route_breakpoints() -> None:
    """``breakpoint()`` and ``pdb.set_trace()`` ask the notebook first (from the main thread,
    once joined)."""
    sys.breakpointhook = breakpoint_hook
    pdb.set_trace = _set_trace
