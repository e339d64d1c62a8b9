"""A cell's walk through the notebook's side (benchmarks/walk.py): the modules one ``%%spmd``
cell runs in, from the magic to the ranks and back, stay few, and only the cell's observer
(the live view) is called back from the cluster."""

import pytest
from conftest import run

from benchmarks.walk import walk

pytestmark = pytest.mark.timeout(180)

# The modules a cell with a print and a value crosses: half of the 22 it crossed before the
# cluster had one face (issue 56; docs/development/layout.md).
MOST_MODULES = 11


def test_a_cell_crosses_few_modules_and_only_its_observer_is_called_back(fresh):
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    assert run(fresh, "%%spmd\nprint('warm')").error is None  # (first-time paths)

    def run_cell(code: str) -> None:
        out = run(fresh, code)
        assert out.error is None, out.error
        assert "[ranks 0-1] 2" in out.stdout and out.outputs == [{"text/plain": "2"}], out

    seen = walk(run_cell, "x = 1 + 1\nprint(x)\nx")
    modules = seen["modules"]
    assert len(modules) <= MOST_MODULES, "\n".join(modules)
    # Out through the face (session.py), back through the observer: the magics are entered
    # from the cluster only by the live view, and no part of the cluster calls the face back.
    assert "spmd.cluster.session" in modules
    up = {(a, b) for a, b in seen["calls"]
          if a.startswith("spmd.cluster") and b.startswith("spmd.magics")}
    assert up <= {(a, "spmd.magics.cells.render") for a, _ in up}, up
    assert not any(b == "spmd.cluster.session" for a, b in seen["calls"]
                   if a.startswith("spmd.cluster")), seen["calls"]
