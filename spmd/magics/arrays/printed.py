"""In the notebook: ``print(x)`` and ``display(x)`` of an array over several processes, shown
as one process of all the devices prints it.

Each rank marks the placeholder where it printed or displayed one (engine/arrays/print_marks.py) and sends,
with its reply, what it holds of the array's printed form. Here, before a cell's outputs are
grouped, each marked placeholder becomes the array's text, put together from every rank's parts
as a cell's value is (magics/arrays/values.py): numpy's ``str`` form for ``print(x)``, ``str(x)`` and
f-strings, jax's ``Array(...)`` for ``repr`` and ``display``; a DTensor, the whole tensor as
torch prints it. The parts are matched by the print's mark (its place in the cell), never by
the order each rank printed in. An array on some processes' devices only, which they print
whole, is shown as they printed it (each sent its text under the same mark), with one line
that names them. Where they cannot be put together (a rank did not send its
part: another branch, it died, or the cell printed more arrays than a rank sends; the ranks
printed different arrays at that place), the placeholder stays, and one line says why.
"""

from __future__ import annotations

import collections
import re

import numpy as np

from spmd.cluster.session import PRINTED, unmarked
from spmd.magics.arrays import values
from spmd.words import process_words


def rebuild(ran) -> str:
    """Replace the marked placeholders in each rank's streams (in place, before the outputs
    are grouped); a line for the ones that stay placeholders ('' when none).

    A placeholder is put together from the parts every rank sent under the same mark: the
    same place in the cell and the same count of prints there (engine/arrays/print_marks.py), never by
    the order the ranks printed in. The parts must be of one array (shape, dtype, sharding,
    printed form) and fit together without a hole or an overlap; else the placeholder stays."""
    marked = [(rank, out) for rank, cell in ran.cells.items() for out in cell.outputs
              if "\x00" in (out.text if out.kind in ("stdout", "stderr")
                             else (out.data or {}).get("text/plain", ""))]
    ranks = list(ran.cells)
    every = [ran.printed.get(rank) or {} for rank in ranks]
    left_out = max((got.get("left_out", 0) for got in every), default=0)
    if not marked and not left_out:
        return ""
    texts, kept = {}, {}  # (placeholders left, by rank: why -> how many)
    held = {}  # the arrays shown that live on some processes only: their holders, by mark

    def parts_of(got: dict, mark: str) -> dict | None:
        index = got.get("marks", {}).get(mark)
        return None if index is None else got.get("parts", {}).get(str(index))

    def text_of(mark: str, form: str, placeholder: str) -> tuple[str | None, str]:
        if (mark, form) not in texts:
            parts = [parts_of(got, mark) for got in every]
            texts[mark, form] = None, MISSING
            sent = [p for p in parts if p]
            if any("own" in p for p in sent):  # (its holders print it: their text)
                texts[mark, form] = held_text(parts, ranks, form)
                if texts[mark, form][0] is not None:
                    held[mark] = tuple(sent[0]["holders"])
                return texts[mark, form]
            holders = {tuple(p.get("holders", ())) for p in sent}
            if sent and not all(parts) and len(holders) == 1 and not any(
                    p["pieces"] for p in sent):  # (one that some processes hold whole)
                who = next(iter(holders))
                where = ", ".join(str(h) for h in who)
                texts[mark, form] = (f"{placeholder} (it lives on the devices of process "
                                     f"{where} only, which prints it)" if len(who) == 1 else
                                     f"{placeholder} (it lives on the devices of processes "
                                     f"{where} only)"), ""
            elif all(parts) and len({_identity(p) for p in parts}) != 1:
                texts[mark, form] = None, DIFFERENT
            elif all(parts) and form != "f":
                try:
                    texts[mark, form] = (values.text(parts) if form == "r"
                                         else str_text(parts)), ""
                    holders = tuple(parts[0].get("holders") or ())
                    if holders and len(holders) < len(ranks):
                        held[mark] = holders
                except values.Overlap:
                    texts[mark, form] = None, DIFFERENT
                except values.Incomplete:  # (a hole: --ranks, or a rank that held nothing)
                    pass
        return texts[mark, form]

    def replace(rank: int, found: re.Match) -> str:
        shown, why = text_of(found.group(2), found.group(3), found.group(1))
        if shown is None:
            kept.setdefault(rank, {}).setdefault(why, 0)
            kept[rank][why] += 1
        return shown if shown is not None else found.group(1)

    for rank, out in marked:
        def rebuilt(text: str, rank=rank) -> str:
            return unmarked(PRINTED.sub(lambda found: replace(rank, found), text))

        if out.kind in ("stdout", "stderr"):
            out.text = rebuilt(out.text)
        else:  # (a display: its text/plain)
            out.data = {**out.data, "text/plain": rebuilt(out.data["text/plain"])}
    lines = [about_held(holders, n) for holders, n in
             collections.Counter(held.values()).items()]
    whys = [why for per_rank in kept.values() for why in per_rank]
    counted = {why: max(per.get(why, 0) for per in kept.values()) for why in whys}
    if left_out:
        counted[f"the cell printed more than {values_cap()} such arrays, or more than "
                f"{marks_cap():,} prints of them"] = left_out
    for why, n in counted.items():
        lines.append(f"({n} printed array{'s' if n != 1 else ''} over several processes "
                     f"stayed jax's placeholder: {why}.)")
    return "\n".join(lines)


