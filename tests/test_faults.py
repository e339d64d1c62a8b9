"""Faults on two real ranks: a rank raises, hangs, sleeps past a timeout, is killed, or the
notebook is interrupted. Each ends in a report that says which rank and why, and one
``%spmd restart`` brings back a cluster where a psum works."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import (
    displays,
    ready_cluster,
    report,
    restart_and_run,
    run,
    session,
    spmd_kernel,
)
from IPython.core.error import UsageError

from spmd.cluster import cells
from spmd.cluster.lockstep import where
from spmd.magics.cells import report as reports
from spmd.magics.cells.render import LiveView

pytestmark = pytest.mark.timeout(180)

PSUM = "print(psum(jnp.ones(jax.local_device_count())))"
SETUP = (
    "import os, time, jax, jax.numpy as jnp\n"
    "rank = jax.process_index()\n"
    "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
)


@pytest.fixture
def cluster(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 2", SETUP)


def restart_and_psum(shell) -> None:
    """One %spmd restart, then a collective across both ranks gives the global sum."""
    assert restart_and_run(shell, SETUP, PSUM) == "[ranks 0-1] [4. 4.]\n"


def test_a_rank_that_raises_before_a_psum_gets_a_divergence_report(cluster):
    t0 = time.monotonic()
    out = run(
        cluster,
        "if rank == 0:\n"
        "    raise ValueError('bad batch on rank 0')\n"
        "total = psum(jnp.ones(jax.local_device_count()))\n"
        "print(total)",
    )
    seconds = time.monotonic() - t0
    text = report(out)
    assert text.startswith("Error on 1 of 2 ranks (0); rank 1 did not raise.\n")
    assert (
        "The ranks diverged: rank 1 is waiting in a collective that rank 0 never reached: "
        "rank 0 raised an error first." in text
    )
    assert "[rank 0] ValueError: bad batch on rank 0" in text
    # where rank 1 was: the cell line it was blocked on, then inside jax
    assert "[rank 1] was running at cell line 4: print(total)" in text
    assert "jax/_src/" in text
    assert "Next: %spmd restart." in text
    assert seconds < 30  # the default grace is 2 s; a hang would hit the test timeout
    # the cluster is out of step: cells are refused, not sent to hang
    refused = run(cluster, PSUM)
    assert isinstance(refused.error, UsageError)
    assert "Cell not run: the last cell diverged" in str(refused.error)
    assert "%spmd restart" in str(refused.error)
    restart_and_psum(cluster)


def test_sleeping_past_the_timeout_reports_the_line_and_needs_a_restart(cluster):
    t0 = time.monotonic()
    out = run(cluster, "%%spmd --timeout 1\nx = 1\ntime.sleep(60)")
    assert time.monotonic() - t0 < 20
    text = report(out)
    assert text.startswith("Timed out after 1 s: ranks 0-1 are still running.")
    assert "[ranks 0-1] was running at cell line 2: time.sleep(60)" in text
    assert "KeyboardInterrupt" not in text  # the interrupt was ours, not the user's error
    assert isinstance(run(cluster, "x").error, UsageError)
    restart_and_psum(cluster)


@pytest.mark.parametrize("late", ["time.sleep(0.5)", "time.sleep(1.5)", "busy(1.25)"])
def test_a_rank_that_is_only_slower_is_waited_for_and_the_cluster_stays_in_step(cluster, late,
                                                                                monkeypatch):
    """Late is not diverged: rank 1 runs plain Python past the grace (0.5 s here, as the
    default's 2 s), launches nothing rank 0 did not, and the cell waits for it; the live view
    says whom it waits for."""
    monkeypatch.setattr(LiveView, "delay", 0.25)  # (shown from the grace on, not from 1 s)
    busy = "def busy(s):\n    end = time.monotonic() + s\n    while time.monotonic() < end:\n" \
           "        pass"
    assert run(cluster, busy).error is None
    with displays() as shown:
        out = run(cluster, f"%%spmd --grace 0.5\nif rank == 1:\n    {late}\nprint('slept')")
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] slept\n", out.stdout
    assert not session(cluster).out_of_step
    if late != "time.sleep(0.5)":  # (a race with the grace: rank 1 may end first)
        seen = [d.get("text/plain", "") for d in shown]
        assert any(text.startswith("Waiting for rank 1: still running ") and "s after rank 0 "
                   "finished, and behind it" in text for text in seen), seen
    # the next cell runs, and a collective meets
    assert run(cluster, PSUM).stdout == "[ranks 0-1] [4. 4.]\n"


def test_the_interrupt_reaches_a_straggler_the_cell_waits_for(cluster):
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))  # past the grace
    timer.start()
    out = run(cluster, "%%spmd --grace 0.5\nif rank == 1:\n    time.sleep(60)")
    timer.cancel()
    text = report(out)
    assert text.startswith("Interrupted: rank 1 is running while rank 0 had finished."), text
    assert "[rank 1] was running at cell line 2: time.sleep(60)" in text
    assert "did not respond" not in text and not session(cluster).busy_ranks()
    restart_and_psum(cluster)


def test_a_rank_behind_a_finished_ranks_launch_is_waited_for(cluster):
    # rank 0 launches the psum (jax dispatches it without waiting) and ends its cell; rank 1
    # is 2 graces behind (1 s of a 0.5 s grace, as the default's 4 s of 2 s), with no
    # launch yet: behind, not diverged; then it launches the same
    out = run(cluster, "%%spmd --grace 0.5\ntime.sleep(1 if rank == 1 else 0)\n"
                       "y = psum(jnp.ones(2))")
    assert out.error is None, report(out)
    assert run(cluster, "print(y)").stdout == "[ranks 0-1] [4. 4.]\n"


@pytest.mark.parametrize("collective", [
    "jax.block_until_ready(psum(jnp.ones(2)))",
    # (jax's own jit, blocked inside its call: the census names the launch in flight)
    "from jax.experimental import multihost_utils\n"
    "    multihost_utils.sync_global_devices('x')",
])
def test_a_rank_that_skips_a_collective_is_still_reported_within_the_grace(cluster, collective):
    t0 = time.monotonic()
    out = run(cluster, f"if rank == 0:\n    {collective}")
    seconds = time.monotonic() - t0
    text = report(out)
    assert text.startswith("The ranks diverged: rank 0 is waiting in a collective that rank 1 "
                           "never reached: rank 1 finished the cell without it"), text
    assert "rank 0 launched 1, rank 1 launched 0" in text, text
    assert seconds < 2 + 3  # the grace, and the report's own second or two
    assert isinstance(run(cluster, PSUM).error, UsageError)  # out of step: refused
    restart_and_psum(cluster)


def test_a_straggler_that_then_launches_what_the_others_never_did_is_reported(cluster):
    # past the grace rank 1 is only behind; 2 graces in (1 s of a 0.5 s grace, as the
    # default's 4 s of 2 s), it launches a psum rank 0 never made
    t0 = time.monotonic()
    out = run(cluster, "%%spmd --grace 0.5\nif rank == 1:\n    time.sleep(1)\n"
                       "    print(psum(jnp.ones(2)))")
    seconds = time.monotonic() - t0
    text = report(out)
    assert text.startswith("The ranks diverged: rank 1 is waiting in a collective that rank 0 "
                           "never reached"), text
    assert 1 < seconds < 1 + 0.5 + 3  # within a grace of the launch
    restart_and_psum(cluster)


GLOBAL_X = (
    "from jax.sharding import NamedSharding, PartitionSpec as P\n"
    "mesh = jax.make_mesh((jax.device_count(),), ('x',), "
    "axis_types=(jax.sharding.AxisType.Auto,))\n"
    "x = jax.device_put(jnp.arange(8.), NamedSharding(mesh, P('x')))"
)


@pytest.mark.parametrize("eager", ["print(x.sum())", "print(x[::-1])"])
def test_a_rank_inside_an_eager_jax_operation_the_others_skipped_is_reported(cluster, eager,
                                                                               monkeypatch):
    """jax's own operations on an array over both processes (no jit of the user's) launch
    collectives the census does not see: rank 0 stays inside jax, and is reported past the
    grace and the patience (1.5 s here, of the default 3 s); the live view says where it is
    meanwhile."""
    patience = 1.5
    for module in (cells, reports):  # (the notebook's: its watchdog, and the report's words)
        monkeypatch.setattr(module, "INSIDE_PATIENCE", patience)
    monkeypatch.setattr(LiveView, "delay", 0.25)  # (shown from the grace on, not from 1 s)
    assert run(cluster, GLOBAL_X).error is None
    t0 = time.monotonic()
    with displays() as shown:
        out = run(cluster, f"%%spmd --grace 0.5\nif rank == 0:\n    {eager}")
    seconds = time.monotonic() - t0
    text = report(out)
    assert text.startswith(f"The ranks diverged: rank 0 has been inside jax (at cell line 2: "
                           f"{eager}; in "), text
    assert ("and rank 1 finished the cell" in text and "most likely it is waiting in a "
            "cross-process operation that rank 1 did not make" in text), text
    assert "allow more time with %%spmd --grace S" in text, text
    assert "[rank 0] was running at cell line 2: " + eager in text, text
    assert 0.5 + patience < seconds < 0.5 + patience + 5  # the grace, the patience, the report
    seen = [d.get("text/plain", "") for d in shown]
    assert any(ln.startswith("Waiting for rank 0: still running ") and "inside jax (at cell "
               f"line 2: {eager}; in " in ln and "it may be waiting in a collective that rank "
               "1 did not make" in ln for d in seen for ln in d.splitlines()), seen
    assert not any("slower, not diverged" in d for d in seen), seen
    assert isinstance(run(cluster, PSUM).error, UsageError)  # out of step: refused
    restart_and_psum(cluster)


def test_a_stack_tells_a_wait_inside_jax_from_plain_python_and_from_a_compile():
    """(no ranks) The innermost frames decide, looking through the standard library and spmd's
    engine: jax's or torch's are a call that may wait; the user's own code (the cell, another
    file of theirs) is plain Python; jax's compiler or tracing anywhere is work."""
    from spmd.cluster.lockstep.where import Frame, Stack

    cell, jax_ = "/tmp/ipykernel_7/123.py", "/v/lib/python3.11/site-packages/jax/_src/"
    stdlib = os.path.join(os.path.dirname(os.__file__), "threading.py")
    engine = os.path.join("/src", "spmd", "engine", "results.py")

    def inside(*files: str):
        at = Stack(0, [Frame(cell, 2, "<module>")] + [Frame(f, 1, "f") for f in files]).inside
        return None if at is None else (at.library, at.building)

    assert inside() is None  # time.sleep, a busy loop: the cell is innermost
    assert inside("/home/me/train.py") is None  # the user's own file
    assert inside(jax_ + "api.py", "/home/me/loss.py") is None  # the user's, called by jax
    assert inside(jax_ + "array.py") == ("jax", False)
    assert inside(jax_ + "array.py", engine, stdlib) == ("jax", False)
    assert inside("/v/site-packages/torch/distributed/tensor/_api.py") == ("torch", False)
    assert inside("/v/site-packages/numpy/core/x.py") is None
    assert inside(jax_ + "pjit.py", jax_ + "compiler.py") == ("jax", True)
    assert inside(jax_ + "pjit.py", jax_ + "interpreters/partial_eval.py", cell,
                  jax_ + "numpy/array_methods.py") == ("jax", True)  # tracing the user's
    assert inside("/v/site-packages/ipykernel/iostream.py") is None  # the cell just ended


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_a_dozen_graces_slower_is_waited_for(cluster, monkeypatch):
    """A rank far slower than the others is not called diverged: what the watchdog counts is
    graces, and a cell sets the grace. Here 12 graces of 0.5 s, a look of the live view at the
    busy ranks every second, twice the controller's 3 s heartbeat window (no other wait of the
    product meets a cell between 6 s and 30 s: this stood for 30 s at the default 2 s grace)."""
    monkeypatch.setattr(LiveView, "look_after", 1.0)
    monkeypatch.setattr(LiveView, "look_every", 1.0)
    with displays() as shown:
        out = run(cluster, "%%spmd --grace 0.5\ntime.sleep(6 if rank == 1 else 0)\n"
                           "print('slept')")
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] slept\n", out.stdout
    assert not session(cluster).out_of_step
    seen = [d.get("text/plain", "") for d in shown]
    assert any(text.startswith("Waiting for rank 1: still running ") for text in seen), seen
    assert run(cluster, PSUM).stdout == "[ranks 0-1] [4. 4.]\n"


