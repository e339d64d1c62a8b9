"""On a rank: the messages no one reads are not sent.

ipykernel announces every request twice on IOPub before it runs it: a ``status: busy`` and,
for a cell, an ``execute_input`` echoing its code. A Jupyter front end shows them; the
notebook that drives the ranks does not read them (it knows the code it sent, and a rank is
busy from the send until its reply). Neither is sent.

After a request, ipykernel sends ``status: idle`` on IOPub: the sign that the request's
outputs have all come, since they travel apart from the reply (IOPub, through the kernel's
IOPub thread; the reply straight on the shell socket). For a cell the notebook sends with
``COUNTED`` in its metadata, the rank counts the IOPub messages it sent for the cell instead,
and the reply carries the count (``spmd_iopub``): the notebook has them all once it has that
many, and no idle is sent. At 64 ranks a trivial cell was four messages a rank (busy, input,
idle, reply), each signed and sent by the rank (the idle through a wake-up of the IOPub
thread), forwarded and parsed by the controller, verified and parsed by the notebook's
client, one Python message at a time; now it is one, the reply.

A message is counted once sent: one that a KeyboardInterrupt cuts off between its send and
its count ends the cell one output early (it shows with the next cell), never makes it wait
for an output that was not sent.

The kernel's log also made five DEBUG records a cell (each message's type and content) that
no handler wrote: traitlets sets the engine application's logger to DEBUG and filters in its
handler, and the kernel logs through it. It is set to WARNING, the level the engine is
started with (``--log-level=WARN``, launchers/launch.py).

Threads: installed from the rank's main thread once it has joined, before the first cell.
``_counts`` (request id: IOPub messages sent for it) gains a request on the main thread, as
its handler starts; the count grows on whichever thread sends (the main thread, or the IOPub
thread flushing a stream: ipykernel flushes before the reply, and waits for it), under
``_counting``; the main thread takes it out for the reply. ``_no_idle`` is the main
thread's.
"""

from __future__ import annotations

import logging
import threading

COUNTED = "spmd_counted"  # (an execute request's metadata: count its outputs, no idle)
COUNT = "spmd_iopub"  # (its reply's metadata: how many IOPub messages it sent)
# What is sent for a request but is not one of its outputs (the notebook does not count them)
NOT_OUTPUTS = frozenset({"execute_reply", "status", "debug_event"})

_counts: dict[str, int] = {}
_counting = threading.Lock()  # (a stream's flush on the IOPub thread, the reply on the main)
_no_idle: set[str] = set()


def install(kernel) -> None:
    """The kernel leaves out ``status: busy`` and ``execute_input``, counts a counted cell's
    outputs into its reply and leaves out its idle (spmd/internals.py lists the parts of
    ipykernel this replaces)."""
    if getattr(kernel, "spmd_quiet", False):  # (twice would count every message twice)
        return
    kernel.spmd_quiet = True
    publish_status = kernel._publish_status

    def _publish_status(status, channel, parent=None):
        if status == "busy":
            return
        if status == "idle" and _no_idle:
            request = (parent or kernel.get_parent(channel) or {}).get("header", {})
            if request.get("msg_id") in _no_idle:
                _no_idle.discard(request["msg_id"])
                return
        publish_status(status, channel, parent)

    kernel._publish_status = _publish_status
    kernel._publish_execute_input = lambda code, parent, execution_count: None
    if kernel.log.level < logging.WARNING:
        kernel.log.setLevel(logging.WARNING)

    execute = kernel.shell_handlers["execute_request"]

    async def execute_request(stream, ident, parent):
        request = parent["header"]["msg_id"]
        if (parent.get("metadata") or {}).get(COUNTED):
            _counts[request] = 0
        try:
            result = execute(stream, ident, parent)
            if hasattr(result, "__await__"):
                await result
        finally:  # (a request that sent no reply: its idle goes, and nothing is left)
            with _counting:
                _counts.pop(request, None)

    kernel.shell_handlers["execute_request"] = execute_request
    send = kernel.session.send  # (ipyparallel's, which names the engine in each message)

    def counted_send(*args, **kwargs):
        msg = send(*args, **kwargs)
        if not isinstance(msg, dict):
            return msg
        if msg["header"]["msg_type"] == "execute_reply" and COUNT in msg["metadata"]:
            _no_idle.add(msg["parent_header"]["msg_id"])  # (the count went: no idle)
        elif _counts and msg["header"]["msg_type"] not in NOT_OUTPUTS:
            request = msg["parent_header"].get("msg_id")
            with _counting:
                if request in _counts:
                    _counts[request] += 1
        return msg

    kernel.session.send = counted_send
    finish = kernel.finish_metadata

    def finish_metadata(parent, metadata, reply_content):
        metadata = finish(parent, metadata, reply_content)
        request = parent.get("header", {}).get("msg_id")
        with _counting:
            sent = _counts.pop(request, None)
        if sent is not None:
            metadata[COUNT] = sent
        return metadata

    kernel.finish_metadata = finish_metadata
