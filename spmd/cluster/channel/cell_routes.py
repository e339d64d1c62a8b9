"""The notebook's side of a cell sent once for all its ranks (controller/fanout.py).

``send`` hands one signed ``wire.CELL_REQUEST`` to the controller's fan-out; the ranks'
replies come back gathered, a message for all the replies that arrived together. Each rank's
outputs still come one by one through the IOPub relay, and go straight to the cell (not
through ipyparallel's futures and its per-request record of every stream).

A rank has finished its cell when its reply has come and as many outputs as the reply says
it sent (``wire.IOPUB_COUNT``, engine/shell/quiet.py). A rank whose reply carries no count sends its
``status: idle`` instead, and has finished when that has come too. The cell then hears
``(rank, DONE, {"census": its census digest, "printed": its printed arrays' parts})``; the outputs as ``(rank, msg_type, content)``.
A rank that has finished leaves the routes: what it prints later (a thread of the cell) is a
late output, for the next cell (client.py).

A cell the notebook stopped waiting for keeps its routes while its ranks run it: those that
finish later are heard by whoever polls it next (``%spmd status``, an interrupt). A rank's
routes go when the controller says it ended (``forget_engine``: it died, or a restart or a
stop ended it), so that no cell it left unfinished is kept (with the outputs its cell has not
taken) until ``REMEMBERED``.

Threads: ``routes`` is the IO thread's (ipyparallel's client's event loop). ``send`` is
called from the main thread and hands its work to the IO thread.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import zmq
from ipyparallel import util
from zmq.eventloop.zmqstream import ZMQStream

from spmd import wire

DONE = "done"
# Requests remembered whose ranks have not finished (a backstop: a rank that ended is
# forgotten as the controller tells of it, forget_engine).
REMEMBERED = 100_000

log = logging.getLogger(__name__)  # (ipyparallel's Client has no logger of its own)


class _Route:
    """One rank's request: where its events go, and what has come of it."""

    __slots__ = ("rank", "engine_id", "events", "came", "sent", "idle", "census", "printed")

    def __init__(self, rank: int, engine_id: int, events: Callable) -> None:
        self.rank, self.engine_id, self.events = rank, engine_id, events
        self.came = 0  # its outputs that came
        self.sent: int | None = None  # how many it sent (its reply's count); None: no reply yet
        self.idle = False  # its status: idle came (a rank that did not count)
        self.census = None
        self.printed = None  # the parts of the arrays its cell printed (engine/arrays/printed.py)


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
            "request": {"code": code, "silent": False, "user_expressions": {}},
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
