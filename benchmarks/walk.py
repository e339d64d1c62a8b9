"""A cell's walk through the code: which of the project's modules one ``%%spmd`` cell runs in
on the notebook's side, from the magic to the ranks and back, and where the walk goes back
and forth between two of them.

It is not a timing: ``python -m benchmarks.walk`` prints the modules in the order the cell
first enters them, from the ``%%spmd`` magic's call to its return (IPython's own input steps
before it are the notebook's, whatever the cell; a module counts where code written in its
file runs), the calls between modules, and the pairs of modules that call each other
(a callback climbing back up, or two modules handing a cell between them). The cell is one
a student writes: a print, and a value.

Only the main thread is traced: the magic, the wait and the report run there (ipyparallel's
threads only hand over messages).
"""

from __future__ import annotations

import sys
from collections import Counter

from benchmarks.bench import Bench

CELL = "x = jax.process_index() + 1\nprint(x)\nx"


def _module(frame) -> str | None:
    """The project's module whose code the frame runs (None for a library's, and for code
    that no file holds: a dataclass's generated ``__init__`` runs in its module's namespace,
    but no one reads it there)."""
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("spmd.") or frame.f_code.co_filename != frame.f_globals.get("__file__"):
        return None
    return name


def walk(run_cell, cell: str = CELL) -> dict:
    """Trace ``cell`` run as ``%%spmd`` by ``run_cell`` (a notebook's: Bench.cell): {'modules':
    [...], 'calls': Counter, 'both_ways': [(a, b), ...]} for the project's modules (spmd.*)
    the main thread ran in."""
    modules: list[str] = []
    calls: Counter = Counter()
    magic = None  # the %%spmd magic's frame, while it runs: the walk is what runs inside it

    def profile(frame, event, arg) -> None:
        nonlocal magic
        if magic is None:
            if event == "call" and frame.f_code.co_name == "spmd" and \
                    _module(frame) == "spmd.magics.magics":
                magic = frame
            else:
                return
        if event == "return" and frame is magic:
            magic = None
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        if callee not in modules:
            modules.append(callee)
        caller = frame.f_back
        while caller is not None and _module(caller) is None:
            caller = caller.f_back  # (through the libraries between: a callback is a call)
        if caller is not None and _module(caller) != callee:
            calls[_module(caller), callee] += 1

    sys.setprofile(profile)
    try:
        run_cell(f"%%spmd\n{cell}")
    finally:
        sys.setprofile(None)
    both = sorted({tuple(sorted(pair)) for pair in calls if pair[::-1] in calls})
    return {"modules": modules, "calls": calls, "both_ways": both}


def main() -> None:
    bench = Bench()
    bench.cell("%spmd start -n 2")
    try:
        bench.cell("%%spmd\nimport jax\nprint(jax.process_index())")  # (imports and first-time paths out of the walk)
        seen = walk(bench.cell)
    finally:
        bench.cell("%spmd stop")
    print(f"{len(seen['modules'])} modules, in the order the cell enters them:")
    for name in seen["modules"]:
        print(f"  {name}")
    print(f"{len(seen['calls'])} calls between modules (caller -> callee: times):")
    for (a, b), times in sorted(seen["calls"].items()):
        print(f"  {a} -> {b}: {times}")
    print(f"{len(seen['both_ways'])} pairs that call each other:")
    for a, b in seen["both_ways"]:
        print(f"  {a} <-> {b}")


if __name__ == "__main__":
    main()
