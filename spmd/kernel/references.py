"""The debug protocol's references across ranks: one numbering for every rank's threads,
frames, variables and sources.

Each rank's debugpy numbers its own from 1, so two ranks give the same ids for different
things. Every id a rank gives is swapped for a new one here (a table per kind, as
jupyter-distributed does; 0, "nothing", stays 0), and swapped back when JupyterLab names it.
Tables, not arithmetic: a variable's reference can be a large number (pydevd uses ``id()``),
and JupyterLab's numbers are JavaScript's.

Threads: used from ipykernel's control thread (requests) and ipyparallel's IO thread
(events); ``_lock`` guards the tables.
"""

from __future__ import annotations

import itertools
import threading

# (the request field, the kind of thing it names)
_FIELDS = (("threadId", "thread"), ("frameId", "frame"), ("srcFrameId", "frame"),
           ("variablesReference", "var"))


class References:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ours: dict[tuple[str, int, int], int] = {}  # (kind, rank, its id) -> ours
        self._theirs: dict[tuple[str, int], tuple[int, int]] = {}  # (kind, ours) -> (rank, id)

    def ours(self, kind: str, rank: int, theirs: int) -> int:
        """Our id for rank ``rank``'s ``theirs``, made the first time it is seen."""
        if not theirs:
            return 0
        with self._lock:
            key = (kind, rank, theirs)
            found = self._ours.get(key)
            if found is None:
                found = self._ours[key] = next(self._ids)
                self._theirs[(kind, found)] = (rank, theirs)
            return found

    def rank_and_id(self, kind: str, ours: int) -> tuple[int, int] | None:
        """(rank, its id) for our id, or None."""
        with self._lock:
            return self._theirs.get((kind, ours)) if ours else None

    def forget_frames(self, rank: int | None = None) -> None:
        """Frames and variables live while a rank is stopped (DAP's rule): forgotten when it
        goes on, so the tables stay small (``rank``: that rank's only)."""
        with self._lock:
            for key in [k for k in self._ours if k[0] in ("frame", "var")
                        and rank in (None, k[1])]:
                self._theirs.pop((key[0], self._ours.pop(key)), None)

    def clear(self) -> None:
        with self._lock:
            self._ours.clear()
            self._theirs.clear()

    def to_rank(self, request: dict) -> tuple[int | None, dict]:
        """The rank a request names (None: no reference in it), and the request in that
        rank's ids. LookupError: it names nothing any rank holds now."""
        args = dict(request.get("arguments") or {})
        rank = None
        for field, kind in _FIELDS:
            if args.get(field):
                found = self.rank_and_id(kind, args[field])
                if found is None:
                    raise LookupError(f"{field} {args[field]} names nothing any rank holds now "
                                      "(it went on since)")
                rank, args[field] = found
        source = args.get("source")
        if isinstance(source, dict) and source.get("sourceReference"):
            found = self.rank_and_id("source", source["sourceReference"])
            if found is not None:
                rank = found[0]
                args["source"] = {**source, "sourceReference": found[1]}
        return rank, {**request, "arguments": args}

    def from_rank(self, rank: int, reply: dict) -> dict:
        """A rank's reply in our ids."""
        body = reply.get("body")
        if not isinstance(body, dict):
            return reply
        body = dict(body)
        if "stackFrames" in body:
            body["stackFrames"] = [self._frame(rank, f) for f in body["stackFrames"]]
        for listed in ("scopes", "variables"):
            if listed in body:
                body[listed] = [self._with_var(rank, v) for v in body[listed]]
        return {**reply, "body": self._with_var(rank, body)}

    def _with_var(self, rank: int, item: dict) -> dict:
        if "variablesReference" not in item:
            return item
        return {**item, "variablesReference": self.ours("var", rank, item["variablesReference"])}

    def _frame(self, rank: int, frame: dict) -> dict:
        # (named by rank: JupyterLab's call stack shows one rank's frames at a time)
        frame = {**frame, "id": self.ours("frame", rank, frame["id"]),
                 "name": f"[rank {rank}] {frame.get('name', '')}"}
        source = frame.get("source")
        if isinstance(source, dict) and source.get("sourceReference"):
            frame["source"] = {**source, "sourceReference": self.ours(
                "source", rank, source["sourceReference"])}
        return frame
