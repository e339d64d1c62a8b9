"""``%spmd sharding``, ``%spmd gather`` and ``%spmd push``: distributed arrays in the notebook.

Each asks every rank for its own part through ipyparallel's ``apply`` (signed messages) and
puts the parts together here. No collective runs, so they work while the ranks are out of step
(after a divergence report, before the restart); ranks still running a cell are skipped.
"""

from __future__ import annotations

import ast
import re
import time

import numpy as np
from IPython.core.error import UsageError

from spmd import picture
from spmd.cluster.session import Session
from spmd.engine.arrays import shards
from spmd.magics.arrays.values import numpy_dtype
from spmd.words import process_words, rank_words, uncoloured

ANSWER_SECONDS = 30.0
DEFAULT_MAX_BYTES = 256 * 2**20


def ask(session: Session, fn, *args) -> dict[int, object]:
    """``fn(*args)`` on every rank; their answers by rank.

    Raises UsageError when a rank still runs a cell (it could not answer), or naming the
    ranks that raised, grouped by what they raised.
    """
    busy = set(session.busy_ranks())
    targets = range(session.settings.n)
    if busy:
        raise UsageError(
            f"{rank_words(sorted(busy)).capitalize()} still {'runs' if len(busy) == 1 else 'run'} "
            "a cell and cannot answer: %spmd restart first."
        )
    client = session.record().client
    pending = {r: client[session.ranks[r].engine_id].apply_async(fn, *args) for r in targets}
    deadline = time.monotonic() + ANSWER_SECONDS
    for rank, ar in pending.items():
        if not ar.wait(max(0.0, deadline - time.monotonic())):
            raise UsageError(
                f"Rank {rank} did not answer within {ANSWER_SECONDS:g} s: "
                "%spmd where shows what it is doing."
            )
    answers, failures = {}, {}
    for rank, ar in pending.items():
        try:
            answers[rank] = ar.get()
        except Exception as exc:  # a RemoteError carries the rank's exception
            failures[rank] = (
                getattr(exc, "ename", type(exc).__name__),
                getattr(exc, "evalue", str(exc)),
            )
    if failures:
        raise _failure(failures, args[0] if args else "")
    return answers


def _failure(failures: dict[int, tuple[str, str]], expr: str) -> UsageError:
    by_error: dict[tuple[str, str], list[int]] = {}
    for rank, error in sorted(failures.items()):
        by_error.setdefault(error, []).append(rank)
    (ename, evalue), ranks = next(iter(by_error.items()))
    where = f"on {rank_words(ranks)}"
    if ename == "NameError":
        return UsageError(
            f"{expr} is not defined {where}: run the cell that defines it on every rank first."
        )
    if ename == "NotAnArray":
        return UsageError(
            f"{evalue} ({where}): %spmd sharding draws jax.Arrays and torch tensors; "
            f"%spmd gather {expr} fetches any value, by rank."
        )
    if ename == "PartialValues":
        return UsageError(f"{evalue}.")
    if ename == "KeyError" and "no longer on this rank" in evalue:
        return UsageError(f"{evalue.strip(chr(39))}: run its cell again.")
    if ename == "TooLarge":
        return UsageError(f"{evalue}: gather a slice, like {expr}[:100], or raise --max-bytes.")
    return UsageError(f"{expr} failed {where}: {ename}: {evalue}")


def sharding_bundle(session: Session, expr: str) -> dict:
    """The picture of ``expr``'s layout, from every process's own shards."""
    layouts = ask(session, shards.describe, expr)
    if separate_arrays(layouts):
        return {"text/plain": _each_its_own(expr, layouts)}
    layout = picture.merge(list(layouts.values()))
    if not layout["shape"]:
        devices = len(layout["devices"])
        processes = len(set(layout["devices"].values()))
        raise UsageError(
            f"{expr} is a 0-d array (a scalar) on {devices} devices of {processes} processes: "
            f"there is no layout to draw; %spmd gather {expr} gives its value."
        )
    return picture.bundle(layout, expr)


