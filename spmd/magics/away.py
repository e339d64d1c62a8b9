"""What happened on the ranks while no notebook held their cluster, said once at
``%spmd attach``: which ranks still run the cell that was running when the notebook process
died, how the cells that ended meanwhile ended on each rank, and what each printed. A
lingering rank writes all of it to its own log (engine/unattended.py); it is read here, with
no request to the ranks, and copied into the notebook's logs for ``%spmd log RANK``. What the
cell that still runs prints from then on, and how it ends, the next cells show
(cluster/adopted.py).

A log is read from its end, ``ATTACH_TAIL`` bytes at most: a rank that printed more while no
notebook was there has its first lines left out, and the copy says so."""

from __future__ import annotations

from spmd.cluster.lockstep.run import rank_words
from spmd.engine.unattended import CELL_ENDED, GONE_LINE

ATTACH_TAIL = 4 << 20


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
        return adopted.busy_ranks(session.client)
    try:
        status = session.client.queue_status()
    except Exception:
        return []
    by_engine = {r.engine_id: r.rank for r in session.ranks}
    return sorted(by_engine[e] for e, s in status.items()
                  if e in by_engine and isinstance(s, dict) and s.get("queue", 0) > 0)


def _read_logs(session) -> tuple[dict[int, int], dict[int, tuple[str, str]]]:
    """From each rank's log, after its mark: the lines it printed (copied into the notebook's
    logs; their count by rank), and how its last cell ended ((how, its first line) by rank)."""
    printed, ended = {}, {}
    read: set[int] = set()  # the ranks whose log was read
    session.logs.begin_cell("(while no notebook was attached)")
    for rank in range(len(session.ranks)):
        try:
            text = session.cluster.output_of(rank, tail=ATTACH_TAIL)
        except Exception:
            continue
        at = text.rfind(GONE_LINE)
        if at < 0 and len(text.encode()) < ATTACH_TAIL:  # (none: it printed nothing)
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
    adopted = session.gen.adopted
    if adopted is not None:  # (what it held of these ranks is in what was read)
        adopted.release(read, session.client.late)
        adopted.told(set(ended))
    return printed, ended
