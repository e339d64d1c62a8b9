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
  back gathered (``cells``: CellRoutes, below); its ranks' outputs go straight to the cell,
  except that ipyparallel still relays a widget's comm messages to the front end;

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

A cell's routes (CellRoutes) are the notebook's side of a cell sent once for all its ranks
(controller/fanout.py). ``send`` hands one signed ``wire.CELL_REQUEST`` to the controller's fan-out; the ranks'
replies come back gathered, a message for all the replies that arrived together. Each rank's
outputs still come one by one through the IOPub relay, and go straight to the cell (not
through ipyparallel's futures and its per-request record of every stream).

A rank has finished its cell when its reply has come and as many outputs as the reply says
it sent (``wire.IOPUB_COUNT``, engine/shell/quiet.py). A rank whose reply carries no count
sends its ``status: idle`` instead, and has finished when that has come too. The cell then
hears ``(rank, DONE, {"census": its census digest, "printed": its printed arrays' parts})``;
the outputs as ``(rank, msg_type, content)``.
A rank that has finished leaves the routes: what it prints later (a thread of the cell) is a
late output, for the next cell (above).

A cell the notebook stopped waiting for keeps its routes while its ranks run it: those that
finish later are heard by whoever polls it next (``%spmd status``, an interrupt). A rank's
routes go when the controller says it ended (``forget_engine``: it died, or a restart or a
stop ended it), so that no cell it left unfinished is kept (with the outputs its cell has not
taken) until ``REMEMBERED``.

Threads: ``routes`` is the IO thread's (ipyparallel's client's event loop). ``send`` is
called from the main thread and hands its work to the IO thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import uuid
from collections.abc import Callable

import ipyparallel
import zmq
from ipyparallel import util
from ipyparallel.client.client import unpack_message
from zmq.eventloop.zmqstream import ZMQStream

from spmd import wire

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
        latest); a cell's requests are given theirs when they are sent (CellRoutes.send)."""
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


# -- a cell's routes ----------------------------------------------------------------------------

DONE = "done"
# Requests remembered whose ranks have not finished (a backstop: a rank that ended is
# forgotten as the controller tells of it, forget_engine).
REMEMBERED = 100_000

class _Route:
    """One rank's request: where its events go, and what has come of it."""

    __slots__ = ("rank", "engine_id", "events", "came", "sent", "idle", "census", "printed")

    def __init__(self, rank: int, engine_id: int, events: Callable) -> None:
        self.rank, self.engine_id, self.events = rank, engine_id, events
        self.came = 0  # its outputs that came
        self.sent: int | None = None  # how many it sent (its reply's count); None: no reply yet
        self.idle = False  # its status: idle came (a rank that did not count)
        self.census = None
        self.printed = None  # the parts of the arrays its cell printed (engine/arrays/print_marks.py)


class CellRoutes:
    """The cells of one ipyparallel client."""

    def __init__(self, client) -> None:
        self.client = client
        self.routes: dict[str, _Route] = {}  # a rank's request id -> its route
        # The variables jax reads at import that cells changed on each rank, by engine id
        # (None: removed), engine/join/import_env.py: replaced whole by the IO thread, taken by a
        # restart (which keeps only what every rank changed alike).
        self.rank_env: dict[int, dict[str, str | None]] = {}
        self.stream: ZMQStream | None = None

    def connect(self) -> None:
        """(IO thread, with ipyparallel's own streams) The socket to the controller's fan-out."""
        client, cfg = self.client, self.client._config
        socket = client._context.socket(zmq.DEALER)
        # (its own identity, kept if it reconnects: replies to the one before would be lost)
        socket.routing_id = f"spmd-cells-{uuid.uuid4()}".encode()
        util.connect(socket, f"{cfg['interface']}:{cfg[wire.CELLS_PORT]}",
                     curve_serverkey=client.curve_serverkey,
                     curve_publickey=client.curve_publickey,
                     curve_secretkey=client.curve_secretkey)
        self.stream = ZMQStream(socket, client._io_loop)
        self.stream.on_recv(self._replies, copy=True)

    def close(self, linger=None) -> None:
        """(once the IO thread has stopped) The socket to the fan-out is closed, where the
        IO thread's loop did not close it as it ended (ipyparallel closes its loop with every
        descriptor registered on it)."""
        socket = self.stream.socket if self.stream is not None else None
        if socket is not None and not socket.closed:
            self.stream.close(linger=linger)

    def send(self, code: str, metadata: dict, ranks: dict[int, int],
             events: Callable) -> dict[int, str]:
        """(main thread) ``code`` to ``ranks`` (rank: engine id); ``events`` is called on the
        IO thread with each of their events. {rank: the id of its request}. KeyError: an
        engine not registered."""
        client = self.client
        idents = {rank: client.engine_ident(eid).decode() for rank, eid in ranks.items()}
        if client._closed:
            raise OSError("Connections have been closed.")  # (as ipyparallel's own sends)
        msg = client.session.msg(wire.CELL_REQUEST, content={})
        cell_id = msg["header"]["msg_id"]
        ids = {rank: f"{cell_id}_{rank}" for rank in ranks}
        msg["content"] = {
            # (stop_on_error: ipykernel's default skips the requests that reach a rank just
            # after an error there, and that rank would skip the next cell; the notebook
            # decides what runs next, and a rank runs every cell it is sent)
            "request": {"code": code, "silent": False, "user_expressions": {},
                        "stop_on_error": False},
            "metadata": metadata,
            "targets": [[idents[rank], ids[rank]] for rank in ranks],
        }
        frames = client.session.serialize(msg)
        routes = {ids[rank]: _Route(rank, eid, events) for rank, eid in ranks.items()}

        def go() -> None:
            while len(self.routes) > REMEMBERED:  # (the oldest: ranks that died in a cell)
                del self.routes[next(iter(self.routes))]
            self.routes.update(routes)
            for msg_id, route in routes.items():
                client._learn_engine(msg_id, route.engine_id)
            self.stream.send_multipart(frames)

        client._io_loop.add_callback(go)
        return ids

    def output(self, msg: dict) -> bool:
        """(IO thread) An IOPub message of a routed request goes to its cell (True)."""
        route = self.routes.get(msg["parent_header"].get("msg_id"))
        if route is None:
            return False
        kind = msg["header"]["msg_type"]
        if kind == "status":
            if msg["content"].get("execution_state") == "idle":
                route.idle = True
                self._maybe_done(msg["parent_header"]["msg_id"], route)
            return True
        route.events((route.rank, kind, msg["content"]))
        route.came += 1
        self._maybe_done(msg["parent_header"]["msg_id"], route)
        return True

    def forget_engine(self, engine_id: int) -> None:
        """(IO thread) An engine that ended: its requests will never finish."""
        for msg_id in [m for m, route in self.routes.items() if route.engine_id == engine_id]:
            del self.routes[msg_id]

    def _replies(self, frames: list) -> None:
        """(IO thread) Replies the fan-out gathered."""
        session = self.client.session
        try:
            _idents, frames = session.feed_identities(frames)
            msg = session.deserialize(frames)  # (its signature checked)
        except Exception:
            log.warning("a bad message from the controller's fan-out was dropped")
            return
        if msg["header"]["msg_type"] != wire.CELL_REPLIES:
            return
        for msg_id, metadata in msg["content"]["replies"]:
            route = self.routes.get(msg_id)
            changed = metadata.get(wire.ENV_CHANGED)
            # (a cell set JAX_* on the ranks: the restart keeps it; each rank's message has
            # every change since it started)
            engine_id = route.engine_id if route is not None else self.client._engine_of.get(msg_id)
            if changed is not None and engine_id is not None:
                self.rank_env = {**self.rank_env, engine_id: changed}
            if route is None:  # (its cell ended without it)
                continue
            route.census = metadata.get(wire.CENSUS_DIGEST)
            route.printed = metadata.get(wire.PRINTED_ARRAYS)
            # (a rank that did not count sends its idle: it is waited for)
            route.sent = metadata.get(wire.IOPUB_COUNT, -1)
            self._maybe_done(msg_id, route)

    def _maybe_done(self, msg_id: str, route: _Route) -> None:
        sent = route.sent
        if sent is None or (sent == -1 and not route.idle) or route.came < sent:
            return
        del self.routes[msg_id]
        route.events((route.rank, DONE, {"census": route.census, "printed": route.printed}))