def separate_arrays(layouts: dict[int, dict]) -> bool:
    """Whether the ranks hold arrays of their own (made on each process without a sharding
    across processes, like ``jnp.arange(3) + rank``), not pieces of one global array: the
    pieces of a global array agree on its shape, dtype and devices on every process."""
    return len({_global_identity(layout) for layout in layouts.values()}) > 1


def _global_identity(layout: dict) -> tuple:
    devices = tuple(sorted((int(d), p) for d, p in layout["devices"].items()))
    return tuple(layout["shape"]), layout["dtype"], devices


def _each_its_own(expr: str, layouts: dict[int, dict]) -> str:
    lines = [
        f"{expr}: each rank holds an array of its own, not a piece of one global array "
        "(it was made on each process without a sharding across processes):"
    ]
    for rank, layout in sorted(layouts.items()):
        shape = ",".join(str(n) for n in layout["shape"])
        kind = layout.get("platform", "cpu").upper()
        devices = ", ".join(f"{kind} {d}" for d in sorted(int(d) for d in layout["devices"]))
        lines.append(f"  rank {rank}: {layout['dtype']}[{shape}] on {devices}")
    lines.append(f"%spmd gather {expr} gives them as a list by rank.")
    return "\n".join(lines)


def gather(session: Session, expr: str, max_bytes: int = DEFAULT_MAX_BYTES):
    """The global value of ``expr``: numpy for a global jax.Array or DTensor; a list by rank
    (numpy) for arrays and tensors each process holds on its own, and for anything else."""
    return _put_together(expr, ask(session, shards.fetch, expr, max_bytes))