def test_the_watchdogs_interrupt_reaches_a_rank_and_ends_its_cell(cluster):
    # (the report is written before any signal is sent: only the rank itself can show that
    # the SIGINT came)
    cell = (
        "%%spmd --timeout 1\n"
        "if rank == 1:\n"
        "    try:\n"
        "        time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        "        print('rank 1 got the interrupt')\n"
    )
    text = report(run(cluster, cell))
    assert "did not respond" not in text, text
    assert not session(cluster).busy_ranks()
    assert "rank 1 got the interrupt" in run(cluster, "%spmd log 1").stdout
    restart_and_psum(cluster)


def test_where_shows_busy_ranks_and_interrupt_says_who_did_not_respond(cluster):
    stubborn = (
        "%%spmd --timeout 1\n"
        "if rank == 1:\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(60)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
    )
    text = report(run(cluster, stubborn))
    assert "Rank 1 did not respond to the interrupt" in text
    where = run(cluster, "%spmd where")
    assert where.error is None
    assert where.stdout.startswith("[rank 1] was running at cell line 4: time.sleep(60)\n")
    interrupted = run(cluster, "%spmd interrupt")
    assert interrupted.stdout == (
        "Sent SIGINT to rank 1; rank 1 did not respond: %spmd restart ends them.\n"
    )
    status = run(cluster, "%spmd status")
    assert "busy" in status.stdout and "Cells are refused" in status.stdout
    restart_and_psum(cluster)


