"""The controller's fan-out of a cell: one request in from the notebook, an execute request out
to each rank, and the ranks' replies gathered back into one message.

Through ipyparallel's client a cell is one signed request per rank out of the notebook, and
one reply per rank into it, each handled as a Python message with its futures: at 64 ranks
that is most of the notebook's time in a trivial cell. Here (installed by start.py):

- the notebook sends one ``wire.CELL_REQUEST`` to this ROUTER: the code, the request's
  metadata, and each rank's engine identity with the id its request gets;
- the fan-out signs one ``execute_request`` per rank, with the notebook's header (its session,
  so the rank's outputs still reach the notebook's client) and that rank's id, and sends it
  through ipyparallel's multiplexer as any client does: the hub sees each request and reply
  there as before (which requests a dying engine held);
- the replies come back here. All that have arrived are read in one go, and each cell's are
  sent to the notebook as one ``wire.CELL_REPLIES``: [request id, what the notebook reads of
  the reply's metadata] for each rank. A rank's outputs do not pass here: they differ per
  rank, and go from the rank to the notebook through the IOPub relay, as before.

ipyparallel's broadcast scheduler fans a request out through a tree too, but its ``execute``
does not gather the replies (only ``apply``'s buffers), so the notebook would still read one
message per rank.

A reply whose signature does not hold is dropped; so is a request, and a request seen
before (a replay). The replay guard remembers the ids of the last ``SEEN`` requests (an id is
in the signed header, so a replay carries it; a signature would not do: without a key every
signature is empty), and refuses any request dated no later than the newest of those it has
forgotten, so that a flood of new requests cannot make it forget an old one that can then be
replayed. The dates are the notebook's own clock against itself: a clock set back by more than
``SEEN`` cells' time would refuse cells until it caught up. A message that cannot be read is
dropped alone, and the others go on. Requests whose ranks never answer (a rank that died) are
forgotten oldest first beyond ``REMEMBERED``.

Threads: everything here runs on the controller's main thread (its event loop), with the hub.
"""

from __future__ import annotations

import collections
import hmac
import logging
from datetime import datetime

import zmq

# spmd/wire.py says what each of these names is, who sends it and who reads it.
from spmd.wire import CELL_REPLIES, CELL_REQUEST, CELLS_PORT, KEPT_METADATA

