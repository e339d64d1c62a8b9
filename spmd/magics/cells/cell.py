"""The steps of one ``%%spmd`` cell, one job each: what comes before it, the run, what is
shown after it, its warnings and hints, its value, and its failure.

``SpmdMagics._run`` (magics.py) calls them in order and keeps the bookkeeping that is the
magics' own (what ran, the census's requests, the failed ranks). Main thread only: a magic
runs on the notebook's main thread, and ipykernel routes output by that thread's cell.
"""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.display import display

from spmd.cluster import interrupts
from spmd.cluster.records import DIED, DIVERGED, INTERRUPTED, CellResult, left_out_line
from spmd.cluster.session import OutOfStep, Session
from spmd.magics.arrays import meshes, transfers, values
from spmd.magics.arrays.transfers import PLACEHOLDER_BEGINS
from spmd.magics.cells import census_report, report, widgets
from spmd.magics.cells.automode import EXITS
from spmd.magics.cells.panel import Panel
from spmd.magics.cells.render import (
    LiveView,
    RankErrors,
    RankResults,
    labelled,
    show_group,
    show_outputs,
    write,
)
from spmd.wire import GLOBAL_ARRAY_MIME, RANKS_DATA_MIME
from spmd.words import rank_set, rank_words, uncoloured

# -- before the run ---------------------------------------------------------------------------


def show_before(live: LiveView, session: Session, started: str | None) -> None:
    """The kernel's start line again (``started``: a live view follows it), then what ranks
    printed after their last cell ended, and after an attach what the cell that ran when the
    notebook before this one died printed since, and once how it ended."""
    if started:
        live.reprint("stdout", started + "\n")
    wait_for_the_cell_from_before(live, session)
    show_late(live, session.late_outputs())
    before, news = session.outputs_before_attach()
    show_late(live, before, "in a cell from before the attach")
    if news:
        live.note("stdout", news + "\n")


def wait_for_the_cell_from_before(live: LiveView, session: Session) -> None:
    """After an attach, a cell is sent once the cell that ran when the notebook before this
    one died has ended on every rank (sent behind it, it would start on a rank that ended
    that one first, and look diverged there), showing what that cell prints meanwhile. An
    interrupt stops that cell, and this one is not sent."""
    busy = session.busy_before_attach()
    if not busy:
        return
    live.note("stdout", f"Waiting for the cell from before the attach to end on "
                        f"{rank_words(busy)} (Interrupt stops it)...\n")
    try:
        while session.busy_before_attach():
            show_late(live, session.outputs_before_attach(with_news=False)[0],
                      "in a cell from before the attach")
            time.sleep(0.1)
    except KeyboardInterrupt:
        sent, still = session.interrupt()
        left = (f"; {rank_words(still)} did not respond: %spmd restart ends them" if still
                else "")
        raise UsageError(f"Interrupted: the cell from before the attach was stopped on "
                         f"{rank_words(sent)}{left}. This cell was not run.") from None


def show_late(live: LiveView, late: list, when: str = "after its cell ended") -> None:
    """What ranks printed after their cell had ended (threads, callbacks), before this cell's
    own outputs, labelled as such (``when``)."""
    for rank, out in late:
        label = f"[rank {rank}, {when}]"
        if out.kind in ("stdout", "stderr"):
            live.note(out.kind, labelled(label, out.text))
        elif out.kind == "error":
            live.note("stderr", labelled(label, "\n".join(out.traceback) or out.evalue))
        elif out.kind == "display":
            show_group([rank], out)


def check_ranks(ranks: list[int] | None, n: int, live: LiveView, debugging: bool) -> None:
    """``--ranks`` names ranks of this cluster; a subset gets a note (not for ``%spmd
    debug``, which runs on one rank by design)."""
    if ranks is None:
        return
    if ranks[-1] >= n:
        raise UsageError(f"--ranks {rank_set(ranks)}: this cluster has ranks 0-{n - 1}.")
    if len(ranks) < n and not debugging:
        live.note(
            "stderr",
            f"Running on ranks {rank_set(ranks)} only: a collective in this cell would "
            "hang, waiting for the other ranks.\n",
        )


def refuse_exit(cell: str) -> None:
    """``exit`` is not sent to the ranks."""
    if cell.strip() in EXITS:
        raise UsageError(
            "exit on the ranks would end each rank's process, and the next cell would find "
            "them dead: %spmd stop ends the cluster, and exit in a cell of its own ends "
            "this notebook's kernel (and its cluster)."
        )


# -- the run ----------------------------------------------------------------------------------


