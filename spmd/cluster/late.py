"""What ranks print after their cell has ended (a thread, a callback): taken from the
client's queue into the ranks' logs at once (a death report points there), and kept for the
next cell to show, short as a cell's output is (--max-output). What the cell that ran when the
notebook before this one died prints after an attach comes the same way, marked as its own
(adopted.py), and is kept apart (``take_before``).

A part of Session (session.py). The client's IO thread fills its queue (channel/client.py);
this side takes from it only under Session's lock (Session.collect_late), on whichever thread
holds it.
"""

from __future__ import annotations

from spmd.cluster.adopted import FROM_BEFORE
from spmd.cluster.lockstep.logs import RankLogs
from spmd.cluster.lockstep.run import RankCell, output_from_message, unmarked
from spmd.cluster.records import Output


class LateOutputs:
    def __init__(self) -> None:
        self.taken: list[tuple[int, Output]] = []  # taken from the client, for the next cell
        self.before: list[tuple[int, Output]] = []  # the same, of the cell from before an attach
        # Every engine id the cluster's ranks had, and its rank (ids change at a restart; a
        # thread of an old rank may still print): for outputs that come after their cell.
        self.engine_rank: dict[int, int] = {}

    def know(self, ranks) -> None:
        """These rank rows' engine ids are theirs (a start's or a restart's)."""
        self.engine_rank.update({r.engine_id: r.rank for r in ranks})

    def collect(self, client, logs: RankLogs) -> None:
        """Take what the client kept of the ranks' late outputs: streams into the logs now,
        everything kept for the next cell to show."""
        late = getattr(client, "late", None)
        adopted = getattr(client, "adopted", None)
        if late is None or (not late and not (adopted is not None and adopted.has_dropped())):
            return
        while True:
            try:
                engine_id, kind, content = late.popleft()
            except IndexError:
                break
            rank, out = self.engine_rank.get(engine_id), output_from_message(kind, content)
            if rank is None or out is None:
                continue
            if out.kind in ("stdout", "stderr"):  # (its cell's reply went: no parts come)
                out.text = unmarked(out.text)
                logs.write(rank, out.text)
            elif out.kind == "display" and "\x00" in out.data.get("text/plain", ""):
                out.data = {**out.data, "text/plain": unmarked(out.data["text/plain"])}
            (self.before if content.get(FROM_BEFORE) else self.taken).append((rank, out))
        dropped, client.late_dropped = client.late_dropped, 0
        if adopted is not None:  # (what the cell from before an attach printed, too)
            dropped += adopted.take_dropped()
        if dropped:
            self.taken.append((0, Output("stderr", f"... {dropped:,} outputs printed after "
                                         "their cell ended were too many to keep ...\n")))
        logs.flush()

    def take(self, max_lines: int | None) -> list[tuple[int, Output]]:
        """What was taken since the last call, in order and cut per rank to ``max_lines``
        stream lines, as a cell's output is. Every line of it is in the ranks' logs already."""
        late, self.taken = self.taken, []
        return _short(late, max_lines)

    def take_before(self, max_lines: int | None) -> list[tuple[int, Output]]:
        """As ``take``, for the outputs of the cell from before an attach."""
        before, self.before = self.before, []
        return _short(before, max_lines)


def _short(late: list[tuple[int, Output]], max_lines: int | None) -> list[tuple[int, Output]]:
    """The outputs in order, cut per rank to ``max_lines`` stream lines."""
    by_rank: dict[int, RankCell] = {}
    order = []
    for rank, out in late:
        if rank not in by_rank:
            by_rank[rank] = RankCell(rank, max_lines=max_lines)
            order.append(rank)
        by_rank[rank].add(out)
    shown = []
    for rank in order:
        by_rank[rank].finish()
        shown += [(rank, out) for out in by_rank[rank].outputs]
    return shown
