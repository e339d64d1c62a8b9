"""Standby engines: a second set of real engines behind the ranks, promoted by %spmd restart
after a plain restart, a divergence and a death; the compilation cache the ranks share across
restarts; and --standby off."""

from __future__ import annotations

import os
import time

import psutil
import pytest
from conftest import report, run, session, spmd_processes, standbys_ready
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(180)

SETUP = (
    "import os, time, jax, jax.numpy as jnp\n"
    "rank = jax.process_index()\n"
    "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
)
PSUM = "print(psum(jnp.ones(jax.local_device_count())))"


def restart_from_standbys(shell) -> None:
    """%spmd restart promotes the ready standbys: the ranks are their processes, the
    controller is the same, the old ranks are gone, new standbys start, and a psum works."""
    standby_pids = [r.pid for r in standbys_ready(shell)]
    old = [r.pid for r in session(shell).ranks]
    controller = session(shell).cluster.controller.process.pid
    out = run(shell, "%spmd restart")
    assert out.error is None, out.stderr
    assert "from the standby engines" in out.stdout, out.stdout
    assert [r.pid for r in session(shell).ranks] == standby_pids
    assert session(shell).cluster.controller.process.pid == controller
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in old if psutil.pid_exists(p)], 5)
    assert not alive, f"old ranks still running: {alive}"
    assert run(shell, SETUP).error is None
    assert run(shell, PSUM).stdout == "[ranks 0-1] [2.]\n"
    assert {r.pid for r in standbys_ready(shell)}.isdisjoint(standby_pids + old)


def test_standby_restart_promotes_the_standbys(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    standbys_ready(fresh)
    status = run(fresh, "%spmd status").stdout
    assert "standby engines: 2 ready (for %spmd restart; pids " in status
    assert " MB in all" in status
    restart_from_standbys(fresh)
    restart_from_standbys(fresh)  # twice: the second set of standbys works as well


def test_standby_restart_after_a_divergence_ends_the_blocked_rank(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    out = run(fresh, "if rank == 0:\n    raise ValueError('diverge')\n" + PSUM)
    assert "The ranks diverged" in report(out)
    restart_from_standbys(fresh)


def test_standby_restart_after_a_death(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    out = run(fresh, "if rank == 1:\n    os.kill(os.getpid(), 9)\n" + PSUM)
    text = report(out)
    assert text.startswith("Rank 1 died: killed by SIGKILL"), text
    # the ranks were ended; the controller and the standbys were kept for the restart
    assert all(r.state in ("died", "stopped") for r in session(fresh).ranks)
    refused = run(fresh, PSUM)
    assert "rank 1 died" in str(refused.error)
    standbys_ready(fresh)
    status = run(fresh, "%spmd status").stdout
    assert "cluster stopped" in status and "standby engines: 2 ready" in status
    restart_from_standbys(fresh)


def test_standby_off_restarts_afresh(fresh):
    assert run(fresh, "%spmd start -n 2 --standby off").error is None
    time.sleep(1)
    assert session(fresh).standbys() == []
    assert "standby engines: off (--standby off)" in run(fresh, "%spmd status").stdout
    controller = session(fresh).cluster.controller.process.pid
    out = run(fresh, "%spmd restart")
    assert out.error is None and "from the standby engines" not in out.stdout
    assert session(fresh).cluster.controller.process.pid != controller
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"


JITTED = (
    "@jax.jit\n"
    "def steps(x):\n"
    "    for i in range(20):\n"
    "        x = jnp.tanh(x @ x.T + i)\n"
    "    return x\n"
    "print(float(steps(jnp.ones((8, 8))).sum()))"
)


def test_standby_compilation_cache_is_kept_across_restarts_and_emptied_at_stop(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    folder = run(fresh, "print(jax.config.jax_compilation_cache_dir)").stdout.split()[-1]
    assert os.path.isdir(folder)
    first = run(fresh, JITTED)
    assert first.error is None
    cached = {n for n in os.listdir(folder) if n.startswith("jit_steps")}
    assert len(cached) == 2, os.listdir(folder)  # one per rank: each writes its own
    for how in ("%spmd restart", "%spmd restart"):  # from standbys, then again
        assert run(fresh, how).error is None
        assert run(fresh, SETUP).error is None
        assert run(fresh, "print(jax.config.jax_compilation_cache_dir)").stdout.split()[-1] == folder
        again = run(fresh, JITTED)
        assert again.stdout == first.stdout
    # the same function was not compiled again: no new entry for it
    assert {n for n in os.listdir(folder) if n.startswith("jit_steps")} == cached
    run(fresh, "%spmd stop")
    assert not os.path.exists(folder)


def test_standby_a_named_compilation_cache_outlives_stop(fresh, tmp_path):
    folder = tmp_path / "jax-cache"
    out = run(fresh, f"%spmd start -n 2 --compilation-cache {folder}")
    assert out.error is None, out.stderr
    assert run(fresh, SETUP + "\n" + JITTED).error is None
    run(fresh, "%spmd stop")
    assert any(n.startswith("jit_steps") for n in os.listdir(folder))


@pytest.mark.parametrize(
    "line, says",
    [
        (
            "%spmd start -n 2 --standby on --launcher mpi",
            "standby engines need the local or ssh launcher (mpi starts all ranks as one job)",
        ),
        ("%spmd start -n 2 --standby maybe", "invalid choice: 'maybe'"),
        ("%spmd start -n 2 --compilation-cache /dev/null/cache", "--compilation-cache "
         "/dev/null/cache cannot be used"),
    ],
)
def test_standby_bad_options_are_refused_before_anything_starts(fresh, line, says):
    out = run(fresh, line)
    assert isinstance(out.error, UsageError), out.error
    assert says in str(out.error)
    assert not spmd_processes()
