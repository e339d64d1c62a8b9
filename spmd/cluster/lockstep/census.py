"""Why the ranks diverged: the first place where their cells' launches differ.

Every rank records the cross-process programs and collectives its cell launched
(spmd/engine/watch/census.py). Here the records of the ranks are compared, and the first launch
where they part is named in words a student can act on: the same program with other shapes,
other programs at the same place, or a rank that launched fewer; with the usual fix. The
watchdog asks the same of ranks still running past the grace (``launched_ahead``): a rank
that launched what a finished one never did has diverged; one whose launches begin the
finished one's is only behind.

Runs on the notebook's main thread; a record is the JSON the rank sent (``runs`` run-length
encoded: [program, argument types, times]).
"""

from __future__ import annotations

from spmd import wire
from spmd.cluster.channel import control
from spmd.engine.watch.census import TORCH_COLLECTIVES
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


def fetch(client, engine_ids: dict[int, int], requests: dict[int, str] | None = None,
          timeout: float = 1.0) -> dict[int, dict]:
    """{rank: its record of a cell (its last one, or the request ``requests[rank]``)}, for
    the ranks that answered and kept it."""
    return _records(_ask(client, engine_ids, requests, timeout))


def _records(replies: dict[int, dict | None]) -> dict[int, dict]:
    """{rank: its record}, of the ranks that answered with one."""
    return {rank: with_inside(reply["census"]) for rank, reply in replies.items()
            if reply is not None and reply.get("census") is not None}


def with_inside(record: dict) -> dict:
    """A running cell's record with the launch its rank is inside now (``inside``: called,
    not returned, as the first cross-process program of a job waits for every process) as
    one more launch: the rank is at it."""
    inside = record.get("inside")
    if not inside:
        return record
    program, signature = inside
    rec = {**record, "programs": list(record["programs"]),
           "signatures": list(record["signatures"]),
           "runs": [list(run) for run in record["runs"]], "count": record["count"] + 1}
    for table, item in ((rec["programs"], program), (rec["signatures"], signature)):
        if item not in table:
            table.append(item)
    p, a = rec["programs"].index(program), rec["signatures"].index(signature)
    if rec["runs"] and rec["runs"][-1][:2] == [p, a]:
        rec["runs"][-1][2] += 1
    else:
        rec["runs"].append([p, a, 1])
    return rec


def _ask(client, engine_ids: dict[int, int], requests: dict[int, str] | None,
         timeout: float) -> dict[int, dict | None]:
    """{rank: its census reply (None: no answer)}."""
    asked = {eid: {"request": (requests or {}).get(rank)} for rank, eid in engine_ids.items()}
    replies = control.request(client, list(asked), wire.CENSUS_REQUEST, {"request": None}, timeout,
                              contents=asked)
    return {rank: replies.get(engine_id) for rank, engine_id in engine_ids.items()}


def differ(digests: dict[int, list | None]) -> bool:
    """Whether the ranks' digests (None: launched nothing) say their launches differ."""
    return len({tuple(d) if d else None for d in digests.values()}) > 1


def label(program: list | tuple) -> str:
    kind, name, _ = program
    return name if kind == "torch" else f"{kind}({name})"


def _launch(program: list, args: list) -> str:
    shown = label(program)
    kind, _, where = program
    if kind == "torch" and where:
        shown += f" on a {where}"
    return " ".join([shown, *args]) if args else shown


def first_difference(records: dict[int, dict]) -> tuple[int, dict[int, tuple | None]] | None:
    """(position from 0, {rank: (program, args) there, None past its last}) of the first
    launch where the ranks differ; None where they launched the same."""
    cursors = {rank: [0, 0] for rank in records}
    position = 0
    while True:
        heads, left = {}, {}
        for rank, rec in records.items():
            run_index, used = cursors[rank]
            runs = rec["runs"]
            if run_index >= len(runs):
                heads[rank] = None
                continue
            program, args, times = runs[run_index]
            heads[rank] = (tuple(rec["programs"][program]), tuple(rec["signatures"][args]))
            left[rank] = times - used
        if len(set(heads.values())) > 1:
            return position, heads
        if not left:
            return None
        step = min(left.values())
        position += step
        for rank in left:
            cursors[rank][1] += step
            if cursors[rank][1] == records[rank]["runs"][cursors[rank][0]][2]:
                cursors[rank] = [cursors[rank][0] + 1, 0]


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


