"""The live panel: one row per rank while a cell runs (state, seconds, host and pid, memory).

It is one display that is updated a few times a second, as HTML with a text form, so that
the straggler stands out while the cell runs, and a saved notebook keeps a readable summary
of who took how long (the last update), in any front end, without a widget model.
"""

from __future__ import annotations

import collections
import html
import time

import psutil
from IPython.display import display

from spmd.cluster.records import CellResult
from spmd.cluster.session import CellRun, Session
from spmd.magics.cells import grouped
from spmd.words import rank_words

_COLOURS = {
    "input": "#d0ebff",
    "debugger": "#d0ebff",
    "busy": "#fff4ce",
    "error": "#fde2e1",
    "dead": "#fde2e1",
    "straggler": "#ffd8a8",
}


class Panel:
    """The rows of one cell, shown live once it has run ``delay`` seconds, then frozen."""

    delay = 0.25  # seconds before the first showing: a fast cell shows only its summary
    every = 0.25  # seconds between updates

    def __init__(self, session: Session) -> None:
        self.session = session
        self.handle = None
        self._shown_at = 0.0
        self._processes: dict[int, psutil.Process] = {}

    def tick(self, run: CellRun) -> None:
        now = time.monotonic()
        if now - run.started < self.delay or now - self._shown_at < self.every:
            return
        self.show_now(run)

    def show_now(self, run: CellRun) -> None:
        self._shown_at = time.monotonic()
        self._show(panel_bundle(self.rows(run), live=True))

    def freeze(self, ran: CellResult) -> None:
        """The summary: the last update of the live panel, or the panel shown once."""
        self._show(panel_bundle(self.rows(ran), live=False))
        self.handle = None

    def forget(self) -> None:
        """The cell's output was cleared (with the live panel in it)."""
        self.handle = None

    def _show(self, bundle: dict) -> None:
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def rows(self, run: CellRun | CellResult | None) -> list[dict]:
        """One row per rank, for the cell ``run``, running or ended (None: as the ranks are
        between cells)."""
        now = time.monotonic()
        dead = self.session.deaths.dead_ranks(self.session.gen) if self.session.running else set()
        cells = run.cells if run is not None else {}
        any_done = any(c.done for c in cells.values())
        if run is None:
            paused = set()
        elif isinstance(run, CellResult):  # (as the wait for it ended)
            paused = set(run.in_debugger)
        else:
            paused = set(run.debugger_paused())
        rows = []
        for r in self.session.ranks:
            cell = cells.get(r.rank)
            if r.rank in dead or r.state == "died":
                state = "dead"
            elif run is not None and r.rank in run.prompting:
                state = "input"  # waits for the person at a prompt
            elif run is not None and r.rank in paused:
                state = "debugger"  # paused in JupyterLab's debugger
            elif cell is None:
                state = "idle" if r.state != "stopped" else "stopped"  # (not in this cell)
            elif not cell.done:
                state = "straggler" if any_done else "busy"
            else:
                state = "error" if cell.error is not None else "done"
            seconds = r.last_seconds if run is None else None
            if cell is not None:
                seconds = cell.seconds if cell.done else now - run.started
            rows.append(
                dict(
                    rank=r.rank,
                    state=state,
                    seconds=seconds,
                    host=r.host,
                    pid=r.pid,
                    memory=self._memory(r),
                )
            )
        return rows

    def _memory(self, rank) -> int:
        """Resident memory in bytes: read live for a process of this machine."""
        if rank.rank not in self.session.gen.launchers:
            return rank.memory
        proc = self._processes.get(rank.rank)
        try:
            if proc is None or proc.pid != rank.pid:
                proc = self._processes[rank.rank] = psutil.Process(rank.pid)
            return proc.memory_info().rss
        except psutil.Error:
            return 0


def panel_bundle(rows: list[dict], live: bool | None) -> dict:
    """``live``: True while a cell runs, False for its summary, None between cells."""
    return {"text/html": panel_html(rows, live), "text/plain": panel_text(rows, live)}


