"""Where the ranks' cells' launches part: the ranks' census records, read and compared.

Every rank records the cross-process programs and collectives its cell launched
(spmd/engine/watch/launches.py). Here the notebook reads the ranks' records (``fetch``; a
stopped cell's, for its report, with ``read``) and compares them: the first launch where they
part (``first_difference``), and the busy ranks that launched what a finished one never did
(``ahead``). The cell runner's watchdog asks the same of ranks still running past the grace
(``launched_ahead``): a rank that launched what a finished one never did has diverged; one
whose launches begin the finished one's is only behind. The words a student reads about them
are the magics' (spmd/magics/cells/census_report.py).

Runs on the notebook's main thread; a record is the JSON the rank sent (``runs`` run-length
encoded: [program, argument types, times]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd import wire
from spmd.cluster.channel import control


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


@dataclass
class Reading:
    """What the living ranks said of a stopped cell's launches (``read``), for its report."""

    records: dict[int, dict] = field(default_factory=dict)  # rank -> its record of the cell
    # the ranks that answered without one: still before the cell's first line
    before: list[int] = field(default_factory=list)
    failed: str = ""  # why the census could not be read ("TimeoutError: ..."; '' when it was)


def read(client, engine_ids: dict[int, int], stall, requests: dict[int, str]) -> Reading:
    """The census records of a stall's cell, read from the living ranks (half a second at
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
        return Reading(records, before)
    except Exception as exc:
        return Reading(failed=f"{type(exc).__name__}: {exc}")
