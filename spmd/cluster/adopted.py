"""The cell that was still running on the ranks when their notebook process died, taken over by
the notebook that attaches (attach.py): what it prints and how it ends reach this notebook,
and ``%spmd interrupt`` reaches it.

Its requests carry the dead notebook's session, which ipyparallel's client leaves out. This
client's IO thread hands every IOPub message of another session here (``heard``, from
channel/client.py): only notebooks send the ranks requests, and the one before this one is
dead. Which requests were running is the hub's word, asked at the attach (its queue status);
one has ended when its ``status: idle`` came, or when the hub no longer lists it.

What a rank printed before the attach read its log (magics/away.py) is in that log: a rank
copies the output of the cell that ran when its notebook died to its log until that cell ends
(engine/unattended.py). So streams are held until the attach has read the logs (``release``);
those of a rank whose log it read are dropped there, the others kept. Later streams, the
cell's error and its displays join the client's late outputs, which the next cell shows,
labelled as this cell's (late.py, magics/cell.py), and the ranks' logs keep.

Session keeps it in its generation (``gen.adopted``); the functions at the end are what the
session and the magics ask of it: which ranks still run it, an interrupt of it, what it
printed since the last look and how it ended.

Threads: the main thread makes it at the attach and asks it (``busy_ranks``, ``news`` and the
functions below); the client's IO thread calls ``heard``. ``_lock`` guards what both touch.
"""

from __future__ import annotations

import collections
import signal
import threading
import time

from spmd.cluster.lockstep.run import rank_words

# Marks, in an output's content, one from before the attach (late.py reads it).
FROM_BEFORE = "_from_before_the_attach"
# Streams held until the attach has read the ranks' logs (the oldest go first beyond).
HELD = 100_000
# How long ``news`` waits for the idles of requests the hub says have ended, and how long
# ``interrupt`` waits for the ranks it sent SIGINT to.
IDLE_SECONDS = 1.0
INTERRUPT_SECONDS = 2.0