def test_a_long_cell_shows_the_line_each_busy_rank_is_on(cluster, monkeypatch):
    monkeypatch.setattr(LiveView, "look_after", 1.0)
    monkeypatch.setattr(LiveView, "look_every", 1.0)
    with displays() as shown:  # what the live view showed while the cell ran
        out = run(
            cluster, "%%spmd --grace off --timeout 4\nif rank == 1:\n    time.sleep(60)\n" + PSUM
        )
    seen = [d.get("text/plain", "") for d in shown]
    live = next(text for text in seen if text.startswith("Still running after"))
    assert "  rank 0 at cell line 3: " + PSUM + "   (waiting inside jax)" in live
    assert "  rank 1 at cell line 2: time.sleep(60)" in live
    assert "The ranks are on different lines" in live
    # when the cell ends the live view is cleared, leaving no empty output behind
    assert not any(text.startswith("Still running") or not text for text in out.texts)
    assert report(out).startswith(
        "Timed out after 4 s: ranks 0-1 are still running; rank 0 is waiting in a collective "
        "for rank 1, still in its own code."
    )
    restart_and_psum(cluster)


def test_a_rank_whose_threads_come_and_go_survives_the_live_views_looks(cluster, monkeypatch):
    # A stack dump from a signal handler reads the other threads while they run, and crashes
    # a process whose threads come and go (CPython #116008): a rank that can answer on its
    # control channel is asked there, and is never signalled.
    monkeypatch.setattr(LiveView, "look_after", 0.1)
    monkeypatch.setattr(LiveView, "look_every", 0.1)
    # (a loaded machine may take its time to answer: the point is that it is asked there)
    monkeypatch.setattr(cells, "LOCAL_ANSWER_SECONDS", 10.0)
    cell = (
        "%%spmd --grace off\n"
        "import threading\n"
        "done = threading.Event()\n"
        "def churn():\n"
        "    while not done.is_set():\n"
        "        t = threading.Thread(target=sum, args=(range(100),))\n"
        "        t.start()\n"
        "        t.join()\n"
        "churner = threading.Thread(target=churn)\n"
        "churner.start()\n"
        "time.sleep(3)\n"
        "done.set()\n"
        "churner.join()\n"
        "print('survived')\n"
    )
    signalled = signalled_ranks(monkeypatch)
    with displays() as shown:
        out = run(cluster, cell)
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] survived\n"
    assert signalled == []
    looked = [d.get("text/plain", "") for d in shown]
    assert any("at cell line 10: time.sleep(3)" in text for text in looked), looked


