"""What the notebook says about the cluster itself: the start summary and the rank table."""

from __future__ import annotations

import collections

from spmd.cluster.session import Session


def summary(session: Session, restarted: bool = False) -> str:
    s, first = session.settings, session.ranks[0]
    per = "device" if first.local_devices == 1 else "devices"
    devices = (
        f", {first.local_devices} {per} per process, {first.global_devices} global devices"
        if s.backend != "none"
        else ""
    )
    how = ""
    if restarted:
        how = ", forked by the rank server" if session._server else ", from the standby engines"
    fell_back = f"{session.fell_back}\n" if session.fell_back and not restarted else ""
    return (
        f"{fell_back}Started {s.n} processes{devices} ({s.backend}) in {session.start_seconds:.1f} s{how}. "
        "Auto mode on: every cell now runs on all ranks."
    )


def standby_line(session: Session) -> str:
    """One line on the standby engines: how many are ready, their pids and memory."""
    standbys = session.standbys()
    if not standbys:
        why = "off (--standby off)" if session.settings.standby is False else "none"
        return f"standby engines: {why}"
    counts = collections.Counter(r.state for r in standbys)
    # (as each measured itself once ready: standbys on other hosts have no handle here)
    memory = sum(r.memory for r in standbys)
    states = ", ".join(f"{n} {state}" for state, n in counts.items())
    pids = ",".join(str(r.pid) for r in standbys)
    return (
        f"standby engines: {states} (for %spmd restart; pids {pids}), "
        f"{memory / 2**20:.0f} MB in all"
    )


def status_table(session: Session, auto_on: bool) -> str:
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
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    state = "running" if session.running else "stopped"
    lines.append(
        f"cluster {state}, {session.settings.backend}, auto mode {'on' if auto_on else 'off'}"
    )
    if session._server is not None:
        lines.append(
            f"rank server: pid {session._server.pid} (imported the ranks' modules once; forks "
            "them at start and restart)"
        )
    elif session.cluster is not None:
        lines.append(standby_line(session))
    if session.out_of_step:
        lines.append(f"Cells are refused: {session.out_of_step}")
    return "\n".join(lines)
