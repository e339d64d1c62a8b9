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

The rank's kernel and its session (engine/rank_kernel.py) call these functions: what is left out
is theirs, the bookkeeping is here.

Threads: ``_counts`` (request id: IOPub messages sent for it) gains a request on the main
thread, as its handler starts; the count grows on whichever thread sends (the main thread, or
the IOPub thread flushing a stream: ipykernel flushes before the reply, and waits for it),
under ``_counting``; the main thread takes it out for the reply. ``_no_idle`` is the main
thread's.
"""

from __future__ import annotations

import logging
import threading

from spmd import wire

# What is sent for a request but is not one of its outputs (the notebook does not count them)
NOT_OUTPUTS = frozenset({"execute_reply", "status", "debug_event"})

_counts: dict[str, int] = {}
_counting = threading.Lock()  # (a stream's flush on the IOPub thread, the reply on the main)
_no_idle: set[str] = set()


def quiet_log(log: logging.Logger) -> None:
    """No DEBUG records from the kernel, which no handler writes."""
    if log.level < logging.WARNING:
        log.setLevel(logging.WARNING)


def start_counting(parent: dict) -> str:
    """(main thread) An execute request starts: its outputs are counted if the notebook asked.
    Its id, for ``stop_counting``."""
    request = parent["header"]["msg_id"]
    if (parent.get("metadata") or {}).get(wire.COUNTED):
        _counts[request] = 0
    return request


def stop_counting(request: str) -> None:
    """(main thread) The request's handler ended: a request that sent no reply leaves nothing
    (its idle goes)."""
    with _counting:
        _counts.pop(request, None)


def count_into(parent: dict, metadata: dict) -> None:
    """(main thread, the reply's metadata being made) The count of a counted request's IOPub
    messages goes into its reply's metadata."""
    request = parent.get("header", {}).get("msg_id")
    with _counting:
        sent = _counts.pop(request, None)
    if sent is not None:
        metadata[wire.IOPUB_COUNT] = sent


def sent(msg) -> None:
    """(any thread) A message the rank sent: counted if it is an output of a counted request;
    a reply that carried a count means no idle for its request."""
    if not isinstance(msg, dict):
        return
    if msg["header"]["msg_type"] == "execute_reply" and wire.IOPUB_COUNT in msg["metadata"]:
        _no_idle.add(msg["parent_header"]["msg_id"])  # (the count went: no idle)
    elif _counts and msg["header"]["msg_type"] not in NOT_OUTPUTS:
        request = msg["parent_header"].get("msg_id")
        with _counting:
            if request in _counts:
                _counts[request] += 1


def idles_to_leave_out() -> bool:
    """Whether any request's idle is to be left out (asked first: it costs nothing)."""
    return bool(_no_idle)


def leave_out_idle(parent: dict | None) -> bool:
    """Whether the idle for ``parent`` (a request) is left out: its reply carried the count.
    Once: the request is forgotten."""
    request = (parent or {}).get("header", {})
    if request.get("msg_id") in _no_idle:
        _no_idle.discard(request["msg_id"])
        return True
    return False
