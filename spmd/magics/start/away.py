"""What happened on the ranks while no notebook held their cluster, said once at
``%spmd attach``: which ranks still run the cell that was running when the notebook process
died, how the cells that ended meanwhile ended on each rank, and what each printed. A
lingering rank writes all of it to its own log (engine/life/unattended.py); it is read here, with
no request to the ranks, and copied into the notebook's logs for ``%spmd log RANK``. What the
cell that still runs prints from then on, and how it ends, the next cells show
(cluster/adopted.py).

A log is read from its end, ``ATTACH_TAIL`` bytes at most: a rank that printed more while no
notebook was there has its first lines left out, and the copy says so. Only what follows a
rank's mark of this death counts (one from an earlier death, or no mark in a long log, is
not, while the rank may not have noticed the death yet: the controller's gone.json, read by the
attach before it took the cluster, says when the death was found)."""

from __future__ import annotations

import calendar
import time

from spmd.engine.life.unattended import CELL_ENDED, GONE_LINE, GONE_STAMP
from spmd.words import rank_words

ATTACH_TAIL = 4 << 20
# A rank's mark may be this much older than the controller's note of the same death (each
# process looks every second, on its own clock); and this long after that note every rank has
# noticed the death (a long log without a mark in its tail printed more than the tail since).
SLACK_SECONDS = 10.0
NOTICED_SECONDS = 5.0


def what_happened(session) -> list[str]:
    """The lines ``%spmd attach`` says about the time without a notebook."""
    lines = []
    busy = _busy(session)
    if busy:
        lines.append(
            f"{rank_words(busy).capitalize()} still run{'s' if len(busy) == 1 else ''} the cell "
            "that was running when the notebook process ended: the next cell waits for it "
            "(%spmd interrupt stops it).")
    printed, ended = _read_logs(session)
    if ended:
        first = next(iter(ended.values()))[1]
        ok = sorted(r for r, (how, _) in ended.items() if how == "ok")
        said = [f"ended without an error on {rank_words(ok)}"] if ok else []
        said += [f"raised {how} on rank {r}" for r, (how, _) in sorted(ended.items())
                 if how != "ok"]
        lines.append(f"The cell that ran meanwhile ({first!r}) " + "; ".join(said) + ".")
    if printed:
        counts = ", ".join(f"rank {r} {n} line{'s' if n != 1 else ''}"
                           for r, n in sorted(printed.items()))
        lines.append(f"While no notebook was attached they printed: {counts} (%spmd log RANK "
                     "shows them).")
    return lines


def _busy(session) -> list[int]:
    """Ranks whose engine still has a request queued or running (the controller knows)."""
    adopted = session.gen.adopted
    if adopted is not None:
        return adopted.busy_ranks(session.record().client)
    try:
        status = session.record().client.queue_status_within()
    except Exception:
        return []
    if status is None:  # (no answer within a few seconds: nothing is known)
        return []
    by_engine = {r.engine_id: r.rank for r in session.ranks}
    return sorted(by_engine[e] for e, s in status.items()
                  if e in by_engine and isinstance(s, dict) and s.get("queue", 0) > 0)


def _read_logs(session) -> tuple[dict[int, int], dict[int, tuple[str, str]]]:
    """From each rank's log, after its mark: the lines it printed (copied into the notebook's
    logs; their count by rank), and how its last cell ended ((how, its first line) by rank)."""
    printed, ended = {}, {}
    read: set[int] = set()  # the ranks whose log was read
    adopted = session.gen.adopted
    died = getattr(adopted, "gone_at", None) or time.time()  # (None: found gone just now)
    session.logs.begin_cell("(while no notebook was attached)")
    for rank in range(len(session.ranks)):
        if adopted is not None:
            adopted.reading(rank)
        try:
            text = session.record().cluster.output_of(rank, tail=ATTACH_TAIL)
        except Exception:
            continue
        at = text.rfind(GONE_LINE)
        if at >= 0 and not _after(text[at + len(GONE_LINE):], died - SLACK_SECONDS):
            continue  # (an earlier death's mark is its last: it has not noticed this one yet)
        if at < 0 and (len(text.encode()) < ATTACH_TAIL  # (none: it printed nothing)
                       or time.time() - died < NOTICED_SECONDS):  # (it may not know yet)
            continue
        read.add(rank)
        if at < 0:  # (more than the tail: its first lines are left out)
            after = text.split("\n", 1)[1] if "\n" in text else ""
            after = f"... (the first lines are left out: see the end of the rank's own log) ...\n{after}"
        else:
            after = text[at:].split("\n", 1)[1] if "\n" in text[at:] else ""
        kept = []
        for line in after.splitlines(keepends=True):
            if line.startswith(CELL_ENDED):
                how, _, first = line[len(CELL_ENDED):].rstrip("\n").partition(" | ")
                ended[rank] = (how, first)
            else:
                kept.append(line)
        if "".join(kept).strip():
            session.logs.write(rank, "".join(kept))
            printed[rank] = len(kept)
    if printed:
        session.logs.flush()
    if adopted is not None:  # (what it held of these ranks is in what was read)
        adopted.release(read, session.record().client.late)
        adopted.told(set(ended))
    return printed, ended


def _after(stamped: str, earliest: float) -> bool:
    """Whether a mark's time (the text after ``GONE_LINE``) is ``earliest`` or later."""
    try:
        return calendar.timegm(time.strptime(stamped[:23], GONE_STAMP)) >= earliest
    except (ValueError, OverflowError):
        return False