def test_where_finds_a_rank_that_holds_the_gil(cluster, monkeypatch):
    # A regular expression matches in C holding the GIL: the rank's control thread cannot
    # answer, and its stack comes from the dump its signal handler writes.
    cell = (
        "%%spmd --timeout 1\n"
        "import re\n"
        "if rank == 1:\n"
        "    while True:\n"
        "        try:\n"
        "            re.match(r'(a+)+$', 'a' * 40 + 'b')\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
    )
    text = report(run(cluster, cell))
    assert text.startswith("Timed out after 1 s"), text
    signalled = signalled_ranks(monkeypatch)
    found = run(cluster, "%spmd where")
    assert found.error is None
    assert found.stdout.startswith(
        "[rank 1] was running at cell line 5: re.match(r'(a+)+$', 'a' * 40 + 'b')\n"
    ), found.stdout
    assert signalled == [1]  # (rank 0, idle, is not asked; rank 1 did not answer)
    restart_and_psum(cluster)


def signalled_ranks(monkeypatch) -> list[int]:
    """The ranks asked for their stacks by signal from now on (filled in as they are)."""
    real, signalled = where.dump, []

    def dump(targets, **kwargs):
        signalled.extend(sorted(targets))
        return real(targets, **kwargs)

    monkeypatch.setattr(where, "dump", dump)
    return signalled


