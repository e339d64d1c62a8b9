"""On a rank: ``input()``, ``getpass`` and pdb's prompt, answered by the person at the notebook.

A rank's kernel has no front end of its own (ipyparallel never allows stdin), so its
``raw_input`` and ``getpass`` are these (``Prompts``): the prompt goes to the notebook as
a display message of its own type (``wire.PROMPT_MIME``) on the rank's output channel, and the
answer comes back on the control channel (``wire.PROMPT_ANSWER``), which the kernel serves on
its own thread while the cell waits here. Both channels are ipyparallel's: signed with the
cluster's key, encrypted off the loopback; no new socket.

``breakpoint()`` and ``pdb.set_trace()`` first ask the notebook whether this rank should stop:
by default only the lowest rank that reaches a breakpoint in a cell stops, and the others go on
(to wait in their next collective).

The waiting prompts are the rank kernel's (``RankKernel.prompts``, engine/rank_kernel.py, one
``Prompts``), whose ``raw_input`` and ``getpass`` are the kernel's (bound methods: no frame of
the kernel's in a prompt's traceback); ``route_breakpoints`` gives ``sys.breakpointhook`` and
``pdb.set_trace`` its own.

Threads: a prompt waits on the thread that asked (the main thread, where cells run; or a
cell's own thread), in ``waiting`` by its id; the control thread puts the answer in its queue
(``answer``), and the asking thread takes the prompt out of ``waiting`` when it is answered.
"""

from __future__ import annotations

import pdb
import queue
import sys
import uuid

from spmd import wire
from spmd.engine.shell import debugging


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


class Prompts:
    """This rank's prompts waiting for the notebook's answer, and the functions that ask."""

    def __init__(self, debugger: debugging.Debugging) -> None:
        self.waiting: dict[str, queue.SimpleQueue] = {}  # prompt id -> where its answer goes
        self._debugging = debugger  # (a breakpoint stops in JupyterLab's, where attached)

    def ask(self, kind: str, prompt: str = "", password: bool = False) -> dict:
        """Send one request to the notebook and wait for its answer (a dict)."""
        from IPython.display import display

        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # (what pdb printed comes before its prompt)
        rid = uuid.uuid4().hex
        answers = self.waiting[rid] = queue.SimpleQueue()
        try:
            request = {"id": rid, "kind": kind, "prompt": prompt, "password": password}
            display({wire.PROMPT_MIME: request, "text/plain": ""}, raw=True)
            while True:
                try:  # (a timeout, so that SIGINT gets through)
                    return answers.get(timeout=0.1)
                except queue.Empty:
                    continue
        finally:
            self.waiting.pop(rid, None)

    def raw_input(self, prompt: str = "") -> str:
        __tracebackhide__ = True
        prompt = str(prompt)
        return _text(self.ask("input", prompt), prompt, False)

    def getpass(self, prompt: str = "Password: ", stream=None, **_ignored) -> str:
        __tracebackhide__ = True
        return _text(self.ask("input", prompt, password=True), prompt, True)

    def _stop_here(self, frame, header: str | None = None) -> None:
        """pdb at ``frame`` when the notebook says this rank is the one to stop."""
        if self.ask("breakpoint").get("stop"):
            debugger = pdb.Pdb()
            if header is not None:
                debugger.message(header)
            debugger.set_trace(frame)

    def breakpoint_hook(self, *args, **kwargs) -> None:
        """``breakpoint()``: in JupyterLab's debugger where it is attached to this rank, else
        pdb answered in the notebook."""
        if self._debugging.attached():
            self._debugging.stop_here(sys._getframe(1))
            return
        self._stop_here(sys._getframe(1))

    def _set_trace(self, *, header=None) -> None:
        """``pdb.set_trace()``."""
        self._stop_here(sys._getframe(1), header)

    def answer(self, content: dict) -> bool:
        """(the control thread) The notebook's answer, to the prompt waiting for it: whether
        one was."""
        waiting = self.waiting.get(content.get("id", ""))
        if waiting is not None:
            waiting.put(content)
        return waiting is not None

    def route_breakpoints(self) -> None:
        """``breakpoint()`` and ``pdb.set_trace()`` ask the notebook first (from the main
        thread, once joined)."""
        sys.breakpointhook = self.breakpoint_hook
        pdb.set_trace = self._set_trace
