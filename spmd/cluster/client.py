"""The notebook's ipyparallel client, with what it does with the outputs a rank sends.

ipyparallel's client keeps a copy of every stream of every request in ``client.metadata``,
appending each chunk to all that came before (a flood of a million lines copies the growing
text at every chunk), and it keeps doing so after the request has ended: a thread that a cell
started prints on, under that cell's id, and each such message makes the entry anew (a
``defaultdict``) and shows nowhere. Here:

- a running cell's outputs reach the notebook through its own callbacks (lockstep.py), so
  ipyparallel's copy of its streams is emptied at every chunk: memory stays bounded;
- outputs that come after their cell ended (a training loop in a thread, a callback) go to
  ``late``, for the next cell to show and the rank's log to keep, and leave no entry behind.

Runs on ipyparallel's IO thread; ``late`` is the only thing it shares with the main thread
(a queue).
"""

from __future__ import annotations

import collections
import queue

import ipyparallel
from ipyparallel.client.client import unpack_message

# Requests whose engine is remembered for their late outputs: thousands of cells back.
RECENT_REQUESTS = 4096

# ipyparallel's own handler, undecorated: this class adds to it, it does not replace it.
_dispatch_iopub = getattr(ipyparallel.Client._dispatch_iopub, "__wrapped__", None)


class SpmdClient(ipyparallel.Client):
    """ipyparallel's Client; ``late`` holds (engine id, msg_type, content) of outputs whose
    cell had already ended."""

    def __init__(self, *args, **kwargs) -> None:
        self.late: queue.SimpleQueue = queue.SimpleQueue()
        # Which engine each recent request went to: a late output names only its request
        # (its own metadata has no engine; the request's status messages had).
        self._engine_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        super().__init__(*args, **kwargs)

    if _dispatch_iopub is not None:  # (else ipyparallel's own, unchanged: see check)

        @unpack_message
        def _dispatch_iopub(self, msg) -> None:
            _dispatch_iopub(self, msg)
            self._after_iopub(msg)

    def _after_iopub(self, msg) -> None:
        parent = msg.get("parent_header") or {}
        msg_id = parent.get("msg_id")
        kind = msg["header"]["msg_type"]
        if msg_id is None or kind == "status" or parent.get("session") != self.session.session:
            return  # (ipyparallel ignores other clients' messages too)
        if msg_id in self._futures:
            engine = msg.get("metadata", {}).get("engine")
            if engine and msg_id not in self._engine_of:
                try:
                    self._engine_of[msg_id] = self._engines[engine]
                except KeyError:
                    pass
                while len(self._engine_of) > RECENT_REQUESTS:
                    self._engine_of.popitem(last=False)
            if kind == "stream":
                md = self.metadata.get(msg_id)
                if md is not None:
                    md[msg["content"]["name"]] = ""
            return
        self.metadata.pop(msg_id, None)
        engine_id = self._engine_of.get(msg_id)
        if engine_id is not None and kind in ("stream", "display_data", "error"):
            self.late.put((engine_id, kind, msg["content"]))


def check() -> str:
    """'' when ipyparallel's client is as this module expects; else why not, in a sentence."""
    if _dispatch_iopub is None:
        return (
            f"ipyparallel {ipyparallel.__version__}'s Client._dispatch_iopub has no __wrapped__: "
            "outputs printed after their cell ended are not shown"
        )
    return ""