def test_where_with_no_busy_rank_says_so(cluster):
    out = run(cluster, "%spmd where")
    assert out.error is None
    assert out.stdout == (
        "No rank is running a cell: all 2 ranks are idle, so there is no stack to show.\n"
    )
    assert run(cluster, "%spmd interrupt").stdout.startswith("No rank is running a cell")


def test_interrupting_the_notebook_reaches_every_rank_within_a_second(cluster):
    # The notebook's Kernel > Interrupt is a SIGINT to the notebook's process: here, pytest's.
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    out = run(cluster, "%%spmd --grace off\nif rank == 1:\n    time.sleep(60)\n" + PSUM)
    back = time.monotonic() - t0 - 1.0
    timer.cancel()  # if the cell came back early, no stray SIGINT may hit pytest
    text = report(out)
    assert text.startswith(
        "Interrupted: ranks 0-1 are running; rank 0 is waiting in a collective for rank 1, "
        "still in its own code."
    )
    assert "[rank 1] was running at cell line 2: time.sleep(60)" in text
    assert "[rank 0] was running at cell line 3:" in text
    assert back < 5  # about 1 s here: the stacks, the SIGINT, a short wait
    restart_and_psum(cluster)


def test_interrupting_twice_still_ends_in_the_report_and_the_guard(cluster):
    # People press Interrupt twice: the second one lands while stacks are read or the ranks
    # are given their half second to stop.
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (1.0, 1.2, 1.4)]
    for timer in timers:
        timer.start()
    try:
        out = run(cluster, "%%spmd --grace off\ntime.sleep(60)")
    finally:
        # a SIGINT that comes after the cell must not interrupt pytest
        previous = signal.signal(signal.SIGINT, lambda *_: None)
        for timer in timers:
            timer.cancel()
            if timer.is_alive():
                timer.join()
        signal.signal(signal.SIGINT, previous)
    text = report(out)
    assert text.startswith("Interrupted: ranks 0-1 are running")
    assert "[ranks 0-1] was running at cell line 1: time.sleep(60)" in text
    assert session(cluster).out_of_step  # the next cell is refused, not sent to hang
    refused = run(cluster, "x = 1")
    assert isinstance(refused.error, UsageError) and "%spmd restart" in str(refused.error)


@pytest.mark.parametrize("victim", [0, 1], ids=["rank 0 (the coordinator)", "the last rank"])
def test_a_rank_killed_while_idle_is_reported_at_the_next_cell(cluster, victim):
    pid = session(cluster).ranks[victim].pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    out = run(cluster, PSUM)
    assert isinstance(out.error, UsageError)
    message = str(out.error)
    assert message.startswith(f"Cell not run: rank {victim} died (killed by SIGKILL")
    assert f"Rank {victim} (pid {pid}) died: killed by SIGKILL" in message
    # the dead rank is shown dead; the other one was stopped with it, unless the coordinator's
    # death made it abort first (jax ends every process of the job when rank 0 dies)
    other = {1: ("stopped",), 0: ("stopped", "died")}[victim]
    states = {r.rank: r.state for r in session(cluster).ranks}
    assert states[victim] == "died" and states[1 - victim] in other
    table = run(cluster, "%spmd status").stdout.splitlines()
    rows = {int(line.split()[0]): line.split()[3] for line in table[1:3]}
    assert rows == states
    restart_and_psum(cluster)


@pytest.mark.parametrize("victim", [0, 1], ids=["rank 0 (the coordinator)", "the last rank"])
def test_a_rank_killed_in_a_collective_fails_the_cell_within_seconds(cluster, victim):
    pid = session(cluster).ranks[victim].pid
    other = 1 - victim
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    # the victim enters the psum at once and waits there for the other, which sleeps
    out = run(cluster, f"%%spmd --grace off\nif rank == {other}:\n    time.sleep(60)\n{PSUM}")
    seconds = time.monotonic() - t0 - 1.0
    killer.cancel()
    text = report(out)
    assert text.startswith(f"Rank {victim} died: killed by SIGKILL")
    assert "The other ranks were stopped. Next: %spmd restart starts a fresh cluster." in text
    assert seconds < 5  # measured ~0.1 s: the death is seen by its process handle
    restart_and_psum(cluster)