def held_text(parts: list[dict | None], ranks: list[int], form: str) -> tuple[str | None, str]:
    """The text of an array some processes hold whole, as they printed it, for the ranks that
    printed jax's placeholder (None and why where it cannot be told: a rank sent nothing at
    that place, or the ranks' entries are not of one array printed one way)."""
    if not all(parts):
        return None, MISSING
    owns = {rank: p for rank, p in zip(ranks, parts) if "own" in p}
    same = {(tuple(p["shape"]), p["dtype"], p["sharding"], tuple(p.get("holders") or ()))
            for p in parts}
    holders = next(iter(same))[3] if len(same) == 1 else ()
    if (len(same) != 1 or sorted(owns) != list(holders) or len(owns) == len(parts)
            or len({p["own"] for p in owns.values()}) != 1
            or {p["form"] for p in owns.values()} != {form.upper()}):
        return None, DIFFERENT
    return next(iter(owns.values()))["own"], ""


def about_held(holders: tuple, n: int) -> str:
    """One line: arrays printed in the cell (``n`` prints) live on ``holders``' devices only."""
    who = process_words(holders)
    if n == 1:
        return (f"(The array printed here lives on the devices of {who} only; the other "
                "ranks hold none of it.)")
    return (f"(The arrays printed here live on the devices of {who} only; the other ranks "
            "hold none of them.)")


# Why a printed array stays a placeholder.
MISSING = ("a rank did not send its part of it (it did not print it at that place in the "
           "cell, or it ended)")
DIFFERENT = ("the ranks printed different arrays at that place in the cell (each rank's "
             "print(x) is put together only with the same print of every other rank)")


def _identity(part: dict) -> tuple:
    """What must be the same in every rank's part of one array."""
    return (tuple(part["shape"]), part["dtype"], part["sharding"], tuple(part["compact"]),
            part["summarized"], repr(sorted(part["options"].items())), part.get("library"))


def marks_cap() -> int:
    from spmd.engine.arrays.print_marks import MAX_MARKS

    return MAX_MARKS


def values_cap() -> int:
    from spmd.engine.arrays.print_marks import MAX_ARRAYS

    return MAX_ARRAYS


def str_text(parts: list[dict]) -> str:
    """The array as ``print`` shows it in one process (numpy's ``str`` of its value), from the
    ranks' parts. Raises values.Incomplete."""
    first = parts[0]
    if first.get("library") == "torch":
        return values.text(parts)  # (a DTensor prints as its repr either way)
    compact = values.compact_of(parts)
    options = dict(first["options"])
    if first["summarized"]:
        options["threshold"] = 0  # (the gaps stand for what numpy leaves out)
    with np.printoptions(**options):
        return np.array2string(compact, separator=" ", prefix="",
                               max_line_width=options["linewidth"])