def _cells(row: dict) -> list[str]:
    seconds = "-" if row["seconds"] is None else f"{row['seconds']:.2f} s"
    memory = f"{row['memory'] / 2**20:.0f} MB" if row["memory"] else "-"
    state = "busy" if row["state"] == "straggler" else row["state"]
    return [str(row["rank"]), state, seconds, f"{row['host']}:{row['pid']}", memory]


def headline(rows: list[dict], live: bool | None) -> str:
    busy = [r["rank"] for r in rows if r["state"] in ("busy", "straggler")]
    late = [r["rank"] for r in rows if r["state"] == "straggler"]
    done = [r for r in rows if r["state"] in ("done", "error")]
    if live is None:  # between cells (%spmd panel)
        states = collections.Counter(r["state"] for r in rows)
        return "Ranks now: " + ", ".join(f"{n} {state}" for state, n in states.items()) + "."
    asking = [r["rank"] for r in rows if r["state"] == "input"]
    if live and asking:
        return f"Waiting for you: {rank_words(asking)} asked for input."
    stopped = [r["rank"] for r in rows if r["state"] == "debugger"]
    if live and stopped:
        return (f"Waiting for you: {rank_words(stopped)} paused in the debugger (Continue, "
                "or a step, in its panel).")
    if live and late:
        return f"Running: {rank_words(late)} still busy after the others finished."
    if live:
        return f"Running: {len(busy)} of {len(rows)} ranks busy."
    took = [r["seconds"] for r in done if r["seconds"] is not None]
    if not took:
        return "The cell ended."
    slowest = max(done, key=lambda r: r["seconds"] or 0.0)
    spread = max(took) - min(took)
    return (
        f"The cell took {max(took):.2f} s; the slowest was rank {slowest['rank']} "
        f"({spread:.2f} s behind the fastest)."
    )


_HEAD = ["rank", "state", "seconds", "host:pid", "memory"]  # (seconds: in the cell, or the last)
_GROUP_HEAD = ["ranks", "state", "seconds", "hosts", "memory"]


def _table(rows: list[dict]) -> tuple[list[str], list[tuple[dict, list[str]]]]:
    """The panel's header and rows: one per rank, or beyond grouped.MANY ranks one per group
    of ranks in the same state (the first rank's row stands for the group's state)."""
    if len(rows) <= grouped.MANY:
        return _HEAD, [(row, _cells(row)) for row in rows]
    table = []
    for group in grouped.groups(rows, lambda r: (r["state"],)):
        state = "busy" if group[0]["state"] == "straggler" else group[0]["state"]
        table.append((group[0], [
            grouped.ranks(group), state,
            grouped.spread((r["seconds"] for r in group), lambda s: f"{s:.2f} s"),
            grouped.hosts(group),
            grouped.spread((r["memory"] or None for r in group),
                           lambda m: f"{m / 2**20:.0f} MB"),
        ]))
    return _GROUP_HEAD, table


def panel_text(rows: list[dict], live: bool | None) -> str:
    head, body = _table(rows)
    table = [head, *(cells for _, cells in body)]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [headline(rows, live)]
    for row, cells in zip([None, *(row for row, _ in body)], table):
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        if row is not None and row["state"] == "straggler":
            line += "   <- straggler"
        lines.append(line)
    return "\n".join(lines)


def panel_html(rows: list[dict], live: bool | None) -> str:
    columns, table = _table(rows)
    head = "".join(f"<th style='text-align:left;padding:0 12px 0 0'>{h}</th>" for h in columns)
    body = []
    for row, texts in table:
        colour = _COLOURS.get(row["state"])
        style = f" style='background:{colour}'" if colour else ""
        cells = "".join(
            f"<td style='padding:0 12px 0 0'>{html.escape(c)}</td>" for c in texts
        )
        mark = " <b>straggler</b>" if row["state"] == "straggler" else ""
        body.append(f"<tr{style}>{cells}<td>{mark}</td></tr>")
    return (
        f"<div class='spmd-panel'><div>{html.escape(headline(rows, live))}</div>"
        f"<table style='font-family:monospace;border-collapse:collapse'>"
        f"<tr>{head}<th></th></tr>{''.join(body)}</table></div>"
    )
