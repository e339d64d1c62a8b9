"""The controller's hub, keeping what the cluster needs of each request and nothing more.

ipyparallel's hub sees a copy of every request the notebook sends a rank and of every reply
(its monitor socket), and of every output a rank publishes. For each it parsed the whole
message, checked its signature, parsed its dates with dateutil, and kept a record in its task
database: the request, the reply, and each output stream's text appended to all before it.
That is what ``client.get_result`` and ``client.db_query`` read, and nothing here calls them:
the notebook keeps each rank's outputs itself, and its logs. At 64 ranks the hub's parsing
was most of the controller's work in a trivial cell.

Here (installed by start.py, before the hub is made):

- the database is ipyparallel's ``NoDB`` (``--IPController.db_class``, in launch.py);
- a request and its reply are read for their ids only (the header, or the parent header, of
  a message whose signature is checked), and the hub's own bookkeeping is kept as
  ipyparallel keeps it: which requests each engine holds (those it answers with an
  ``EngineError`` when the engine dies) and which have finished;
- of the outputs, only an engine's ``shutdown_reply`` is read (it unregisters the engine;
  its topic is ``engine.<id>.shutdown``);
- the application's logger writes at the level asked for (traitlets builds it at DEBUG and
  filters in the handler, so the hub's four ``log.debug``/``log.info`` a request were built
  as records and thrown away);
- the monitor's messages that have arrived are read in one go, up to ``DRAINED``: pyzmq's
  stream reads one message per turn of the event loop, and the hub gets two a rank for every
  cell (its request and its reply) and one for every output. (The bound lets the cell
  fan-out and registrations, on the same loop, have their turn during a flood of outputs.)

Threads: everything here runs on the controller's main thread (its event loop), where the
hub's state lives.
"""

from __future__ import annotations

import hmac
import logging

import zmq

# The most monitor messages read in one turn of the controller's event loop (about 5 ms).
DRAINED = 256

# ipyparallel's own, bound by install()
_save_queue_request = _save_queue_result = _monitor_iopub_message = _logging_config = None
_hub_init = None


def install() -> None:
    global _save_queue_request, _save_queue_result, _monitor_iopub_message, _logging_config
    global _hub_init
    from ipyparallel.controller.app import IPController
    from ipyparallel.controller.hub import Hub

    _hub_init = Hub.__init__
    Hub.__init__ = hub_init
    _save_queue_request, _save_queue_result = Hub.save_queue_request, Hub.save_queue_result
    _monitor_iopub_message = Hub.monitor_iopub_message
    _logging_config = IPController.get_default_logging_config
    Hub.save_queue_request, Hub.save_queue_result = save_queue_request, save_queue_result
    Hub.monitor_iopub_message = monitor_iopub_message
    IPController.get_default_logging_config = logging_config


def hub_init(self, *args, **kwargs) -> None:
    """``Hub.__init__``, its monitor's messages read all at once (see above)."""
    _hub_init(self, *args, **kwargs)
    self.monitor.on_recv(drained(self.monitor, self.dispatch_monitor_traffic))


def drained(stream, handle):
    """``handle`` for a stream's message, and for every other message already there."""
    draining = False

    def on_message(msg) -> None:
        nonlocal draining
        handle(msg)
        if not draining:
            draining = True
            try:
                stream.flush(zmq.POLLIN, DRAINED)  # (pyzmq's: the stream's callback for each)
            finally:
                draining = False

    return on_message


def _frame(session, frames: list, index: int) -> dict | None:
    """Header (1) or parent header (2) of a monitored message whose signature holds; None
    otherwise. (frames: signature, header, parent, metadata, content, buffers...)"""
    if len(frames) < 5:
        return None
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in frames[:5]]
    if session.auth is not None and not hmac.compare_digest(frames[0], session.sign(frames[1:5])):
        return None
    try:
        said = session.unpack(frames[index])
    except Exception:
        return None
    return said if isinstance(said, dict) else None


def save_queue_request(self, idents: list, msg: list) -> None:
    """``Hub.save_queue_request``: the request is on its engine now."""
    eid = self.by_ident.get(idents[0]) if len(idents) >= 2 else None
    header = _frame(self.session, msg, 1) if eid is not None else None
    if not header or "msg_id" not in header:
        _save_queue_request(self, idents, msg)  # (its own errors, in its words)
        return
    self.pending.add(header["msg_id"])
    self.queues[eid].append(header["msg_id"])


def save_queue_result(self, idents: list, msg: list) -> None:
    """``Hub.save_queue_result``: the engine answered it."""
    eid = self.by_ident.get(idents[1]) if len(idents) >= 2 else None
    parent = _frame(self.session, msg, 2) if eid is not None else None
    if parent is None:
        _save_queue_result(self, idents, msg)
        return
    msg_id = parent.get("msg_id")
    if msg_id in self.pending:
        self.pending.remove(msg_id)
        self.all_completed.add(msg_id)
        self.queues[eid].remove(msg_id)
        self.completed[eid].append(msg_id)


def monitor_iopub_message(self, topics: list, msg: list) -> None:
    """``Hub.monitor_iopub_message``, for an engine's shutdown only (its topic ends in
    ``.shutdown``)."""
    if any(bytes(topic).endswith(b".shutdown") for topic in topics):
        _monitor_iopub_message(self, topics, msg)


def logging_config(self) -> dict:
    """``Application.get_default_logging_config``, its logger at the level it writes."""
    config = _logging_config(self)
    for logger in config.get("loggers", {}).values():
        logger["level"] = logging.getLevelName(self.log_level)
    return config
