"""What a cell leaves behind on two real ranks (``--backend none``) ends with it, however the
cell ends: its routes (where each rank's outputs go) after a timeout, a restart of ranks still
in it, or a rank's death; and the processes it started, with their own children, at a
restart."""

from __future__ import annotations

import time

import psutil
import pytest
from conftest import run, session, wait_until_gone

from spmd.magics.cells.render import RankErrors

pytestmark = pytest.mark.timeout(120)


def no_routes_within(routes: dict, seconds: float = 10.0) -> bool:
    """Whether the client's table of cell routes (written on its IO thread) is empty within
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while routes and time.monotonic() < deadline:
        time.sleep(0.05)
    return not routes


STUBBORN = (  # (a cell that ignores the interrupt: the notebook stops waiting, it runs on)
    "%%spmd --timeout 1\nimport time\nwhile True:\n    try:\n        time.sleep(100)\n"
    "    except KeyboardInterrupt:\n        pass"
)


@pytest.mark.timeout(180)
def test_a_cell_that_ends_early_leaves_no_routes_behind(fresh):
    """A cell's routes (where each rank's outputs go) end with the cell, however it ends:
    interrupted on a timeout, given up on with its ranks still in it and then restarted,
    a rank that died in it."""
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    routes = s.record().client.cells.routes
    out = run(fresh, "%%spmd --timeout 1\nimport time\ntime.sleep(100)")
    assert isinstance(out.error, RankErrors)
    assert no_routes_within(routes)
    assert run(fresh, "%spmd restart").error is None
    out = run(fresh, STUBBORN)
    assert isinstance(out.error, RankErrors)
    # (its ranks still run it: a later poll, %spmd status, hears them finish)
    assert s.gen.unfinished is not None and all(i in routes for i in s.gen.unfinished.requests.values())
    assert run(fresh, "%spmd restart").error is None
    assert no_routes_within(routes)
    out = run(fresh, "import os, time\nif os.environ['SPMD_RANK'] == '1':\n    os._exit(3)\n"
                     "time.sleep(100)")
    assert isinstance(out.error, RankErrors)
    assert no_routes_within(routes)
    assert run(fresh, "%spmd stop").error is None


def test_processes_a_cell_started_end_at_a_restart_with_their_own_children(fresh):
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    out = run(fresh, "import subprocess\n"
                     "child = subprocess.Popen(['bash', '-c', 'sleep 1000 & wait'])\n"
                     "print(child.pid)")
    assert out.error is None, out.stdout
    children = [psutil.Process(int(line.split()[-1])) for line in out.stdout.splitlines()]
    deadline = time.monotonic() + 10
    while not all(c.children() for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # (bash starts its sleep)
    started = children + [g for c in children for g in c.children()]
    assert len(started) == 4
    assert run(fresh, "%spmd restart").error is None
    assert not wait_until_gone(started)
    assert run(fresh, "%spmd stop").error is None
