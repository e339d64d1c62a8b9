"""What happened on the ranks while no notebook held their cluster, said once at
``%spmd attach``: which ranks still run the cell that was running when the notebook process
died, how the last cell ended on the others, and what each printed meanwhile (a lingering
rank writes it to its own log; it goes into the notebook's logs, for ``%spmd log RANK``)."""

from __future__ import annotations

from spmd.cluster.lockstep.run import rank_words
from spmd.engine.orphans import GONE_LINE


def last_cell() -> dict | None:
    """(on a rank) The last cell this rank ran: its first line, and its error ('' if none)."""
    from IPython import get_ipython

    result = getattr(get_ipython(), "last_execution_result", None)
    if result is None:
        return None
    error = result.error_in_exec or result.error_before_exec
    first = next((ln for ln in (result.info.raw_cell or "").splitlines() if ln.strip()), "")
    return {"first": first.strip()[:80], "error": f"{type(error).__name__}: {error}"[:200]
            if error else ""}


def what_happened(session) -> list[str]:
    """The lines ``%spmd attach`` says about the time without a notebook."""
    lines = []
    busy = _busy(session)
    if busy:
        lines.append(
            f"{rank_words(busy).capitalize()} still run{'s' if len(busy) == 1 else ''} the cell "
            "that was running when the notebook process ended: the next cell waits for it "
            "(%spmd interrupt stops it).")
    ended = {}
    for rank in range(len(session.ranks)):
        if rank in busy:
            continue
        try:
            ended[rank] = session.call(rank, last_cell, timeout=5)
        except Exception:  # (a rank that does not answer: said by the next cell)
            continue
    failed = {r: e for r, e in ended.items() if e and e["error"]}
    done = [r for r, e in ended.items() if e and not e["error"]]
    if ended and any(ended.values()):
        first = next(e["first"] for e in ended.values() if e)
        said = f"The last cell ({first!r}) "
        if done:
            said += f"ended without an error on {rank_words(done)}"
        for rank, e in sorted(failed.items()):
            said += f"{'; ' if done or rank != min(failed) else ''}raised {e['error']} on rank {rank}"
        lines.append(said + ".")
    printed = _printed_while_away(session)
    if printed:
        counts = ", ".join(f"rank {r} {n} line{'s' if n != 1 else ''}"
                           for r, n in sorted(printed.items()))
        lines.append(f"While no notebook was attached they printed: {counts} (%spmd log RANK "
                     "shows them).")
    return lines


def _busy(session) -> list[int]:
    """Ranks whose engine still has a request queued or running (the controller knows)."""
    try:
        status = session.client.queue_status()
    except Exception:
        return []
    by_engine = {r.engine_id: r.rank for r in session.ranks}
    return sorted(by_engine[e] for e, s in status.items()
                  if e in by_engine and isinstance(s, dict) and s.get("queue", 0) > 0)


def _printed_while_away(session) -> dict[int, int]:
    """Each rank's lines after its log's mark, copied into the notebook's logs: their
    count, by rank."""
    counts = {}
    session.logs.begin_cell("(while no notebook was attached)")
    for rank in range(len(session.ranks)):
        try:
            text = session.cluster.output_of(rank)
        except Exception:
            continue
        at = text.rfind(GONE_LINE)
        if at < 0:
            continue
        after = text[at:].split("\n", 1)[1] if "\n" in text[at:] else ""
        if after.strip():
            session.logs.write(rank, after)
            counts[rank] = len(after.rstrip("\n").splitlines())
    if counts:
        session.logs.flush()
    return counts