# Requests in flight remembered (a rank that died never answers its own), and the ids of the
# notebook's requests (jupyter_client's own replay guard keeps as many signatures).
REMEMBERED = 200_000
SEEN = 2**16
DELIM = b"<IDS|MSG>"
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (plain ints: pyzmq's enums are slow)

log = logging.getLogger(__name__)


class CellFanout:
    """``cells``: the ROUTER the notebook sends cells to; ``ranks``: a DEALER connected to the
    multiplexer's client side."""

    def __init__(self, session, loop, cells: zmq.Socket, ranks: zmq.Socket) -> None:
        self.session = session
        self.cells = cells
        self.ranks = ranks
        # a rank's request id -> (the notebook's identity, the cell's id)
        self.asked: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()
        # the replay guard: the ids of recent requests, and the newest date of those forgotten
        self.seen: collections.OrderedDict[str, datetime] = collections.OrderedDict()
        self.forgotten: datetime | None = None
        loop.add_handler(cells, self._pump, loop.READ)
        loop.add_handler(ranks, self._pump, loop.READ)

    def _pump(self, *_) -> None:
        """Read both sockets until neither has a message. (Their file descriptors signal
        edges: a send can take a read's edge, so after any send both are read again, and the
        loop ends only with both empty.)"""
        while True:
            moved = False
            while self.cells.get(_EVENTS) & _POLLIN:
                self._read(self._cell, self.cells.recv_multipart(zmq.NOBLOCK))
                moved = True
            gathered: dict[tuple[bytes, str], list] = {}
            while self.ranks.get(_EVENTS) & _POLLIN:
                self._read(self._reply, self.ranks.recv_multipart(zmq.NOBLOCK), gathered)
                moved = True
            for (notebook, cell_id), replies in gathered.items():
                msg = self.session.msg(CELL_REPLIES, content={"replies": replies},
                                       parent={"msg_id": cell_id})
                self.cells.send_multipart([notebook, *self.session.serialize(msg)])
            if not moved:
                return

    @staticmethod
    def _read(handle, *args) -> None:
        """One message: one that cannot be read is dropped, and the loop goes on (were it to
        end here, the messages behind it would wait for an edge that never comes)."""
        try:
            handle(*args)
        except Exception:
            log.warning("a message the cell fan-out could not read was dropped", exc_info=True)

    def _signed(self, frames: list) -> list | None:
        """[identities, header, parent, metadata, content] of a message whose signature
        holds."""
        try:
            at = frames.index(DELIM)
        except ValueError:
            return None
        body = frames[at + 1:]
        if len(body) < 5:
            return None
        if self.session.auth is not None and not hmac.compare_digest(
                body[0], self.session.sign(body[1:5])):
            log.warning("a message with a bad signature was dropped")
            return None
        return [frames[:at], *body[1:5]]

    def _cell(self, frames: list) -> None:
        """A cell from the notebook: an execute request to each of its ranks."""
        signed = self._signed(frames)
        if signed is None:
            return
        idents, header, _parent, _metadata, content = signed
        unpack, pack = self.session.unpack, self.session.pack
        header = unpack(header)
        if header["msg_type"] != CELL_REQUEST or not idents or not self._first_time(header):
            return
        content = unpack(content)
        cell_id = header["msg_id"]
        parts = [pack({}), pack(content["metadata"]), pack(content["request"])]
        header["msg_type"] = "execute_request"
        requests = []  # (every rank's request made before any is sent: all or none go)
        for ident, msg_id in content["targets"]:
            header["msg_id"] = msg_id
            signed_parts = [pack(header), *parts]
            requests.append((msg_id, [ident.encode(), DELIM, self.session.sign(signed_parts),
                                      *signed_parts]))
        for msg_id, frames in requests:
            self.ranks.send_multipart(frames)
            self.asked[msg_id] = (idents[0], cell_id)
        while len(self.asked) > REMEMBERED:
            self.asked.popitem(last=False)

    def _first_time(self, header: dict) -> bool:
        """Whether a request is new (remembered from now on), not a replay."""
        msg_id = header["msg_id"]
        try:  # (jupyter_client writes it in UTC with a 'Z', which 3.10 cannot read)
            date = datetime.fromisoformat(str(header["date"]).replace("Z", "+00:00"))
        except (KeyError, ValueError):
            log.warning("a cell request without a date was dropped")
            return False
        if date.tzinfo is None:  # (naive and aware dates do not compare)
            log.warning("a cell request dated without a time zone was dropped")
            return False
        if msg_id in self.seen or (self.forgotten is not None and date <= self.forgotten):
            log.warning("a cell request seen before (a replay) was dropped")
            return False
        self.seen[msg_id] = date
        while len(self.seen) > SEEN:
            _old, when = self.seen.popitem(last=False)
            self.forgotten = when if self.forgotten is None else max(self.forgotten, when)
        return True

    def _reply(self, frames: list, gathered: dict) -> None:
        """A rank's reply: into its cell's gathered replies."""
        signed = self._signed(frames)
        if signed is None:
            return
        _idents, _header, parent, metadata, _content = signed
        msg_id = self.session.unpack(parent)["msg_id"]
        metadata = self.session.unpack(metadata)
        asked = self.asked.pop(msg_id, None)
        if asked is not None:
            kept = {k: metadata[k] for k in KEPT_METADATA if k in metadata}
            gathered.setdefault(asked, []).append([msg_id, kept])


def install() -> None:
    """The fan-out starts with the controller's hub (its port goes in the client's
    connection file: ``with_port``)."""
    from ipyparallel.controller.app import IPController

    init_hub = IPController.init_hub

    def init_hub_with_fanout(self) -> None:
        # (bound before the hub writes the connection files, which carry its port)
        cells = self.context.socket(zmq.ROUTER)
        cells.router_handover = True  # (a notebook that reconnects keeps its identity: client.py)
        if self.enable_curve:
            cells.curve_server = True
            cells.curve_secretkey = self.curve_secretkey
        self._spmd_cells_port = cells.bind_to_random_port(
            f"{self.client_transport}://{self.client_ip}")
        init_hub(self)
        ranks = self.context.socket(zmq.DEALER)
        ranks.sndhwm = 0  # (never a blocking send on the controller's one event loop)
        self.connect(ranks, self.client_url("mux"))
        self._spmd_fanout = CellFanout(self.session, self.loop, cells, ranks)

    IPController.init_hub = init_hub_with_fanout


def with_port(controller, fname: str, cdict: dict) -> dict:
    """The connection file's contents with the fan-out's port, where it is the client's
    (start.py's writer asks, so that the writer is replaced once)."""
    if fname == getattr(controller, "client_json_file", None):
        return {**cdict, CELLS_PORT: controller._spmd_cells_port}
    return cdict
