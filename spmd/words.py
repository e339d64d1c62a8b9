"""Words both sides of the notebook say: the ranks written short ('ranks 0-3', '[rank 2]',
'processes 0-1') and what usually sends a signal that ended a process.

A floor below every layer, beside wire.py: the cluster's own messages (a start that timed out,
a restart on some ranks, a death's out-of-step sentence) and the magics' reports and outputs
use them alike; and a traceback's text without its colours. Plain functions of their arguments, on whichever thread calls them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_COLOURS = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # (a terminal's escape sequences: IPython's)


def uncoloured(text: str) -> str:
    """``text`` without the colour codes of a traceback or a prompt."""
    return _COLOURS.sub("", text)


def rank_set(ranks: Iterable[int]) -> str:
    """'0-3', '0,2', '0-2,5': ranks written the short way."""
    ranks = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def rank_words(ranks: Iterable[int]) -> str:
    """'rank 2' or 'ranks 0-3', for sentences."""
    return rank_label(ranks)[1:-1]


def process_words(ranks: Iterable[int]) -> str:
    """'process 0' or 'processes 0-1', for sentences about whose devices hold an array (a
    rank is the process of that index)."""
    ranks = sorted(set(ranks))
    return f"process {ranks[0]}" if len(ranks) == 1 else f"processes {rank_set(ranks)}"


def rank_label(ranks: Iterable[int]) -> str:
    """'[rank 2]' or '[ranks 0-3]'."""
    ranks = sorted(set(ranks))
    return f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {rank_set(ranks)}]"


def with_hint(how: str) -> str:
    """``how`` ('killed by SIGKILL'), with what usually sends that signal."""
    return how + _SIGNAL_HINTS.get(how.removeprefix("killed by "), "")


_SIGNAL_HINTS = {
    "SIGKILL": " (sent by hand, or by the out-of-memory killer)",
    "SIGSEGV": " (a crash in C code)",
    "SIGABRT": " (it aborted: jax, XLA and torch's gloo do this on a fatal error, or when another "
                "rank died)",
    "SIGBUS": " (a crash in C code)",
}
