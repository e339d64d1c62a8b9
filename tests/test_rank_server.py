"""The rank server: one process on this machine that imported the ranks' modules and forks
the ranks, at start and at every restart (after a plain restart, a divergence and a death);
its fallback to a Python per rank where it cannot be used (a restart then starts afresh);
the compilation cache the ranks share across restarts. (Rank servers over ssh: in
test_clusters.py.)"""

from __future__ import annotations

import math
import os
import sys
import time

import psutil
import pytest
from conftest import report, run, session, spmd_processes
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(180)

SETUP = (
    "import os, time, jax, jax.numpy as jnp\n"
    "rank = jax.process_index()\n"
    "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
)
PSUM = "print(psum(jnp.ones(jax.local_device_count())))"


def server_of(shell) -> psutil.Process:
    server = session(shell).record().rank_server
    assert server is not None, "no rank server"
    return psutil.Process(server.process.pid)


def forked_by_the_server(shell) -> None:
    """Every rank is a child of the rank server, in a process group of its own, and named
    after its rank; the server is a child of this notebook."""
    server = server_of(shell)
    assert server.ppid() == os.getpid()
    for row in session(shell).ranks:
        rank = psutil.Process(row.pid)
        assert rank.ppid() == server.pid, (row, rank.ppid(), server.pid)
        assert os.getpgid(row.pid) == row.pid  # (the notebook's ^C is not the ranks')
        assert rank.name() == f"spmd-rank{row.rank}"


def restart_forks(shell) -> None:
    """%spmd restart ends the old ranks and the same server forks new ones, which register
    with the same controller; a psum works."""
    old = [r.pid for r in session(shell).ranks]
    controller = session(shell).record().cluster.controller.process.pid
    server = server_of(shell).pid
    out = run(shell, "%spmd restart")
    assert out.error is None, out.stderr
    assert "forked by the rank server" in out.stdout, out.stdout
    assert session(shell).record().cluster.controller.process.pid == controller
    assert server_of(shell).pid == server
    assert not {r.pid for r in session(shell).ranks} & set(old)
    forked_by_the_server(shell)
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in old if psutil.pid_exists(p)], 5)
    assert not alive, f"old ranks still running: {alive}"
    assert run(shell, SETUP).error is None
    assert run(shell, PSUM).stdout == "[ranks 0-1] [2.]\n"