class Adopted:
    """The requests that were running on the ranks at the attach (see the opening comment)."""

    def __init__(self, requests: dict[str, int], rank_of: dict[int, int]) -> None:
        self.requests = requests  # msg id -> its engine id
        self.rank_of = rank_of  # engine id -> rank
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # (its idle came, or the hub no longer lists it)
        self._idle: set[str] = set()  # (its idle came)
        self._told: set[str] = set()  # requests whose end was said (at the attach, or since)
        self._errors: dict[int, str] = {}  # rank -> "ValueError: why" (its cell's error)
        self._held: collections.deque = collections.deque(maxlen=HELD)
        self._holding = True

    @classmethod
    def find(cls, client, engine_ids: list[int]) -> Adopted:
        """What the hub says runs on these engines (the ranks, in rank order) now."""
        rank_of = {engine_id: rank for rank, engine_id in enumerate(engine_ids)}
        requests = {msg_id: engine_id for msg_id, engine_id in (_pending(client) or {}).items()
                    if engine_id in rank_of}
        return cls(requests, rank_of)

    # -- the client's IO thread --------------------------------------------------------------

    def heard(self, engine_id: int | None, kind: str, content: dict, msg_id: str,
              late: collections.deque) -> None:
        """(IO thread) An IOPub message of another session: one of these requests' outputs,
        its error or its end, or what a thread of an older cell of the dead notebook prints."""
        if engine_id is None:
            engine_id = self.requests.get(msg_id)
        if kind == "status":
            if content.get("execution_state") == "idle" and msg_id in self.requests:
                with self._lock:
                    self._ended.add(msg_id)
                    self._idle.add(msg_id)
            return
        if kind not in ("stream", "display_data", "error") or engine_id is None:
            return
        if kind == "error" and msg_id in self.requests:
            with self._lock:
                said = f"{content.get('ename') or 'an error'}: {content.get('evalue') or ''}"
                self._errors[self.rank_of.get(engine_id, -1)] = said.rstrip(": ")
        item = (engine_id, kind, {**content, FROM_BEFORE: True})
        with self._lock:
            if self._holding and kind == "stream":
                self._held.append(item)
                return
        late.append(item)

    # -- the main thread ---------------------------------------------------------------------

    def release(self, read: set[int], late: collections.deque) -> None:
        """The attach has read the logs of the ranks ``read``: their streams held so far are
        in what it read, and go; the other ranks' go to the late outputs, and from now on
        every stream does."""
        with self._lock:
            self._holding = False
            held, self._held = list(self._held), collections.deque()
        late.extend(item for item in held if self.rank_of.get(item[0]) not in read)

    def busy_ranks(self, client) -> list[int]:
        """The ranks still running one of these requests (the hub is asked about those whose
        end did not come)."""
        with self._lock:
            left = [m for m in self.requests if m not in self._ended]
        if left:
            pending = _pending(client)
            if pending is not None:
                with self._lock:
                    self._ended.update(m for m in left if m not in pending)
        with self._lock:
            return sorted({self.rank_of[self.requests[m]] for m in self.requests
                           if m not in self._ended})

    def told(self, ranks: set[int]) -> None:
        """The attach said how these ranks' requests ended (from their logs)."""
        with self._lock:
            self._told.update(m for m, e in self.requests.items() if self.rank_of[e] in ranks)

    def news(self, client) -> str:
        """Once every request has ended, one line, once, on how it ended on the ranks whose
        end was not said yet ('' otherwise). A request's end is its ``status: idle``, which
        comes after its error: the hub knows of the end a moment earlier, and that moment is
        waited for."""
        if not self.requests or self.busy_ranks(client):
            return ""
        until = time.monotonic() + IDLE_SECONDS
        while time.monotonic() < until:
            with self._lock:
                if self._idle >= set(self.requests):
                    break
            time.sleep(0.02)
        with self._lock:
            fresh = {self.rank_of[e] for m, e in self.requests.items() if m not in self._told}
            self._told.update(self.requests)
            errors = dict(self._errors)
        if not fresh:
            return ""
        ok = sorted(r for r in fresh if r not in errors)
        said = [f"without an error on {rank_words(ok)}"] if ok else []
        by_error: dict[str, list[int]] = {}
        for rank in sorted(r for r in fresh if r in errors):
            by_error.setdefault(errors[rank], []).append(rank)
        said += [f"with {error} on {rank_words(ranks)}" for error, ranks in by_error.items()]
        return ("The cell that was running when the notebook process ended has now ended "
                + "; ".join(said) + ".")


# -- what Session and the magics ask (the main thread) ---------------------------------------


def busy(session) -> list[int]:
    """The ranks still running the cell from before the attach ([] without one)."""
    adopted = session.gen.adopted
    return adopted.busy_ranks(session.client) if adopted is not None else []


def interrupt(session) -> tuple[list[int], list[int]]:
    """Session.interrupt after an attach: a cell the notebook stopped waiting for first (the
    cell runner's), else the cell from before the attach: (the ranks sent SIGINT, those
    still in it ``INTERRUPT_SECONDS`` later)."""
    sent, still = session.cells.interrupt()
    if sent:
        return sent, still
    with session.life:
        sent = busy(session)
        if not sent:
            return [], []
        session.cells.signal(signal.SIGINT, sent)
        until = time.monotonic() + INTERRUPT_SECONDS
        while (still := busy(session)) and time.monotonic() < until:
            time.sleep(0.05)
        return sent, still


def from_before(session, with_news: bool = True) -> tuple[list, str]:
    """What the cell from before the attach printed since the last look (as late.py keeps
    it, short), and (``with_news``), once, one line on how it ended ('' before that)."""
    adopted = session.gen.adopted
    if adopted is None:  # (every cell asks)
        return [], ""
    news = adopted.news(session.client) if with_news else ""
    session.collect_late()  # (its error came before its end: shown with the line)
    return session.late.take_before(session.settings.max_output), news


def _pending(client) -> dict[str, int] | None:
    """Every request the hub lists as running or queued on an engine: msg id -> engine id
    (None: the hub did not answer)."""
    try:
        status = client.queue_status(verbose=True)
    except Exception:  # (a controller that ended: nothing is known)
        return None
    return {msg_id: engine_id for engine_id, queued in status.items()
            if isinstance(engine_id, int) and isinstance(queued, dict)
            for msg_id in queued.get("queue") or ()}
