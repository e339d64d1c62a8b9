"""Faults on two real ranks: a rank raises, hangs, sleeps past a timeout, is killed, or the
notebook is interrupted. Each ends in a report that says which rank and why, and one
``%spmd restart`` brings back a cluster where a psum works."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import displays, ready_cluster, report, restart_and_run, run, session
from IPython.core.error import UsageError

from spmd.magics.render import LiveView

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


def test_one_rank_still_running_after_the_grace_is_named(cluster):
    out = run(cluster, "%%spmd --grace 1\nif rank == 1:\n    time.sleep(60)\nprint('done')")
    text = report(out)
    assert text.startswith("The ranks diverged: rank 1 is still running 1 s after rank 0 finished")
    # line numbers count from the first line after %%spmd, as the ranks' tracebacks do
    assert "[rank 1] was running at cell line 2: time.sleep(60)" in text
    assert out.stdout.startswith("[rank 0] done\n")
    restart_and_psum(cluster)


def test_the_watchdogs_interrupt_reaches_a_rank_and_ends_its_cell(cluster):
    # (the report is written before any signal is sent: only the rank itself can show that
    # the SIGINT came)
    cell = (
        "%%spmd --grace 0.5\n"
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
        "%%spmd --grace 0.5\n"
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


def test_a_completions_look_at_busy_ranks_leaves_a_ranks_prompt_waiting(cluster):
    # The notebook gave up on the cell (a timeout; the rank ignores SIGINT), and afterwards
    # the rank asks for input. Tab completion checks for busy ranks on every keypress: that
    # look must not answer the rank's prompt (it would get an EOFError from a keypress).
    cell = (
        "%%spmd --timeout 1 --grace off\n"
        "import signal\n"
        "if rank == 1:\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    time.sleep(4)\n"
        "    answer = input('name? ')\n"
    )
    text = report(run(cluster, cell))  # (over in about 2 s: the report's wait is done)
    assert "Rank 1 did not respond to the interrupt" in text, text
    time.sleep(3.5)  # rank 1 is at its prompt now
    for _ in range(5):
        assert session(cluster).busy_ranks() == [1]
        time.sleep(0.1)
    restart_and_psum(cluster)
