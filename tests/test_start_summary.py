"""The line %spmd start prints on a fresh cluster of two real ranks: one summary of what
started (processes, devices, backend, seconds) once the progress line gives way, and the
ranks' devices as the session records them."""

from __future__ import annotations

import re

import pytest
from conftest import run

pytestmark = pytest.mark.timeout(120)


def test_start_prints_one_summary_line(fresh):
    out = run(fresh, "%spmd start -n 2 -d 2")
    assert out.error is None, out.stderr
    # (the progress line is rewritten in place while it starts, then gives way to this)
    assert re.fullmatch(
        r"Started 2 processes, 2 devices per process, 4 global devices \(jax\) in \d+\.\d+ s\. "
        r"Auto mode on: every cell now runs on all ranks[^\n]*\n",
        out.stdout,
    ), out.stdout
    session = fresh.magics_manager.registry["SpmdMagics"].session
    assert [r.rank for r in session.ranks] == [0, 1]
    assert all(r.local_devices == 2 and r.global_devices == 4 for r in session.ranks)
