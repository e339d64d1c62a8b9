"""On a rank: the messages no one reads are not sent.

ipykernel announces every request twice on IOPub before it runs it: a ``status: busy`` and,
for a cell, an ``execute_input`` echoing its code. A Jupyter front end shows them; the
notebook that drives the ranks does not read them (it knows the code it sent, and a rank is
busy from the send until its reply). Neither is sent.

After a request, ipykernel sends ``status: idle`` on IOPub: the sign that the request's
outputs have all come, since they travel apart from the reply (IOPub, through the kernel's
IOPub thread; the reply straight on the shell socket). For a cell the notebook sends with
``wire.COUNTED`` in its metadata, the rank counts the IOPub messages it sent for the cell
instead, and the reply carries the count (``wire.IOPUB_COUNT``): the notebook has them all
once it has that many, and no idle is sent. At 64 ranks a trivial cell was four messages a
rank (busy, input, idle, reply), each signed and sent by the rank (the idle through a wake-up
of the IOPub thread), forwarded and parsed by the controller, verified and parsed by the
notebook's client, one Python message at a time; now it is one, the reply.

A message is counted once sent: one that a KeyboardInterrupt cuts off between its send and
its count ends the cell one output early (it shows with the next cell), never makes it wait
for an output that was not sent.

The kernel's log also made five DEBUG records a cell (each message's type and content) that
no handler wrote: traitlets sets the engine application's logger to DEBUG and filters in its
handler, and the kernel logs through it. It is set to WARNING, the level the engine is
started with (``--log-level=WARN``, launchers/launch.py).

The counts are the rank kernel's (``RankKernel.quiet``, one ``QuietCounts``), which it hands
its session (``RankSession.counts``) as it starts: what is left out is the kernel's, the
bookkeeping is here.

Threads: a ``QuietCounts``' ``counts`` (request id: IOPub messages sent for it) gains a
request on the main thread, as its handler starts; the count grows on whichever thread sends
(the main thread, or the IOPub thread flushing a stream: ipykernel flushes before the reply,
and waits for it), under its lock; the main thread takes it out for the reply. ``no_idle`` is
the main thread's, which sends a cell's reply and its idle (a control request's idle, on the
control thread, only reads it).
"""

from __future__ import annotations

import logging
import threading

from spmd import wire

# What is sent for a request but is not one of its outputs (the notebook does not count them)
NOT_OUTPUTS = frozenset({"execute_reply", "status", "debug_event"})


def quiet_log(log: logging.Logger) -> None:
    """No DEBUG records from the kernel, which no handler writes."""
    if log.level < logging.WARNING:
        log.setLevel(logging.WARNING)


class QuietCounts:
    """The IOPub messages a counted request sent, and the requests whose idle is left out."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.no_idle: set[str] = set()
        # (a stream's flush on the IOPub thread, the reply on the main)
        self._counting = threading.Lock()

    def start_counting(self, parent: dict) -> str:
        """(main thread) An execute request starts: its outputs are counted if the notebook
        asked. Its id, for ``stop_counting``."""
        request = parent["header"]["msg_id"]
        if (parent.get("metadata") or {}).get(wire.COUNTED):
            self.counts[request] = 0
        return request

    def stop_counting(self, request: str) -> None:
        """(main thread) The request's handler ended: a request that sent no reply leaves
        nothing (its idle goes)."""
        with self._counting:
            self.counts.pop(request, None)

    def count_into(self, parent: dict, metadata: dict) -> None:
        """(main thread, the reply's metadata being made) The count of a counted request's
        IOPub messages goes into its reply's metadata."""
        request = parent.get("header", {}).get("msg_id")
        with self._counting:
            sent = self.counts.pop(request, None)
        if sent is not None:
            metadata[wire.IOPUB_COUNT] = sent

    def sent(self, msg) -> None:
        """(any thread) A message the rank sent: counted if it is an output of a counted
        request; a reply that carried a count means no idle for its request."""
        if not isinstance(msg, dict):
            return
        if msg["header"]["msg_type"] == "execute_reply" and wire.IOPUB_COUNT in msg["metadata"]:
            self.no_idle.add(msg["parent_header"]["msg_id"])  # (the count went: no idle)
        elif self.counts and msg["header"]["msg_type"] not in NOT_OUTPUTS:
            request = msg["parent_header"].get("msg_id")
            with self._counting:
                if request in self.counts:
                    self.counts[request] += 1

    def idles_to_leave_out(self) -> bool:
        """Whether any request's idle is to be left out (asked first: it costs nothing)."""
        return bool(self.no_idle)

    def leave_out_idle(self, parent: dict | None) -> bool:
        """Whether the idle for ``parent`` (a request) is left out: its reply carried the
        count. Once: the request is forgotten."""
        request = (parent or {}).get("header", {})
        if request.get("msg_id") in self.no_idle:
            self.no_idle.discard(request["msg_id"])
            return True
        return False
