"""The census's words: where the ranks' launches parted, said so a student can act on it
(the same program with other shapes, other programs at the same place, or a rank that
launched fewer; with the usual fix), and each rank's launches listed.

The cluster reads and compares the ranks' records (spmd/cluster/lockstep/census.py; a stopped
cell's are on its ``Stall.census``); this module says what they show: a stopped cell's census
section (``census_section``), the warning after a cell whose ranks launched different programs
though nothing hung (``warning``), and ``%spmd census``'s listing (``listing``, ``explain``).

Main thread only: the cell's steps (cell.py) and ``%spmd census`` (commands/inspection.py)
call it. A record is the JSON the rank sent (``runs`` run-length encoded: [program, argument
types, times]).
"""

from __future__ import annotations

from spmd.cluster.records import Stall
from spmd.cluster.session import first_difference
from spmd.engine.watch.launches import TORCH_COLLECTIVES
from spmd.words import rank_words

HINTS = {
    "shapes": "Pad every process's input to a size agreed by every process (a constant, not "
              "each process's own longest).",
    "count": "Make every process run the same number of steps (the smallest share, or pad "
             "the short ones), and iterate in an order every process agrees on (sorted, "
             "never a set's).",
    "programs": "Every process must launch the same programs in the same order: a branch "
                "on the rank around a jitted call or a collective launches different ones.",
    "gloo": "gloo names neither side of a collective whose sizes differ: %spmd start "
            "--check-collectives (torch's own check) makes every rank raise instead, each "
            "naming its op and sizes.",
}


def label(program: list | tuple) -> str:
    kind, name, _ = program
    return name if kind == "torch" else f"{kind}({name})"


def _launch(program: list, args: list) -> str:
    shown = label(program)
    kind, _, where = program
    if kind == "torch" and where:
        shown += f" on a {where}"
    return " ".join([shown, *args]) if args else shown


def explain(records: dict[int, dict], waiting: bool = True,
            finished: set[int] | None = None) -> tuple[str, list[str]] | None:
    """(the kind of difference, its lines: what differs, then the hint), or None.
    ``waiting``: the ranks that launched more wait in it (a report), or went on (a cell that
    ended). ``finished``: the ranks done with the cell, where some were not (a timeout, an
    interrupt): a rank still running that launched fewer may only be behind, so a count
    difference is told only where the ranks that launched fewer had finished."""
    if len(records) < 2:
        return None
    found = first_difference(records)
    if found is None:
        return None
    position, heads = found
    nth = ordinal(position + 1)
    ended = sorted(r for r, h in heads.items() if h is None)
    if ended and finished is not None and not set(ended) <= finished:
        return None
    if ended:
        going = sorted(r for r, h in heads.items() if h is not None)
        counts = _grouped({r: records[r]["count"] for r in records})
        said = ", ".join(f"{rank_words(ranks)} launched {count}" for count, ranks in counts)
        launched = _grouped({r: _launch(*heads[r]) for r in going})
        at = ("is at its", "are at their") if waiting else ("went on to its", "went on to their")
        where = "; ".join(f"{rank_words(ranks)} {at[len(ranks) > 1]} {nth}, {what}"
                          for what, ranks in launched)
        return "count", [f"The ranks launched different numbers of cross-process programs: "
                         f"{said}. {rank_words(ended).capitalize()} had no {nth}; {where}.",
                         "Hint: " + HINTS["count"]]
    programs = {h[0] for h in heads.values()}
    if len(programs) == 1:
        program = next(iter(programs))
        shapes = _grouped({r: " ".join(h[1]) or "(no arrays)" for r, h in heads.items()})
        said = "; ".join(f"{rank_words(ranks)} {what}" for what, ranks in shapes)
        return "shapes", [f"The ranks' {nth} cross-process program, {_launch(program, [])}, "
                          f"had different shapes: {said}.", "Hint: " + HINTS["shapes"]]
    labels = {label(p) for p in programs}
    launches = _grouped({r: _launch(*h) + ("" if len(labels) == len(programs) or not h[0][2]
                                           else f" ({h[0][2]})") for r, h in heads.items()})
    said = "; ".join(f"{rank_words(ranks)} {what}" for what, ranks in launches)
    return "programs", [f"The ranks' {nth} cross-process programs differ: {said}.",
                        "Hint: " + HINTS["programs"]]