def run_on_ranks(
    session: Session, code: str, opts, live: LiveView, breakpoints: str
) -> CellResult:
    """``code`` on the ranks, its outputs streamed into ``live``: what the cell was once the
    wait for it ended. A cell the out-of-step guard refuses raises UsageError."""
    try:
        run = session.run_cell(
            code,
            live,
            ranks=opts.ranks,
            timeout=opts.timeout,
            grace=opts.grace,
            max_output=opts.max_output,
            breakpoints=breakpoints,
        )
    except OutOfStep as exc:
        raise UsageError(refusal(session, f"Cell not run: {exc}")) from None
    finally:
        live.close()
    return run


# -- after the run ----------------------------------------------------------------------------


def show_cell(
    session: Session, ran: CellResult, live: LiveView, panel: Panel | None, tabs: bool,
    then: bool,
) -> None:
    """The panel's summary, then the cell's outputs grouped (widgets with the text they read
    now, of the ranks that finished); ``then``: the cell's value or error follows."""
    if live.widgets_shown:
        busy = set(ran.stall.busy) if ran.stall is not None else set()
        widgets.refresh_texts(session, ran.cells, [r for r in ran.cells if r not in busy])
    if panel is not None:
        panel.freeze(ran)
    show_outputs(ran.cells, tabs=tabs, then=then)


def warn_if_launches_differ(session: Session, ran: CellResult, raised: bool) -> None:
    """A line when the cell ended (nothing hung) though its ranks launched different programs
    (``raised``: some ranks raised, and their errors follow)."""
    # (each rank's census digest, None where it launched nothing: alike, nothing to say)
    digests = {tuple(d) if d else None for d in (ran.census.get(r) for r in ran.cells)}
    if ran.stall is not None or len(digests) <= 1:
        return
    # (part of the cell's report: a ^C in its wait for the records would drop the errors
    # below)
    with interrupts.held("the cell's report"):
        said = census_report.warning(session.census(ran.engine_ids, ran.requests),
                                     raised=raised)
    if said:
        write("stderr", said + "\n")


def hint_placeholders(session: Session, cell: str, ran: CellResult) -> None:
    """A hint when the ranks printed jax's placeholder for a global array."""
    printed = [(rank, o.text) for rank, c in ran.cells.items() for o in c.outputs
               if o.kind == "stdout" and PLACEHOLDER_BEGINS in o.text]
    if not printed:  # (most cells: nothing to look up on the ranks)
        return
    hint = transfers.placeholder_hint(session, cell, printed)
    if hint:
        write("stderr", hint + "\n")


def cell_value(
    session: Session, ran: CellResult, results: list, n: int, label: str
) -> RankResults | values.GlobalValue:
    """The value of a cell that failed nowhere: an array one rank holds (said once), a global
    array (printed once), or the ranks' results grouped (a label where not every rank
    returned it). ``label``: the cell's ``Out[n]``."""
    if not any(o.kind == "result" and GLOBAL_ARRAY_MIME in o.data
               for c in ran.cells.values() for o in c.outputs):
        return RankResults.of(results, n)  # (no rank's value is part of a global array)
    held = values.held_by_some(ran.cells)
    if held is not None:  # (shown once, as the processes that hold it print it)
        holders, out, part = held
        write("stdout", values.about_held(holders, part) + "\n")
        return RankResults.of([(sorted(ran.cells), out)], n)
    spanning = values.payloads(ran.cells)
    if spanning:
        try:
            return global_value(session, spanning, label)
        except (ValueError, TypeError):  # (values.Incomplete; print options)
            pass
    return RankResults.of(results, n)


def global_value(session: Session, parts: dict[int, dict], label: str) -> values.GlobalValue:
    """A result that is one jax.Array (or DTensor) over several processes, printed once as
    jax (or torch) prints it in one process, under a line that says what it is; ``Out[n]``
    (``label``) turns into its value as numpy when used as an array."""
    shown = {rank: (part["count"], part["token"]) for rank, part in parts.items()}
    first = next(iter(parts.values()))
    text = values.text(list(parts.values()))  # (raises values.Incomplete)
    write("stdout", values.about(first, len(parts)) + "\n")
    return values.GlobalValue(
        text,
        first["shape"],
        first["dtype"],
        lambda: transfers.gather_shown(session, label, shown),
        received=sum(len(piece["data"]) * 3 // 4 for part in parts.values()
                     for piece in part["pieces"]),
        ranks=sorted(parts),
    )


def cell_failure(
    session: Session, cell: str, ran: CellResult, errors: list, results: list
) -> RankErrors:
    """The cell failed (a rank raised, or the wait ended early): what did return is shown,
    not returned, and the report is one exception, for the magic to raise."""
    for group in results:
        show_group(*group)
    notes, details, hints, title = [], [], [], ""
    stall = ran.stall
    if stall is not None:
        notes, title = report.summary(stall), report.title(stall)
        details = (report.stack_section(stall.busy, stall.stacks, stall.in_debugger)
                   + census_report.census_section(stall))
        if stall.deaths:
            details = ["", *report.describe(stall.deaths[0], headline=False), *details]
    else:
        hints = [h for h in [transfers.gather_hint(session, cell, errors)
                             or meshes.mesh_hint(session, errors)] if h]
    dead = [d.rank for d in stall.deaths] if stall is not None else []
    return RankErrors(errors, sorted(ran.cells), notes, details, hints, dead, title)


