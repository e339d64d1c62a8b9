"""What the notebook says about the cluster itself: the start summary and the rank table."""

from __future__ import annotations

from spmd.cluster.session import Session
from spmd.magics.cells import grouped


def summary(session: Session, restarted: bool = False) -> str:
    s, first = session.settings, session.ranks[0]
    per = "device" if first.local_devices == 1 else "devices"
    devices = (
        f", {first.local_devices} {per} per process, {first.global_devices} global devices"
        if s.backend != "none"
        else ""
    )
    running = session.record()
    how = ", forked by the rank server" if restarted and running.rank_server is not None else ""
    fell_back = f"{running.fell_back}\n" if running.fell_back else ""
    return (
        f"{fell_back}Started {s.n} processes{devices} ({s.backend}) in {session.start_seconds:.1f} s{how}. "
        "Auto mode on: every cell now runs on all ranks."
    )


def status_table(session: Session, auto_on: bool, every_rank: bool = False) -> str:
    """The rank table: a row per rank, or beyond ``grouped.MANY`` ranks (unless
    ``every_rank``) a row per group of ranks alike."""
    if every_rank or len(session.ranks) <= grouped.MANY:
        lines = _rank_rows(session)
    else:
        lines = _group_rows(session)
    return "\n".join(lines + _cluster_lines(session, auto_on))


def _table(head: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows)]


def _rank_rows(session: Session) -> list[str]:
    # GPUs: what each rank was given (CUDA_VISIBLE_DEVICES), where any rank was given some
    gpus = any(r.gpus is not None for r in session.ranks)
    head = ("rank", "host", "pid", "state", "devices", *(("gpus",) if gpus else ()), "last cell")
    rows = [
        (
            str(r.rank),
            r.host,
            str(r.pid),
            r.state,
            str(r.local_devices),
            *((",".join(r.gpus or []) or "none",) if gpus else ()),
            "-" if r.last_seconds is None else f"{r.last_seconds:.2f} s",
        )
        for r in session.ranks
    ]
    return _table(head, rows)


def _group_rows(session: Session) -> list[str]:
    """One row per group of ranks in the same state with the same devices (and as many
    GPUs each), then how to list them all."""
    rows = [dict(rank=r.rank, host=r.host, state=r.state, devices=r.local_devices,
                 gpus=None if r.gpus is None else len(r.gpus), seconds=r.last_seconds)
            for r in session.ranks]
    gpus = any(r["gpus"] is not None for r in rows)
    head = ("ranks", "hosts", "state", "devices", *(("gpus each",) if gpus else ()),
            "last cell")
    table = [
        (
            grouped.ranks(group),
            grouped.hosts(group),
            group[0]["state"],
            str(group[0]["devices"]),
            *((str(group[0]["gpus"] or 0),) if gpus else ()),
            grouped.spread((r["seconds"] for r in group), lambda s: f"{s:.2f} s"),
        )
        for group in grouped.groups(rows, lambda r: (r["state"], r["devices"], r["gpus"]))
    ]
    return [*_table(head, table),
            f"{len(rows)} ranks in {len(table)} group{'s' if len(table) > 1 else ''} "
            "(%spmd status all lists every rank)"]


def _cluster_lines(session: Session, auto_on: bool) -> list[str]:
    lines = []
    state = "running" if session.running else "stopped"
    lines.append(
        f"cluster {state}, {session.settings.backend}, auto mode {'on' if auto_on else 'off'}"
    )
    running = session.record()
    if running.rank_server is not None:
        lines.append(
            f"{running.rank_server.describe()} (imported the ranks' modules once; forks them at "
            "start and restart)"
        )
    elif running.cluster is not None:
        lines.append("rank server: none (a Python per rank; %spmd restart starts afresh)")
    if session.out_of_step:
        lines.append(f"Cells are refused: {session.out_of_step}")
    return lines
