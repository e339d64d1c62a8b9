"""The cell that was still running on the ranks when their notebook process died, taken over by
the notebook that attaches (attach.py): what it prints and how it ends reach this notebook,
and ``%spmd interrupt`` reaches it.

Its requests carry the dead notebook's session, which ipyparallel's client leaves out. This
client's IO thread hands every IOPub message of another session here (``heard``, from
channel/client.py): only notebooks send the ranks requests, and the one before this one is
dead. Which requests were running is the hub's word, asked at the attach (its queue status);
one has ended when its ``status: idle`` came, or when the hub no longer lists it.

What a rank printed before the attach read its log (magics/start/away.py) is in that log: a rank
copies the output of the cell that ran when its notebook died to its log until that cell ends
(engine/life/unattended.py). So streams are held until the attach has read the logs (``release``);
there a held stream goes that reached this client before the read of its rank's log began
(``reading``: a rank writes its log before it sends), and the others are kept: a line twice is
better than one lost. Later streams, the
cell's error and its displays join the client's late outputs, which the next cell shows,
labelled as this cell's (late.py, magics/cells/cell.py), and the ranks' logs keep.

The face (session.py) keeps it in its generation (``gen.adopted``) and asks it, for the
magics: which ranks still run it, what it printed since the last look and how it ended; the
function at the end interrupts it.

Threads: the main thread makes it at the attach and asks it (``busy_ranks``, ``news`` and the
function below); the client's IO thread calls ``heard``. ``_lock`` guards what both touch,
and every addition to the client's late outputs (so that they stay in the order heard).
"""

from __future__ import annotations

import collections
import signal
import threading
import time

from spmd.words import rank_words

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
        # (the number each stream was heard as, the stream), until ``release``
        self._held: collections.deque = collections.deque()
        self._holding = True
        self._heard = 0  # how many streams and outputs were heard so far
        self._read_from: dict[int, int] = {}  # rank -> ``_heard`` as its log's read began
        self._dropped_unread: dict[int, int] = {}  # engine id -> held ones dropped, in its log
        self._dropped = 0  # outputs lost (too many to keep), for the late outputs to say
        # When the controller found the notebook gone (gone.json, read by the attach before it
        # took the cluster; None: not yet): magics/start/away.py reads only the ranks' logs since.
        self.gone_at: float | None = None

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
            self._heard += 1
            if not self._holding:  # (while held, every kind: released in the order heard)
                self._to_late(late, item)
                return
            if len(self._held) == HELD:  # (the oldest goes: in its rank's log if read after)
                number, (old_engine, old_kind, _) = self._held.popleft()
                began = self._read_from.get(self.rank_of.get(old_engine, -1))
                if old_kind == "stream" and (began is None or number <= began):
                    self._dropped_unread[old_engine] = self._dropped_unread.get(old_engine, 0) + 1
                else:
                    self._dropped += 1
            self._held.append((self._heard, item))

    def _to_late(self, late: collections.deque, item: tuple) -> None:
        """(under ``_lock``) One output to the client's late outputs; one that pushes out the
        oldest is counted."""
        if late.maxlen is not None and len(late) >= late.maxlen:
            self._dropped += 1
        late.append(item)

    # -- the main thread ---------------------------------------------------------------------

    def reading(self, rank: int) -> None:
        """The attach begins to read ``rank``'s log: what of it this client heard so far is
        in what it reads."""
        with self._lock:
            self._read_from[rank] = self._heard

    def release(self, read: set[int], late: collections.deque) -> None:
        """The attach has read the logs of the ranks ``read``: their streams held that came
        before the read began are in what it read, and go; every other held stream goes to
        the late outputs, in order, and from now on every stream does."""
        with self._lock:
            self._holding = False
            held, self._held = self._held, collections.deque()
            for number, item in held:
                rank = self.rank_of.get(item[0])
                if item[1] != "stream" or rank not in read or number > self._read_from.get(
                        rank, 0):  # (a display or an error is in no log: always shown)
                    self._to_late(late, item)
            self._dropped += sum(n for engine_id, n in self._dropped_unread.items()
                                 if self.rank_of.get(engine_id) not in read)
            self._dropped_unread.clear()

    def has_dropped(self) -> bool:
        return self._dropped > 0  # (a read of one int: the count is taken under the lock)

    def take_dropped(self) -> int:
        """How many of its outputs were too many to keep since the last call."""
        with self._lock:
            dropped, self._dropped = self._dropped, 0
            return dropped

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


# -- what the face asks (the main thread, under its lock) ------------------------------------


def interrupt(gen, client, signal_ranks) -> tuple[list[int], list[int]]:
    """The cell from before the attach (``gen.adopted``), interrupted: (the ranks sent SIGINT,
    those still in it ``INTERRUPT_SECONDS`` later). ``signal_ranks``: the cell runner's."""
    sent = gen.adopted.busy_ranks(client)
    if not sent:
        return [], []
    signal_ranks(gen, signal.SIGINT, sent)
    until = time.monotonic() + INTERRUPT_SECONDS
    while (still := gen.adopted.busy_ranks(client)) and time.monotonic() < until:
        time.sleep(0.05)
    return sent, still


def _pending(client) -> dict[str, int] | None:
    """Every request the hub lists as running or queued on an engine: msg id -> engine id
    (None: the hub did not answer)."""
    try:
        status = client.queue_status_within(verbose=True)
    except Exception:  # (a controller that ended: nothing is known)
        return None
    if status is None:  # (no answer within a few seconds: nothing is known)
        return None
    return {msg_id: engine_id for engine_id, queued in status.items()
            if isinstance(engine_id, int) and isinstance(queued, dict)
            for msg_id in queued.get("queue") or ()}