def ahead(busy: dict[int, dict], finished: dict[int, list | None],
          records: dict[int, dict]) -> list[int]:
    """The busy ranks that launched what a finished rank never did: past its last launch, or
    another program or shapes where it had one. Those cannot meet it (a cross-process launch
    completes only once every process made it); a busy rank whose launches so far begin a
    finished rank's is only behind. ``busy``: each busy rank's record so far (a rank that had
    not begun the cell, or did not answer, is left out); ``finished``: each finished rank's
    digest from its reply (None: it launched nothing); ``records``: finished ranks' whole
    records, where read (without one, only the counts are compared)."""
    found = []
    for rank, rec in sorted(busy.items()):
        for other, digest in finished.items():
            count = digest[0] if digest else 0
            if rec["count"] > count:
                found.append(rank)
                break
            theirs = records.get(other)
            if not rec["count"] or theirs is None or rec.get("dropped") or theirs.get("dropped"):
                continue
            parted = first_difference({rank: rec, other: theirs})
            if parted is not None and parted[1][rank] is not None:
                found.append(rank)
                break
    return found


def launched_ahead(client, engine_ids: dict[int, int], requests: dict[int, str],
                   busy: list[int], finished: dict[int, list | None],
                   records: dict[int, dict], timeout: float = 0.5) -> list[int]:
    """``ahead``, with the busy ranks' records read now from their control channels (a rank
    answers there while its cell runs) and the finished ranks' whole records read once into
    ``records`` when a count alone does not tell. A rank that does not answer in ``timeout``
    seconds gives no evidence: it is waited for, never taken for diverged."""
    replies = _ask(client, {r: engine_ids[r] for r in busy if r in requests}, requests, timeout)
    so_far = _records(replies)
    counts = [digest[0] for digest in finished.values() if digest]
    wanted = [r for r, digest in finished.items() if digest and r not in records]
    if wanted and any(0 < rec["count"] <= max(counts) for rec in so_far.values()):
        records.update(_records(_ask(client, {r: engine_ids[r] for r in wanted}, requests,
                                     timeout)))
    return ahead(so_far, finished, records)


def for_report(client, engine_ids: dict[int, int], stall,
               requests: dict[int, str]) -> list[str]:
    """The census section of a stall's report, read from the living ranks (half a second at
    most); never raises: the report, the interrupt and the out-of-step guard come first.
    Each rank is asked for this cell's record (``requests``: rank -> the cell's request id):
    a rank that had not begun the cell (a ^C or a death right after the send) has none, and
    its last cell's record must not read as this cell's programs."""
    dead = {d.rank for d in stall.deaths}
    finished = set(stall.finished)
    try:
        replies = _ask(client, {r: e for r, e in engine_ids.items()
                                if r not in dead and r in requests}, requests, timeout=0.5)
        records = _records(replies)
        # (a rank that answered without a record is still before the cell's first line; one
        # that finished has a record, unless the census was not installed there)
        before = sorted(r for r, reply in replies.items() if reply is not None
                        and reply.get("census") is None and r not in finished)
        return report_lines(records, finished, before, stall.deaths)
    except Exception as exc:
        return ["", f"(The census could not be read: {type(exc).__name__}: {exc}.)"]


def report_lines(records: dict[int, dict], finished: set[int] | None = None,
                 before: list[int] | None = None, deaths=()) -> list[str]:
    """The report's census section (nothing where the records agree or are too few, every
    rank had begun the cell, and no rank died inside a collective). ``before``: the ranks
    that had not begun it; ``deaths``: the stall's (watchdog.Death)."""
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
