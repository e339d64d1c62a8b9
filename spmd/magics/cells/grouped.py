"""Rows of many ranks, grouped: one line per kind of rank, never one per rank.

Beyond ``MANY`` ranks, ``%spmd status`` and the live panel show one row per group of ranks
alike (the same state; for the status, the same devices): which ranks (``0-63,65``), on
which hosts, and the spread of their figures (seconds, memory), as the divergence and death
reports group ranks by stack. At 256 ranks a row per rank is a page to scroll, and the one
rank that differs is lost in it. ``%spmd status all`` lists every rank.

Threads: the notebook's main thread (plain functions of rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from spmd.words import rank_set

MANY = 16  # ranks shown one row each up to this many


def groups(rows: Iterable[dict], key: Callable[[dict], tuple]) -> list[list[dict]]:
    """``rows`` (each with a ``rank``) grouped by ``key``, in the order of each group's
    lowest rank."""
    found: dict[tuple, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["rank"]):
        found.setdefault(key(row), []).append(row)
    return list(found.values())


def ranks(group: list[dict]) -> str:
    return rank_set(r["rank"] for r in group)


def hosts(group: list[dict]) -> str:
    """The one host, or how many."""
    names = sorted({r["host"] for r in group})
    return names[0] if len(names) == 1 else f"{len(names)} hosts"


def spread(values: Iterable[float | None], show: Callable[[float], str]) -> str:
    """``0.12-0.30 s``: the least and the most of the known values; ``-`` if none."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = show(min(known)), show(max(known))
    return low if low == high else f"{low.split(' ')[0]}-{high}"