# -- words for the steps ----------------------------------------------------------------------


def how_it_failed(stall, errors) -> str:
    """In a few words, for an export's comment: 'ZeroDivisionError on rank 1', 'the ranks
    diverged' ('' when the cell did not fail)."""
    if stall is not None:
        return {DIED: "a rank died", DIVERGED: "the ranks diverged",
                INTERRUPTED: "it was interrupted"}.get(stall.reason, "it timed out")
    return "; ".join(f"{error.ename} on {rank_words(ranks)}" for ranks, error in errors)


def interrupted_by_us(stall) -> set[int]:
    """Ranks whose KeyboardInterrupt came from the watchdog's own SIGINT: not their error."""
    return set() if stall is None else set(stall.busy)


def refusal(session: Session, text: str) -> str:
    """A refusal, with the dead rank's report when a death is the reason."""
    if session.death is not None:
        text += "\n" + "\n".join(report.describe(session.death))
    return text

# -- each rank's outputs as data --------------------------------------------------------------
#
# The notebook groups what the ranks printed so that a person sees what is the same on every
# rank; a program (nbclient, papermill, an agent's tool) would have to parse the [rank 1]
# labels back. So every cell that ran on the ranks also shows one display output of MIME type
# application/vnd.spmd.ranks+json: for each rank, its text, its value, its error with the
# traceback and how the cell ended on it (docs/reference/ranks-json.md has the schema). Beside
# it is an empty text/plain: a front end that does not know the type shows nothing, and
# JupyterLab's extension (labextension/src/ranksdata.ts) hides it. It is saved with the
# notebook. Bounded as the text is: each rank's streams are the lines its RankCell kept
# (--max-output), with the count left out; a display or value is its text/plain and the names
# of its MIME types, never a picture's bytes.

RANKS_DATA_VERSION = 1  # (docs/reference/ranks-json.md: its schema)


def ranks_data(ran, count: int | None) -> dict:
    """The cell ``ran`` (records.CellResult) rank by rank; ``count``: its ``In[n]``."""
    stall = ran.stall
    dead = {d.rank for d in stall.deaths} if stall is not None else set()
    busy = set(stall.busy) if stall is not None else set()
    paused = set(stall.in_debugger) if stall is not None else set()
    ranks = []
    for rank in sorted(ran.engine_ids):  # (the ranks it ran on)
        cell = ran.cells.get(rank)
        outputs = cell.outputs if cell is not None else []
        error = cell.error if cell is not None else None
        if rank in dead:
            ended = "died"
        elif rank in busy:  # (in the cell when the notebook stopped waiting for it)
            ended = ("paused" if rank in paused else
                     "interrupted" if stall.reason == INTERRUPTED else "running")
        elif error is not None:
            ended = "interrupted" if error.ename == "KeyboardInterrupt" else "error"
        else:
            ended = "ok"
        value = next((o for o in outputs if o.kind == "result"), None)
        left_out = cell.left_out if cell is not None else 0
        stderr = "".join(o.text for o in outputs if o.kind == "stderr")
        if left_out:  # (the notebook's line that says so, which the rank did not write)
            stderr = stderr.replace(left_out_line(left_out), "", 1)
        ranks.append({
            "rank": rank,
            "ended": ended,
            "seconds": round(cell.seconds, 3) if cell is not None and cell.seconds else None,
            "stdout": "".join(o.text for o in outputs if o.kind == "stdout"),
            "stderr": stderr,
            "lines_left_out": left_out,
            "displays": [_shown(o) for o in outputs if o.kind == "display"],
            "value": _shown(value) if value is not None else None,
            "error": None if error is None else {
                "ename": error.ename, "evalue": error.evalue,
                "traceback": [uncoloured(line) for line in error.traceback]},
        })
    return {
        "version": RANKS_DATA_VERSION,
        "execution_count": count,
        "stall": None if stall is None else {"reason": stall.reason, "ranks": sorted(busy)},
        "ranks": ranks,
    }


def _shown(out) -> dict:
    """A display or value as its text, and the names of its MIME types."""
    return {"text": str(out.data.get("text/plain", "")), "mime": sorted(out.data)}


def show_ranks_data(data: dict) -> None:
    """A cell's ``ranks_data``, as one display output (empty text: nothing is seen)."""
    display({RANKS_DATA_MIME: data, "text/plain": ""}, raw=True)