def gather_shown(session: Session, label: str, shown: dict[int, tuple[int, int]],
                 max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The global value of a cell's result that each rank keeps as its ``Out[count]``
    (``shown``: rank -> (count, the object's id); ``label``: its name here, ``Out[n]``)."""
    if not session.running or len(shown) < session.settings.n:
        raise UsageError(f"{label} is no longer on the ranks (the cluster stopped or restarted, "
                         "or not every rank ran its cell): run its cell again.")
    return _put_together(label, ask(session, shards.fetch_shown, label, shown, max_bytes))


def _put_together(expr: str, answers: dict[int, list]):
    parts = {rank: answer[0] for rank, answer in answers.items()}
    kinds = {p["kind"] for p in parts.values()}
    if kinds == {"value"}:
        return [parts[r]["value"] for r in sorted(parts)]
    if kinds != {"array"}:
        raise UsageError(
            f"{expr} is an array (jax or torch) on some ranks and not on others: "
            f"%spmd gather {expr} works when it is one kind on every rank."
        )
    if separate_arrays({rank: p["layout"] for rank, p in parts.items()}):
        return [_assemble(expr, parts[r]["layout"], {r: answers[r]}) for r in sorted(answers)]
    return _assemble(expr, picture.merge([p["layout"] for p in parts.values()]), answers)


def _assemble(expr: str, layout: dict, answers: dict[int, list]) -> np.ndarray:
    """One numpy array from the pieces the ranks of ``answers`` sent."""
    out = np.empty(layout["shape"], dtype=numpy_dtype(layout["dtype"]))
    covered = 0
    for answer in answers.values():
        for (starts, stops), data in zip(answer[0]["pieces"], answer[1:]):
            out[tuple(slice(a, b) for a, b in zip(starts, stops))] = data
            covered += int(np.prod([b - a for a, b in zip(starts, stops)]))
    # replica 0 of each block exists once: the pieces do not overlap, so counting suffices
    if covered != out.size:
        missing = picture.missing_devices(layout)
        raise UsageError(
            f"Part of {expr} lives on devices no rank reported ({missing}): "
            "its value cannot be put together."
        )
    return out


# jax's words when a process is asked for values it does not hold
_NOT_ADDRESSABLE = "spans non-addressable (non process local) devices"
_CELL_LINE = re.compile(r"^Cell In\[\d+\], line (\d+)")


def gather_hint(session: Session, cell: str, errors: list) -> str:
    """For jax's "Fetching value for `jax.Array` that spans non-addressable ... devices": one
    line with the notebook's way out, naming the array when the failing line names one."""
    errs = [(ranks, out) for ranks, out in errors if _NOT_ADDRESSABLE in out.evalue]
    if not errs:
        return ""
    names: list[str] = []
    lines = cell.splitlines()
    for text in errs[0][1].traceback:
        m = _CELL_LINE.match(uncoloured(text))
        if m and 0 < int(m.group(1)) <= len(lines):
            names = _names_in(lines[int(m.group(1)) - 1])
    return _ways_out(*_spanning(session, errs[0][0][0], names))


def _spanning(session: Session, rank: int, names: list[str]) -> list:
    """The first of ``names`` that is an array ``rank`` cannot print, as ``shards.spanning``
    says it there ("NAME" where none is, or the rank cannot tell)."""
    try:
        found = session.call(rank, shards.spanning, names, timeout=5.0) if names else []
    except Exception:  # only a hint: without it, the generic sentence
        found = []
    return found[0] if found else ["NAME", [], False]


def _ways_out(what: str, holders: list[int], whole: bool) -> str:
    ways = (f"end a cell with {what} to see its value here, or %spmd gather {what} puts it "
            f"together in the notebook as numpy (%spmd sharding {what} shows who holds what)")
    if whole:  # (a mesh of some processes' devices: they print it, the others hold none)
        who = process_words(holders)
        return (f"{what} lives on the devices of {who} only: the other ranks hold none of it "
                f"and cannot print it or turn it into numpy; {ways}.")
    return (f"The array lives on the devices of several processes, so no single process can "
            f"print it or turn it into numpy: {ways}.")


# What jax prints for an array no process holds whole (print(x), str(x), f"{x}")
_PLACEHOLDER = re.compile(r"Array\(shape=\([\d, ]*\), dtype=\w+(?:, weak_type=True)?\)")
PLACEHOLDER_BEGINS = "Array(shape=("  # (what a text holds before the pattern is worth trying)


def placeholder_hint(session: Session, cell: str, printed: list[tuple[int, str]]) -> str:
    """For a cell whose ranks printed jax's placeholder of a process-spanning array
    (``printed``: each rank's texts): one line with the ways to see its value ('' when none
    printed one). The names are looked up on a rank that printed one."""
    ranks = [rank for rank, text in printed if _PLACEHOLDER.search(text)]
    if not ranks:
        return ""
    return _ways_out(*_spanning(session, ranks[0], _names_in(cell)))


def _names_in(code: str) -> list[str]:
    """The names a line (or a cell) uses, in order."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return []
    return list(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))


def push(session: Session, names: list[str], namespace: dict) -> str:
    """Send notebook variables to every rank's namespace; a one-line summary."""
    missing = [n for n in names if n not in namespace]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not defined in the "
            "notebook: define it in a %%local cell first."
        )
    sent, failed = [], {}
    for name in names:
        try:
            ask(session, shards.receive, name, namespace[name])
        except UsageError:
            raise
        except Exception as exc:  # ipyparallel could not serialize it: it was not sent
            failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            sent.append(name)
    ranks = rank_words(range(session.settings.n))
    pushed = ", ".join(f"{n} ({type(namespace[n]).__name__})" for n in sent)
    if failed:
        name, why = next(iter(failed.items()))
        others = f" (nor {', '.join(list(failed)[1:])})" if len(failed) > 1 else ""
        done = f"Pushed {pushed} to {ranks}, but " if sent else ""
        raise UsageError(
            f"{done}{name} cannot be sent to the ranks{others} ({why}): push the data it holds "
            "instead, like a list or an array."
        )
    return f"Pushed {pushed} to {ranks}."
