"""On rank 0: completion and inspection from the rank's own namespace.

The SPMD kernel asks rank 0 (through ipyparallel's ``apply``), so that Tab completes and
Shift-Tab describes the names the cells defined on the ranks, which the notebook process
does not have. The rank's own IPython kernel answers, exactly as it would a front end.
"""

from __future__ import annotations


def _kernel():
    from IPython import get_ipython

    return get_ipython().kernel


def complete(code: str, cursor_pos: int) -> dict:
    """A ``complete_reply`` content, from this rank's namespace."""
    return _kernel().do_complete(code, cursor_pos)


def inspect(code: str, cursor_pos: int, detail_level: int = 0, omit_sections=()) -> dict:
    """An ``inspect_reply`` content, from this rank's namespace."""
    return _kernel().do_inspect(code, cursor_pos, detail_level, omit_sections)
