"""The notebook's ipyparallel client, with what it does with the outputs a rank sends.

ipyparallel's client keeps a copy of every stream of every request in ``client.metadata``,
appending each chunk to all that came before (a flood of a million lines copies the growing
text at every chunk), and it keeps doing so after the request has ended: a thread that a cell
started prints on, under that cell's id, and each such message makes the entry anew (a
``defaultdict``) and shows nowhere. Here:

- a running request's outputs (``%px``, ``apply``) are not kept in ipyparallel's copy of its
  streams, which is emptied at every chunk: memory stays bounded;
- outputs that come after their cell ended (a training loop in a thread, a callback) go to
  ``late``, for the next cell to show and the rank's log to keep, and leave no entry behind.

- a cell goes to its ranks once, through the controller's fan-out, and their replies come
  back gathered (``cells``, cell_routes.py); its ranks' outputs go straight to the cell, except
  that ipyparallel still relays a widget's comm messages to the front end;

- other code reaches one engine through ``engine_ident``, and asks it on the control channel
  through ``control`` (and ``drop``s a request left unanswered): nothing outside channel/
  touches ipyparallel's client inside (spmd/internals.py lists what this folder touches);

- after an attach, the outputs of the cell that was running when the notebook before this one
  died (another session's: ipyparallel leaves them out) go to ``adopted`` (cluster/adopted.py);

- a rank's debug events (JupyterLab's debugger, spmd/kernel/debugger.py) go to
  ``on_debug_event``, and the ranks paused in the debugger are kept in ``paused`` (engine id:
  its stopped threads), which the watchdog reads: a paused rank is not diverged.

Runs on ipyparallel's IO thread; ``late`` is the only thing it shares with the main thread
(a queue); ``paused`` is written here only, and read whole (a copy) by others.
``sync_engines`` is called from the start's thread and hands its update of the engine tables
to the IO thread.
"""

from __future__ import annotations

import collections
import logging
import threading

import ipyparallel
from ipyparallel.client.client import unpack_message

from spmd.cluster.channel.cell_routes import CellRoutes

# Requests whose engine is remembered for their late outputs (a few MB at most): hundreds of
# cells back on 64 ranks.
RECENT_REQUESTS = 50_000

# Outputs kept for the next cell while the notebook does not look: the oldest go first (and
# are counted) when a thread prints faster than the notebook drains them.
LATE_KEPT = 100_000

# How long a question to the controller the notebook asks at each cell waits for its answer.
QUERY_SECONDS = 3.0

# ipyparallel's own handler, undecorated: this class adds to it, it does not replace it
# (spmd/internals.py checks that it is there before a cluster starts).
_dispatch_iopub = getattr(ipyparallel.Client._dispatch_iopub, "__wrapped__", None)

log = logging.getLogger(__name__)  # (ipyparallel's Client has no logger of its own)