def test_a_rank_that_crashes_shows_its_last_lines(cluster):
    out = run(
        cluster,
        "import sys\nif rank == 1:\n    print('about to crash', file=sys.__stderr__, flush=True)\n"
        "    os.abort()\ntime.sleep(30)",
    )
    text = report(out)
    assert text.startswith("Rank 1 died: killed by SIGABRT")
    assert "The last lines rank 1 wrote (its stdout and stderr):" in text
    assert "    about to crash" in text
    assert "Rank 1 crashed at cell line 4: os.abort()" in text
    restart_and_psum(cluster)


def test_a_session_timeout_applies_to_every_cell(cluster):
    # a cluster of its own, with a timeout; the fixture starts the usual one for the next test
    shell = cluster
    assert run(shell, "%spmd stop").error is None
    started = run(shell, "%spmd start -n 2 --backend none --timeout 1")
    assert started.error is None, started.stderr
    try:
        assert run(shell, "import time; time.sleep(0.1)").error is None
        text = report(run(shell, "time.sleep(30)"))
        assert text.startswith("Timed out after 1 s")
    finally:
        run(shell, "%spmd stop")


def test_a_completions_look_at_busy_ranks_leaves_a_ranks_prompt_waiting(cluster, tmp_path):
    # The notebook gave up on the cell (a timeout; the rank ignores SIGINT), and afterwards
    # the rank asks for input. Tab completion checks for busy ranks on every keypress: that
    # look must not answer the rank's prompt (it would get an EOFError from a keypress).
    asking = tmp_path / "asking"
    cell = (
        "%%spmd --timeout 1 --grace off\n"
        "import signal\n"
        "if rank == 1:\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    time.sleep(4)\n"
        f"    open({str(asking)!r}, 'w').close()\n"
        "    answer = input('name? ')\n"
    )
    text = report(run(cluster, cell))  # (over in about 2 s: the report's wait is done)
    assert "Rank 1 did not respond to the interrupt" in text, text
    deadline = time.monotonic() + 30
    while not asking.exists():  # (rank 1 is about to ask)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)  # rank 1 is at its prompt now
    for _ in range(5):
        assert session(cluster).busy_ranks() == [1]
        time.sleep(0.1)
    restart_and_psum(cluster)


# -- the report, as a front end shows it ------------------------------------------------------


def error_shown(kc, code: str) -> tuple[str, str]:
    """Run ``code``; (its report's first line, the error as front ends that show the
    exception's message beside the report do: nbclient's errors, VS Code's, ``ename: evalue``
    and then the traceback)."""
    errors = []
    kc.execute_interactive(code, timeout=120, output_hook=lambda msg: errors.append(
        msg["content"]) if msg["msg_type"] == "error" else None)
    assert len(errors) == 1, errors
    error = errors[0]
    return error["traceback"][0], "\n".join([f"{error['ename']}: {error['evalue']}",
                                              *error["traceback"]])


def test_a_divergence_report_says_its_first_sentence_once_in_the_spmd_kernel():
    with spmd_kernel() as (_km, kc):
        headline, shown = error_shown(
            kc, "import jax, jax.numpy as jnp\nif jax.process_index() == 0:\n"
                "    jax.block_until_ready(jax.pmap(lambda x: jax.lax.psum(x, 'i'), "
                "axis_name='i')(jnp.ones(1)))")
        assert headline.startswith("The ranks diverged: rank 0 is waiting in a collective"), shown
        assert shown.count(headline) == 1, shown
        assert shown.startswith("RankErrors: The cell stopped: the ranks diverged.\n"), shown


def test_a_death_report_says_its_first_sentence_once_with_the_magic_in_a_plain_kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        started = kc.execute_interactive("%load_ext spmd\n%spmd start -n 2", timeout=120)
        assert started["content"]["status"] == "ok", started
        headline, shown = error_shown(kc, "import os, signal, jax\nif jax.process_index() == 1:"
                                          "\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                                          "import time\ntime.sleep(30)")
        assert headline.startswith("Rank 1 died: killed by SIGKILL"), shown
        assert shown.count(headline) == 1, shown
        assert shown.startswith("RankErrors: The cell stopped: rank 1 died.\n"), shown
        kc.execute_interactive("%spmd stop", timeout=60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)