def census_section(stall: Stall) -> list[str]:
    """The census section of a stall's report (``stall.census``: what the living ranks said
    of the cell's launches; nothing where it was not read); never raises: the report comes
    first."""
    reading = stall.census
    if reading is None:
        return []
    failed = reading.failed
    if not failed:
        try:
            return report_lines(reading.records, set(stall.finished), reading.before,
                                stall.deaths)
        except Exception as exc:
            failed = f"{type(exc).__name__}: {exc}"
    return ["", f"(The census could not be read: {failed}.)"]


def report_lines(records: dict[int, dict], finished: set[int] | None = None,
                 before: list[int] | None = None, deaths=()) -> list[str]:
    """The report's census section (nothing where the records agree or are too few, every
    rank had begun the cell, and no rank died inside a collective). ``before``: the ranks
    that had not begun it; ``deaths``: the stall's (records.Death)."""
    said = explain(records, finished=finished)
    lines = [] if said is None else said[1]
    if before:
        lines = [f"{rank_words(before).capitalize()} had not begun the cell (still before its "
                 "first line): its launches are not compared.", *lines]
    lines += after_deaths(records, deaths)
    return [] if not lines else ["", "Census of the cell's cross-process programs:",
                                 *["  " + line for line in lines]]


def after_deaths(records: dict[int, dict], deaths) -> list[str]:
    """A rank that died inside a collective took its record with it (gloo aborts a rank
    whose peer sent another size): the survivors' last launches are their side of it, and
    gloo's own line ("collective mismatch?") gets the hint that names both sides."""
    inside = {d.rank: op for d in deaths if (op := died_inside(d)) is not None}
    lines = []
    if inside:
        last = {}
        for rank, rec in records.items():
            runs = rec["runs"]
            if rec["count"] and runs and not rec.get("dropped"):
                program, args, _ = runs[-1]
                shown = rec["programs"][program]
                what = "collective" if shown[0] == "torch" else "cross-process program"
                last[rank] = (f"{ordinal(rec['count'])} {what}: "
                              f"{_launch(shown, rec['signatures'][args])}")
        died = "; ".join(f"{rank_words(ranks)} died inside {op}"
                         for op, ranks in _grouped(inside))
        said = [f"{rank_words(ranks)}'s {what}" for what, ranks in _grouped(last)]
        line = "; ".join([*said, f"{died} (a rank's census dies with it)."])
        lines.append(line[0].upper() + line[1:])
    if any("collective mismatch" in ln.lower() for d in deaths for ln in d.last_lines):
        lines.append("Hint: " + HINTS["gloo"])
    return lines


def died_inside(death) -> str | None:
    """The torch collective a dead rank's crash stack is inside (None: none, or no stack)."""
    frames = death.crash.frames if death.crash is not None else []
    for f in reversed(frames):
        if f.function in TORCH_COLLECTIVES and "torch/distributed" in f.file.replace("\\", "/"):
            return f.function
    return None


def warning(records: dict[int, dict], raised: bool = False) -> str | None:
    """One line after a cell that ended (nothing hung) though its ranks launched different
    programs (``raised``: some ranks raised, below)."""
    said = explain(records, waiting=False)
    if said is None:
        return None
    first = said[1][0]
    if raised:
        return (f"Warning: {first[0].lower()}{first[1:]} The likely cause of the errors "
                "below. (%spmd census lists each rank's launches.)")
    return (f"Warning: {first[0].lower()}{first[1:]} Nothing hung, but the results may be wrong. "
            "(%spmd census lists each rank's launches.)")


def listing(records: dict[int, dict]) -> list[str]:
    """Each group of ranks' launches, in order, one line per run (``%spmd census``)."""
    groups = _grouped({r: repr((rec["programs"], rec["signatures"], rec["runs"]))
                       for r, rec in records.items()})
    lines = []
    for _, ranks in groups:
        rec = records[ranks[0]]
        total = rec["count"]
        lines.append(f"{rank_words(ranks).capitalize()}: {total} cross-process "
                     f"launch{'es' if total != 1 else ''}")
        at = 1
        for program, args, times in rec["runs"]:
            span = f"{at}" if times == 1 else f"{at}-{at + times - 1}"
            shown = rec["programs"][program]
            where = f" ({shown[2]})" if shown[2] and shown[0] != "torch" else ""
            lines.append(f"  {span:>9}  {_launch(shown, rec['signatures'][args])}{where}")
            at += times
        dropped = rec.get("dropped")
        if dropped:
            lines.append(f"  ... and {dropped:,} more launch{'es' if dropped != 1 else ''}, "
                         "counted only")
    return lines


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _grouped(by_rank: dict[int, object]) -> list[tuple[object, list[int]]]:
    """[(value, the ranks with it)], lowest rank first."""
    groups: dict[object, list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    return list(groups.items())