class SpmdClient(ipyparallel.Client):
    """ipyparallel's Client; ``late`` holds (engine id, msg_type, content) of outputs whose
    cell had already ended (``late_dropped``: how many did not fit)."""

    def __init__(self, *args, **kwargs) -> None:
        self.late: collections.deque = collections.deque(maxlen=LATE_KEPT)
        self.late_dropped = 0
        # Which engine each recent request went to: a late output may name only its request
        # (a thread's output carries no engine; the request's status messages did).
        self._engine_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.on_debug_event = None  # called with (engine id, the event) on the IO thread
        self.paused: dict[int, frozenset] = {}  # engine id -> its threads stopped in debugpy
        self.cells = CellRoutes(self)
        # (set by an attach, cluster/adopted.py: it hears the outputs of other sessions)
        self.adopted = None
        super().__init__(*args, **kwargs)

    def _setup_streams(self) -> None:
        super()._setup_streams()
        self.cells.connect()

    def close(self, linger=None) -> None:
        """ipyparallel's, and the socket to the fan-out (ipyparallel closes the sockets it
        knows, once its IO thread has stopped)."""
        super().close(linger)
        self.cells.close(linger)

    @unpack_message
    def _dispatch_iopub(self, msg) -> None:
        kind = msg["header"]["msg_type"]
        if kind == "debug_event":
            self._debug_event(msg)
            return
        parent = msg.get("parent_header") or {}
        adopted = self.adopted
        if adopted is not None and parent and parent.get("session") != self.session.session:
            try:  # (a cell of the notebook before this one: cluster/adopted.py)
                adopted.heard(self._engine(msg.get("metadata", {}).get("engine")), kind,
                              msg["content"], parent.get("msg_id", ""), self.late)
            except Exception as exc:  # (this is the IO thread: it must go on)
                log.warning("an output of the cell from before the attach was lost: %r", exc)
            return
        if parent.get("msg_id") in self.cells.routes and parent.get("session") == self.session.session:
            try:
                if kind.startswith("comm_"):  # (ipyparallel relays it to the front end)
                    _dispatch_iopub(self, msg)
            except Exception as exc:  # (this is the IO thread: it must go on)
                log.warning("a rank's widget message (%s) could not be relayed to the front "
                            "end: %r", kind, exc)
            finally:  # (counted whatever came of the relay: its rank's cell must end)
                self.metadata.pop(parent["msg_id"], None)
                self.cells.output(msg)
            return
        try:
            _dispatch_iopub(self, msg)
        finally:
            self._after_iopub(msg)

    def _unregister_engine(self, msg) -> None:
        """ipyparallel's; and the routes of that engine's cells go: it ended (a rank that
        died, the old ranks of a restart or a stop), and will never finish them."""
        super()._unregister_engine(msg)
        self.cells.forget_engine(int(msg["content"]["id"]))

    def _debug_event(self, msg) -> None:
        engine_id = self._engine(msg.get("metadata", {}).get("engine"))
        if engine_id is None:
            return
        event = msg["content"]
        body = event.get("body") or {}
        stopped = self.paused.get(engine_id, frozenset())
        if event.get("event") == "stopped":
            self.paused = {**self.paused, engine_id: stopped | {body.get("threadId")}}
        elif event.get("event") in ("continued", "terminated", "exited"):
            left = (frozenset() if body.get("allThreadsContinued", True)
                    else stopped - {body.get("threadId")})
            self.paused = {e: t for e, t in {**self.paused, engine_id: left}.items() if t}
        callback = self.on_debug_event
        if callback is not None:
            try:
                callback(engine_id, event)
            except Exception:  # (this is ipyparallel's IO thread: it must go on)
                log.exception("a rank's debug event could not be passed on")

    def _extract_metadata(self, msg) -> dict:
        """ipyparallel's; a reply names its request's engine, for the request's late
        outputs."""
        md = super()._extract_metadata(msg)
        msg_id = (msg.get("parent_header") or {}).get("msg_id")
        self._learn_engine(msg_id, self._engine((msg.get("metadata") or {}).get("engine")))
        return md

    def _after_iopub(self, msg) -> None:
        parent = msg.get("parent_header") or {}
        msg_id = parent.get("msg_id")
        if msg_id is None or parent.get("session") != self.session.session:
            return  # (ipyparallel ignores other clients' messages too)
        kind = msg["header"]["msg_type"]
        engine_id = self._engine(msg.get("metadata", {}).get("engine"))
        self._learn_engine(msg_id, engine_id)
        if kind == "status":
            return
        if msg_id in self._futures:  # (its request runs: it had this output)
            if kind == "stream":
                md = self.metadata.get(msg_id)
                if md is not None:
                    md[msg["content"]["name"]] = ""
            return
        self.metadata.pop(msg_id, None)
        if engine_id is None:
            engine_id = self._engine_of.get(msg_id)
        if engine_id is not None and kind in ("stream", "display_data", "error"):
            if len(self.late) == LATE_KEPT:
                self.late_dropped += 1
            self.late.append((engine_id, kind, msg["content"]))

    def _learn_engine(self, msg_id: str | None, engine_id: int | None) -> None:
        """The request's engine, from the first message that names it (its reply at the
        latest); a cell's requests are given theirs when they are sent (cell_routes.py)."""
        if engine_id is not None and msg_id is not None and msg_id not in self._engine_of:
            self._engine_of[msg_id] = engine_id
            while len(self._engine_of) > RECENT_REQUESTS:
                self._engine_of.popitem(last=False)

    # -- the rank channel: what code outside channel/ does with one engine ------------------

    def engine_ident(self, engine_id: int) -> bytes:
        """(any thread: a read) The identity that routes a message to engine ``engine_id`` on
        ipyparallel's sockets: the one way to reach an engine. KeyError: it is not registered
        (it ended, or has not joined)."""
        return self._engines[engine_id].encode("utf8")

    def control(self, engine_id: int, msg_type: str, content: dict):
        """(any thread) A request on the control channel (signed, encrypted off the loopback)
        to one engine: the Future of its reply (``result()["content"]``). Raises KeyError for
        an engine not registered, OSError once the client is closed. One that will not be
        answered must be ``drop``-ped."""
        return self._send(self._control_stream, msg_type, ident=self.engine_ident(engine_id),
                          content=content)

    def drop(self, future) -> None:
        """(any thread) An unanswered request leaves the client's futures (its reply, should
        it come, is then ignored). Cancelled on the IO thread, which is the one that sets
        results."""
        if not self._closed:  # (a closed client's futures went with it)
            self._io_loop.add_callback(future.cancel)

    def resume(self, engine_ids: list[int]) -> None:
        """(any thread) These engines were told to go on in the debugger: not paused now.
        (debugpy sends no ``continued`` for a continue or a step it was asked for.)"""

        def forget() -> None:
            self.paused = {e: t for e, t in self.paused.items() if e not in engine_ids}

        self._io_loop.add_callback(forget)

    def sync_engines(self, timeout: float = 5.0) -> None:
        """Ask the controller which engines have registered, and add any this client missed.

        ipyparallel's client learns of the engines once from its connection reply, then from
        notifications on a SUB socket that it connects after that reply. An engine whose
        registration completes in between (the subscription takes tens of ms to hold, longer
        with CurveZMQ to another host) is never announced to it: its rank looked unregistered
        until the start timed out, though the controller had it. The update runs on the IO
        thread, which owns the engine tables."""
        future = self._send(self._query_stream, "connection_request")
        if not future.wait(timeout):
            return  # (a controller this slow: the caller's own deadline decides)
        engines = future.result()["content"].get("engines", {})
        updated = threading.Event()

        def update() -> None:
            try:
                self._update_engines(engines)
            finally:
                updated.set()

        self._io_loop.add_callback(update)
        updated.wait(timeout)

    def queue_status_within(self, timeout: float = QUERY_SECONDS,
                            verbose: bool = False) -> dict | None:
        """ipyparallel's ``queue_status()`` of every engine, waited for ``timeout`` seconds at
        most: None where the controller did not answer (ipyparallel's waits for ever, and a
        controller that died would hang the notebook's cell)."""
        from ipyparallel import util

        future = self._send(self._query_stream, "queue_request",
                            content={"targets": None, "verbose": verbose})
        if not future.wait(timeout):
            return None
        content = dict(future.result()["content"])
        if content.pop("status", None) != "ok":
            return None
        return util.int_keys(content)

    def _engine(self, uuid: str | None) -> int | None:
        try:
            return self._engines[uuid] if uuid else None
        except KeyError:  # (an engine of an earlier generation, gone since)
            return None