def test_the_rank_server_forks_the_ranks(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    forked_by_the_server(fresh)
    status = run(fresh, "%spmd status").stdout
    assert f"rank server: pid {server_of(fresh).pid} " in status, status
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    # a forked rank draws its own random numbers, as a fresh process would
    out = run(fresh, "import random, numpy as np\nprint(random.random(), np.random.rand())")
    assert out.error is None and "[rank 0]" in out.stdout and "[rank 1]" in out.stdout, out.stdout


def test_restart_forks_new_ranks(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    restart_forks(fresh)
    restart_forks(fresh)  # twice: the server forks as often as asked


def test_restart_after_a_divergence_ends_the_blocked_rank(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    out = run(fresh, "%%spmd --grace 0.5\nif rank == 0:\n    raise ValueError('diverge')\n"
              + PSUM)
    assert "The ranks diverged" in report(out)
    restart_forks(fresh)


def test_restart_after_a_death(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    out = run(fresh, "if rank == 1:\n    os.kill(os.getpid(), 9)\n" + PSUM)
    text = report(out)
    assert text.startswith("Rank 1 died: killed by SIGKILL"), text
    # the ranks were ended; the controller and the rank server were kept for the restart
    assert all(r.state in ("died", "stopped") for r in session(fresh).ranks)
    refused = run(fresh, PSUM)
    assert "rank 1 died" in str(refused.error)
    status = run(fresh, "%spmd status").stdout
    assert "cluster stopped" in status and "rank server: pid" in status, status
    restart_forks(fresh)


def test_a_rank_server_killed_ends_its_ranks_and_the_notebook_says_so(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    ranks = [psutil.Process(r.pid) for r in session(fresh).ranks]
    server_pid = server_of(fresh).pid
    server_of(fresh).kill()  # (the out-of-memory killer's choice, say)
    gone, alive = psutil.wait_procs(ranks, timeout=10)  # (they watch their parent)
    assert not alive, alive
    out = run(fresh, PSUM)
    assert f"its rank server (pid {server_pid}) ended: killed by SIGKILL (sent by hand, or by "\
        "the out-of-memory killer); every rank it forked ended with it" in str(out.error), out.error
    restarted = run(fresh, "%spmd restart")  # afresh: a new server
    assert restarted.error is None, restarted.stderr
    forked_by_the_server(fresh)
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"


def test_a_rank_server_that_ends_during_a_restart_is_one_sentence(fresh, monkeypatch):
    """The rank server ends once a restart is under way (after it said it was ready, before
    its fork): the restart is given up in one sentence that says nothing runs
    and what to do (before: ServerUnavailable's traceback), and the next restart starts
    afresh."""
    from spmd.cluster.launchers import servers

    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    server = server_of(fresh)
    fork = servers.RankServer.ask_fork

    def killed_first(self, *args, **kwargs):  # (it said it was ready; it ends now)
        if server.is_running():
            server.kill()
            server.wait(10)
        return fork(self, *args, **kwargs)

    monkeypatch.setattr(servers.RankServer, "ask_fork", killed_first)
    out = run(fresh, "%spmd restart")
    monkeypatch.undo()
    assert isinstance(out.error, UsageError), (out.error, out.stdout, out.stderr)
    assert "the restart was given up and no rank runs now; %spmd restart starts them " \
           "afresh." in str(out.error), out.error
    assert not session(fresh).running
    assert run(fresh, "%spmd restart").error is None  # (afresh: a new server)
    assert run(fresh, "print('ok')").stdout == "[ranks 0-1] ok\n"


DRAW = ("import random, numpy, torch\n"
        "print(torch.rand(3).tolist(), numpy.random.rand(), random.random())")


def draws(shell) -> list[str]:
    """What each rank drew (torch, numpy's global state, random), one line a rank."""
    out = run(shell, DRAW)
    assert out.error is None, report(out)
    lines = [line.split("] ", 1)[1] for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 2, out.stdout  # (one a rank: a line for all would be "[ranks 0-1]")
    return lines


def test_forked_ranks_draw_their_own_random_numbers_at_start_and_after_restart(fresh):
    """torch seeds its CPU generator when it is imported, and the rank server imported it
    before it forked: every rank drew the same torch.rand, and every restart drew them again
    (before). Each rank's generators now start fresh, and differ after a restart too."""
    pytest.importorskip("torch")
    assert run(fresh, "%spmd start -n 2 --backend torch").error is None
    first = draws(fresh)
    assert first[0] != first[1], first
    torch_draws = [line.split("]", 1)[0] for line in first]
    assert torch_draws[0] != torch_draws[1], first  # (torch alone, not just numpy's)
    out = run(fresh, "%spmd restart")
    assert "forked by the rank server" in out.stdout, out.stdout + out.stderr
    again = draws(fresh)
    assert again[0] != again[1], again
    assert not set(again) & set(first), (first, again)
    # jax's keys are not state: the same key draws the same numbers on every rank
    out = run(fresh, "import jax\nprint(jax.random.uniform(jax.random.key(0), (2,)))")
    assert out.stdout.startswith("[ranks 0-1] "), out.stdout


def test_a_restart_after_the_notebook_set_a_jax_variable_starts_afresh(fresh):
    """jax reads JAX_* once, at import, and the rank server imported it at the start: after
    the notebook sets JAX_ENABLE_X64, a restart starts the ranks afresh, with a new server,
    and says why (before: forked ranks computed in float32, and nothing said why). With
    nothing changed, the next restart forks again."""
    assert run(fresh, "%spmd start -n 2").error is None
    before = server_of(fresh).pid
    try:
        assert run(fresh, "%%local\n%env JAX_ENABLE_X64=1").error is None
        out = run(fresh, "%spmd restart")
        assert out.error is None, out.stderr
        assert "The ranks start afresh, with a new rank server: JAX_ENABLE_X64 changed since " \
               "the rank server imported jax, which reads it only then." in out.stdout, out.stdout
        assert server_of(fresh).pid != before
        out = run(fresh, "import jax.numpy as jnp\nprint(jnp.ones(1).dtype)")
        assert out.stdout == "[ranks 0-1] float64\n", out.stdout + out.stderr
        out = run(fresh, "%spmd restart")
        assert "forked by the rank server" in out.stdout and "afresh" not in out.stdout
    finally:
        os.environ.pop("JAX_ENABLE_X64", None)


def test_a_jax_variable_set_on_the_ranks_is_told_once_and_kept_by_the_restart(fresh):
    """``%env JAX_ENABLE_X64=1`` in auto mode runs on the ranks, where jax read it at import
    already: the cell says so, once, and the next restart starts the ranks with it (before:
    still float32 after the restart, and nothing said why)."""
    assert run(fresh, "%spmd start -n 2").error is None
    try:
        out = run(fresh, "%env JAX_ENABLE_X64=1")
        said = out.stdout + out.stderr
        assert out.error is None, said
        assert ("[ranks 0-1] JAX_ENABLE_X64 changes nothing in ranks that imported jax "
                "already (jax and XLA read them once, at import): %spmd restart starts the "
                "ranks with them.") in said, said
        out = run(fresh, "import jax.numpy as jnp\nprint(jnp.ones(1).dtype)")
        assert out.stdout == "[ranks 0-1] float32\n", out.stdout + out.stderr  # (once)
        assert "JAX_ENABLE_X64" not in os.environ  # (the notebook's own: kept for the restart)
        out = run(fresh, "%spmd restart")
        assert out.error is None, out.stderr
        assert "JAX_ENABLE_X64 changed since the rank server imported jax" in out.stdout
        out = run(fresh, "import jax.numpy as jnp\nprint(jnp.ones(1).dtype)")
        assert out.stdout == "[ranks 0-1] float64\n", out.stdout + out.stderr
    finally:
        os.environ.pop("JAX_ENABLE_X64", None)


def test_a_jax_variable_set_on_some_ranks_only_is_not_kept_by_the_restart(fresh):
    """A restart starts every rank with one environment: a variable one rank set (``%%spmd
    --ranks 0``), or the ranks set to different values, is left as it was, in one sentence
    (before: the last rank's value went to every rank)."""
    assert run(fresh, "%spmd start -n 2").error is None
    try:
        assert run(fresh, "%%spmd --ranks 0\n%env JAX_ENABLE_X64=1").error is None
        assert run(fresh, "%env XLA_FLAGS=--xla_cpu_enable_fast_math=false").error is None
        out = run(fresh, "%spmd restart")
        assert out.error is None, out.stderr
        assert ("A cell changed JAX_ENABLE_X64 on rank 0 only: the restart starts every rank "
                "with one environment, so it leaves it as before (set it on every rank alike, "
                "or with %%local %env, to keep it).") in out.stdout, out.stdout
        assert "JAX_ENABLE_X64" not in os.environ
        assert os.environ.get("XLA_FLAGS") == "--xla_cpu_enable_fast_math=false"  # (alike)
        out = run(fresh, "import os, jax.numpy as jnp\nprint(jnp.ones(1).dtype, "
                         "os.environ.get('JAX_ENABLE_X64'))")
        assert out.stdout == "[ranks 0-1] float32 None\n", out.stdout + out.stderr
        assert run(fresh, "import os, jax\nos.environ['JAX_ENABLE_X64'] = str(jax.process_index())"
                   ).error is None
        out = run(fresh, "%spmd restart")
        assert ("A cell changed JAX_ENABLE_X64 to different values on different ranks: "
                ) in out.stdout, out.stdout
    finally:
        os.environ.pop("JAX_ENABLE_X64", None)
        os.environ.pop("XLA_FLAGS", None)


def test_a_restart_starts_the_ranks_in_the_notebooks_folder_now(fresh, tmp_path):
    """After the notebook changed its folder (%%local), the restarted ranks start there, as a
    fresh start's would (before: in the folder the rank server started in)."""
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    here = os.getcwd()
    try:
        assert run(fresh, f"%%local\nimport os\nos.chdir({str(tmp_path)!r})").error is None
        assert run(fresh, "%spmd restart").error is None
        out = run(fresh, "import os\nprint(os.getcwd())")
        assert out.stdout == f"[ranks 0-1] {tmp_path}\n", out.stdout + out.stderr
    finally:
        os.chdir(here)


def test_preload_imports_modules_once_for_every_rank(fresh, tmp_path, monkeypatch):
    """--preload: the rank server imports the module once, before it forks, and every rank
    has it from there (the module says in which process it was imported: the ranks'
    parent, the server)."""
    (tmp_path / "spmd_preloaded.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = run(fresh, "%spmd start -n 2 --backend none --preload xml.dom.minidom,spmd_preloaded")
    assert out.error is None, out.stderr
    out = run(fresh, "import os, sys, spmd_preloaded\n"
                     "print('xml.dom.minidom' in sys.modules, "
                     "spmd_preloaded.IMPORTED_IN == os.getppid() != os.getpid())")
    assert out.stdout == "[ranks 0-1] True True\n", out.stdout


def test_a_rank_server_whose_imports_start_a_thread_does_not_fork(fresh, tmp_path, monkeypatch):
    """A fork keeps only the forking thread (a lock another thread held would stay held in
    every rank): the start falls back, and says why."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), name='telemetry', daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = run(fresh, "%spmd start -n 2 --backend none --preload starts_a_thread")
    assert out.error is None, out.stderr
    assert (
        "The rank server could not be used (RuntimeError: its imports started a thread "
        "(telemetry), and a fork is unsafe): each rank started its own Python." in out.stdout
    ), out.stdout
    assert session(fresh).record().rank_server is None
    assert run(fresh, "x = 1").error is None


def test_a_rank_server_that_cannot_import_falls_back_with_one_line(fresh):
    """The ranks then start as a Python each; a restart starts them afresh (a new
    controller, and a new try at a rank server, which fails the same way)."""
    out = run(fresh, "%spmd start -n 2 --preload no_such_module_for_spmd")
    assert out.error is None, out.stderr
    said = [line for line in out.stdout.split("\r")[-1].splitlines() if "rank server" in line]
    assert said == [
        "The rank server could not be used (ModuleNotFoundError: No module named "
        "'no_such_module_for_spmd'): each rank started its own Python."
    ], out.stdout
    assert session(fresh).record().rank_server is None
    for row in session(fresh).ranks:
        assert psutil.Process(row.pid).ppid() == os.getpid()
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    controller = session(fresh).record().cluster.controller.process.pid
    out = run(fresh, "%spmd restart")
    assert out.error is None and "forked" not in out.stdout, out.stdout
    assert session(fresh).record().cluster.controller.process.pid != controller
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


def test_compilation_cache_is_kept_across_restarts_and_emptied_at_stop(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    assert run(fresh, SETUP).error is None
    folder = run(fresh, "print(jax.config.jax_compilation_cache_dir)").stdout.split()[-1]
    assert os.path.isdir(folder)
    first = run(fresh, JITTED)
    assert first.error is None
    cached = {n for n in os.listdir(folder) if n.startswith("jit_steps")}
    assert len(cached) == 2, os.listdir(folder)  # one per rank: each writes its own
    for how in ("%spmd restart", "%spmd restart"):  # forked, then again
        assert run(fresh, how).error is None
        assert run(fresh, SETUP).error is None
        assert run(fresh, "print(jax.config.jax_compilation_cache_dir)").stdout.split()[-1] == folder
        again = run(fresh, JITTED)
        assert again.stdout == first.stdout
    # the same function was not compiled again: no new entry for it
    assert {n for n in os.listdir(folder) if n.startswith("jit_steps")} == cached
    run(fresh, "%spmd stop")
    assert not os.path.exists(folder)


def test_a_named_compilation_cache_outlives_stop(fresh, tmp_path):
    folder = tmp_path / "jax-cache"
    out = run(fresh, f"%spmd start -n 2 --compilation-cache {folder}")
    assert out.error is None, out.stderr
    assert run(fresh, SETUP + "\n" + JITTED).error is None
    run(fresh, "%spmd stop")
    assert any(n.startswith("jit_steps") for n in os.listdir(folder))


@pytest.mark.parametrize(
    "line, says",
    [
        ("%spmd start -n 2 --rank-server maybe", "invalid choice: 'maybe'"),
        (
            "%spmd start -n 2 --preload flax --launcher mpi",
            "--preload is for ranks forked by a rank server, on this machine or over ssh (mpi "
            "starts a Python per rank)",
        ),
        ("%spmd start -n 2 --preload 'a b'", "--preload takes module names separated by"),
        ("%spmd start -n 2 --compilation-cache /dev/null/cache", "--compilation-cache "
         "/dev/null/cache cannot be used"),
    ],
)
def test_bad_start_options_are_refused_before_anything_starts(fresh, line, says):
    out = run(fresh, line)
    assert isinstance(out.error, UsageError), out.error
    assert says in str(out.error)
    assert not spmd_processes()


def test_a_rank_server_removes_at_its_end_only_a_folder_it_did_not_find(tmp_path):
    """A server asked to remove the cluster's folder on its host removes it at its end only if
    the folder was not there when asked: one that was is another's (the notebook's own live
    folder, where the host is this machine under a name the notebook did not know as its
    own, or on storage the hosts share)."""
    import sys

    from spmd.cluster.launchers import servers

    theirs, ours = tmp_path / "notebooks-own", tmp_path / "made-here"
    theirs.mkdir()
    server = servers.local_server(sys.executable, [], str(tmp_path / "server.log"))
    try:
        assert server.wait_ready(60)
        server.remove_at_end(str(theirs))
        server.remove_at_end(str(ours))
        # (a round trip after them: the server read them, in order)
        assert server.read(str(tmp_path / "server.log")) is not None
        ours.mkdir()  # (the ranks' output made it)
    finally:
        assert server.close()
    assert theirs.exists() and not ours.exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_128_forked_ranks_have_room_run_a_cell_and_are_told_in_groups(fresh, tmp_path):
    """The room check counts what a forked rank really holds (its PSS, per backend): 128
    ranks of --backend none start on a machine with 12 GiB free (it counted 0.25 GiB a rank,
    room for 88 on 22 GiB), and run a cell; a start past the room is still refused. Their
    status, a divergence report and a death report come in groups of ranks, not a line per
    rank (the status's was one; %spmd status all still lists every rank)."""
    if psutil.virtual_memory().available < 12 * 2**30:
        pytest.skip("this machine has less than 12 GiB free")
    out = run(fresh, "%spmd start -n 128 --backend none")
    assert out.error is None, out.stderr
    t0 = time.monotonic()
    out = run(fresh, "print('ran')")
    took = time.monotonic() - t0
    assert out.stdout == "[ranks 0-127] ran\n", out.stdout[-500:]
    status = run(fresh, "%spmd status").stdout.splitlines()
    assert status[0].split() == ["ranks", "hosts", "state", "devices", "last", "cell"], status
    assert status[1].split()[:3] == ["0-127", session(fresh).ranks[0].host, "idle"], status
    assert "128 ranks in 1 group (%spmd status all lists every rank)" in status, status
    every = run(fresh, "%spmd status all").stdout.splitlines()
    assert every[0].split()[0] == "rank" and every[128].split()[0] == "127", every[:3]
    mine = "import os, time\nmine = int(os.environ['SPMD_RANK'])\n"
    # (only late, in plain Python: the cell waits for them, until its timeout; long enough
    # for the other 126 to finish theirs: several times what a cell on all 128 took just now)
    timeout = max(4, math.ceil(8 * took))
    out = run(fresh, f"%%spmd --timeout {timeout}\n" + mine
                     + "if mine in (5, 77): time.sleep(120)")
    text = report(out)
    assert (f"Timed out after {timeout} s: ranks 5,77 are still running while ranks 0-4,6-76,"
            "78-127 had finished.") in text, text
    assert "[ranks 5,77] was running at cell line 3" in text, text
    assert len(text.splitlines()) < 20, text
    assert run(fresh, "%spmd restart").error is None
    # (rank 9 dies once every rank is in the cell's sleep: 128 ranks on 2 cores take a
    # moment to all have the cell; each says it has it with a file, one line before)
    here = tmp_path / "in-the-cell"
    here.mkdir()
    # (rank 9 waits 50 s at most: a rank that never came would fail the groups, not hang)
    out = run(fresh, mine + f"open(os.path.join({str(here)!r}, str(mine)), 'w').close(); "
                            "t0 = time.time()\nif mine == 9:\n"
                            f"    while len(os.listdir({str(here)!r})) < 128 and "
                            "time.time() < t0 + 50: time.sleep(0.05)\n"
                            "    time.sleep(0.5); os._exit(3)\n"
                            "time.sleep(60)")
    text = report(out)
    assert "Rank 9 died: exit code 3." in text, text
    groups = [line for line in text.splitlines() if line.startswith("[rank")]
    assert groups == ["[ranks 0-8,10-127] was running at cell line 7: time.sleep(60)"], text
    assert run(fresh, "%spmd stop").error is None
    out = run(fresh, "%spmd start -n 100000 --backend none")
    assert isinstance(out.error, UsageError)
    assert "each needs about 64 MiB (none, forked by the rank server)" in str(out.error)


def test_a_fork_that_fails_before_its_output_is_its_own_is_told_from_the_servers_log(tmp_path):
    """A rank whose fork fails before its output file is open writes nothing of its own: the
    server's log names the fork, and the start's error shows that part of the log only, not
    another rank's."""
    from types import SimpleNamespace

    from spmd.cluster.launchers import forks, servers

    (tmp_path / "a folder").mkdir()  # (no file can be opened there for writing)
    server = servers.local_server(sys.executable, [], str(tmp_path / "server.log"))
    try:
        assert server.wait_ready(60)
        for key in ("3/0", "3/1"):
            pid = server.fork(key, dict(os.environ), ["spmd"], str(tmp_path / "a folder"), "")
            assert server.exit_code(pid, timeout=30) == (True, 1)
    finally:
        server.close()
    for key in ("3/0", "3/1"):
        said = forks.ForkedEngineLauncher.fork_failure(SimpleNamespace(fork_key=key,
                                                                       server=server))
        lines = said.splitlines()
        assert lines[0] == f"The fork for {key} failed:" and len(lines) <= 5, said
        assert lines[-1].startswith("IsADirectoryError: "), said
        assert "The fork for" not in "\n".join(lines[1:]), said
    assert forks.ForkedEngineLauncher.fork_failure(
        SimpleNamespace(fork_key="3/2", server=server)) == ""
