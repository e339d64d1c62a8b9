"""The cluster's life has one owner: a stop, a restart and a report finish once begun, whatever
SIGINT lands in them; a shutdown request on ipykernel's control thread waits for the cell on
the main thread to let go; a start that retries keeps its compilation cache."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import (
    SPMD_KERNEL,
    report,
    run,
    session,
    spmd_processes,
    wait_until_gone,
)
from IPython.core.error import UsageError

from spmd.cluster import interrupts

pytestmark = pytest.mark.timeout(240)

SETUP = (
    "import os, time, jax, jax.numpy as jnp\n"
    "rank = jax.process_index()\n"
    "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
)
PSUM = "print(psum(jnp.ones(jax.local_device_count())))"


def psum_runs(shell) -> None:
    """A cell that needs every rank in step runs and gives the right answer."""
    assert run(shell, SETUP).error is None
    out = run(shell, PSUM)
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] [2.]\n"


@contextlib.contextmanager
def interrupt_inside(
    stretch: str, count: int = 3, after_wait: bool = False, delay: float = 0.0
):
    """While the block runs, a thread waits until the main thread is inside the held stretch
    ``stretch`` (with SIGINT held there, not in an interruptible part of it; with
    ``after_wait``, only once an interruptible part, a cell's wait, has come and gone; with
    ``delay``, that many seconds after the stretch began, wherever in it the main thread is
    then), and sends the notebook's process up to ``count`` SIGINTs, 2 ms apart, while it is
    still inside: the notebook's Interrupt, pressed impatiently. Yields the list of what it
    sent. When the block ends the thread is ended, and a SIGINT still in flight does nothing
    (it must not reach pytest, or a later test)."""
    me = os.getpid()
    sent: list[float] = []
    done = threading.Event()

    def watch() -> None:
        waited = not after_wait
        while not done.is_set():
            inside = stretch in interrupts._held
            held = inside and signal.getsignal(signal.SIGINT) is interrupts._note
            waited = waited or (inside and not held)
            if inside and delay:
                time.sleep(delay)
                held = inside = stretch in interrupts._held
            if held and waited:
                for _ in range(count):
                    if stretch not in interrupts._held:
                        return
                    os.kill(me, signal.SIGINT)
                    sent.append(time.monotonic())
                    time.sleep(0.002)
                return
            time.sleep(0.0005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        previous = signal.signal(signal.SIGINT, lambda *_: None)
        done.set()
        thread.join()
        time.sleep(0.05)
        signal.signal(signal.SIGINT, previous)


def test_an_interrupt_held_inside_an_interruptible_stretch_is_raised_when_the_hold_ends(capsys):
    # a held stretch ("b") inside an interruptible one, inside a held one ("a"): a SIGINT in
    # "b" waits for "b" to end, and is raised there (the interruptible part is given up);
    # "a" then ends with nothing noted, so nothing is said about it
    outside = signal.getsignal(signal.SIGINT)
    reached = []
    with interrupts.held("a"):
        with pytest.raises(KeyboardInterrupt), interrupts.interruptible():
            with interrupts.held("b"):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # (the handler has run: nothing was raised inside "b")
                reached.append("the end of b")
            reached.append("after b")
        assert signal.getsignal(signal.SIGINT) is interrupts._note  # ("a" holds again)
    assert reached == ["the end of b"]
    assert signal.getsignal(signal.SIGINT) is outside
    assert "Interrupt held" not in capsys.readouterr().err


def test_sigint_during_stop_is_held_and_the_stop_finishes(fresh):
    assert run(fresh, "%spmd start -n 2").error is None
    pids = [r.pid for r in session(fresh).ranks]
    with interrupt_inside("the stop") as sent:
        out = run(fresh, "%spmd stop")
    assert sent, "the stop was over before an interrupt could land in it"
    assert out.error is None, out.error
    assert out.stdout.startswith("Stopped 2 processes in "), out.stdout
    assert "Interrupt held until the stop finished" in out.stderr
    assert not wait_until_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 5)
    assert not spmd_processes()
    assert run(fresh, "%spmd start -n 2").error is None  # a clean start after it
    psum_runs(fresh)


def test_sigint_during_a_report_is_held_and_the_guard_comes(fresh):
    assert run(fresh, "%spmd start -n 2 --grace 0.5").error is None
    assert run(fresh, SETUP).error is None
    with interrupt_inside("the report", after_wait=True) as sent:
        out = run(fresh, "if rank == 0:\n    raise ValueError('diverge')\n" + PSUM)
    assert sent
    assert "The ranks diverged: rank 1 is waiting in a collective" in report(out), report(out)
    assert "Interrupt held until the report finished" in out.stderr
    assert session(fresh).out_of_step
    assert run(fresh, "%spmd restart").error is None
    psum_runs(fresh)


def held_for(stretch: str, block) -> float:
    """How long the main thread was inside the held stretch ``stretch`` while ``block()``
    ran (seconds; watched every millisecond)."""
    inside: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if stretch in interrupts._held:
                inside.append(time.monotonic())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        block()
    finally:
        done.set()
        watcher.join()
    return inside[-1] - inside[0] if inside else 0.0


def test_an_interrupt_at_any_point_of_a_restart_leaves_ranks_that_run(fresh):
    """An interrupt while the new ranks register and join gives the restart up (the
    cluster is stopped: the next restart starts afresh); in the old ranks' end and the
    fork, it waits until the restart has finished. (It comes 0, 0.2, 0.4 and 0.6 of the way
    through a restart as long as one just measured, one after the other on one cluster.)"""
    assert run(fresh, "%spmd start -n 2").error is None
    # (the shorter of two: a restart is timed, not guessed, on a fast or a busy machine)
    took = min(held_for("the restart", lambda: run(fresh, "%spmd restart")) for _ in range(2))
    assert took > 0
    for part in (0.0, 0.2, 0.4, 0.6):
        for _ in range(3):  # (a restart quicker than those timed ends before the interrupt)
            ran = []
            with interrupt_inside("the restart", count=1, delay=part * took) as sent:
                took_now = held_for(
                    "the restart", lambda ran=ran: ran.append(run(fresh, "%spmd restart")))
            if sent:
                break
            took = min(took, took_now)
        (out,) = ran
        assert sent, part  # (inside the restart, held or not)
        if out.error is not None:  # it came while the ranks joined: the cluster was stopped
            # one sentence: what was given up, what runs now, what to do; no traceback
            assert isinstance(out.error, UsageError), (part, out.error)
            assert str(out.error) == ("Interrupted: the restart was given up while the new "
                                      "ranks joined, and no rank runs now; %spmd restart "
                                      "starts them afresh."), (part, out.error)
            assert not session(fresh).running
            assert run(fresh, "%spmd restart").error is None
        else:
            assert "forked by the rank server" in out.stdout, (part, out.stdout)
            assert "Interrupt held until the restart finished" in out.stderr, part
        s = session(fresh)
        assert s.running and not s.deaths.dead_ranks(s.gen) and not s.out_of_step, part
        # every rank in the table is a live process, and no old rank is left over
        live = {p.pid for p in spmd_processes()}
        assert {r.pid for r in s.ranks} <= live, part
        psum_runs(fresh)


def test_an_interrupt_during_a_start_gives_it_up_in_one_sentence(fresh):
    """^C while the ranks start: the start is given up, nothing is left running, and the cell
    says so in one sentence with the next step (before: a 40-line KeyboardInterrupt)."""
    with interrupt_inside("the end of the start", count=1, delay=0.3) as sent:
        out = run(fresh, "%spmd start -n 2")
    assert sent
    assert isinstance(out.error, UsageError), (out.error, out.stdout, out.stderr)
    assert str(out.error) == ("Interrupted: the start was given up and nothing runs now; run "
                              "%spmd start again to start the cluster.")
    assert "Traceback" not in out.stdout + out.stderr
    assert not spmd_processes()


def test_an_interrupt_during_a_fresh_restart_never_leaves_a_half_cluster(fresh):
    # (ranks with no rank server: the restart stops and starts afresh)
    assert run(fresh, "%spmd start -n 2 --rank-server off").error is None
    with interrupt_inside("the stop", count=1) as sent:
        out = run(fresh, "%spmd restart")
    assert sent
    # the stop finished (held); the start after it is a start like any other
    if out.error is not None:  # (it reached the start's interruptible part: given up)
        assert str(out.error) == ("Interrupted: the start was given up and nothing runs now; "
                                  "run %spmd start again to start the cluster."), out.error
        assert not session(fresh).running
        assert run(fresh, "%spmd restart").error is None
    psum_runs(fresh)


def _wait_exited(km, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not km.is_alive():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def test_shutdown_request_while_a_cell_runs_stops_the_cluster_once(tmp_path):
    """Jupyter's shutdown comes on the control thread while the main thread waits for a cell
    that sleeps on every rank: the kernel ends by itself within seconds, with no error in
    its log, and nothing it started is left."""
    from jupyter_client.manager import KernelManager

    log = open(tmp_path / "kernel.log", "w")
    km = KernelManager(kernel_name=SPMD_KERNEL)
    km.start_kernel(stdout=log, stderr=subprocess.STDOUT)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply = kc.execute_interactive("import os; print(os.getpid())", timeout=120)
        assert reply["content"]["status"] == "ok"
        kernel_pid = km.provisioner.pid
        ranks = spmd_processes(parent_pid=kernel_pid)  # (and the controller, the server)
        assert len([p for p in ranks if p.name().startswith("spmd-rank")]) >= 2, ranks
        began = tmp_path / "began"
        began.mkdir()
        kc.execute(f"import os, time\nopen(os.path.join({str(began)!r}, str(os.getpid())), "
                   "'w').close()\ntime.sleep(60)")
        deadline = time.monotonic() + 60
        while len(os.listdir(began)) < 2:  # the cell runs on the ranks; the main thread waits
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # (into the sleep)
        km.request_shutdown()
        took = _wait_exited(km, 20)
        assert took is not None, "the kernel did not end after its shutdown request"
        assert km.provisioner.process.returncode == 0  # it ended itself, not killed
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        log.close()
    assert not wait_until_gone(ranks, 10)
    text = (tmp_path / "kernel.log").read_text()
    assert "Traceback" not in text, text


def test_a_start_that_retries_keeps_its_compilation_cache(fresh, monkeypatch):
    """The coordinator's port, chosen free, is taken by another program before rank 0 binds
    it: the start tries once more, and the ranks still share the compilation cache."""
    from spmd.cluster import startup

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = startup.loopback_ports
    calls = []

    def first_taken(backend: str) -> dict[str, str]:
        calls.append(backend)
        if len(calls) == 1:
            return {"jax": f"127.0.0.1:{taken.getsockname()[1]}"}
        return chosen(backend)

    monkeypatch.setattr(startup, "loopback_ports", first_taken)
    try:
        out = run(fresh, "%spmd start -n 2")
    finally:
        taken.close()
    assert out.error is None, out.stdout + out.stderr
    assert len(calls) == 2  # the first start failed on the taken port, the second worked
    from test_rank_server import JITTED

    assert run(fresh, SETUP).error is None
    folder = run(fresh, "print(jax.config.jax_compilation_cache_dir)").stdout.split()[-1]
    assert os.path.isdir(folder), folder
    first = run(fresh, JITTED)
    assert first.error is None
    entries = {n for n in os.listdir(folder) if n.startswith("jit_steps")}
    assert len(entries) == 2, entries  # one per rank: each process has its own key
    assert run(fresh, "%spmd restart").error is None
    assert run(fresh, SETUP).error is None
    assert run(fresh, JITTED).stdout == first.stdout
    assert {n for n in os.listdir(folder) if n.startswith("jit_steps")} == entries


def test_a_rank_whose_registration_the_notebook_missed_is_found(fresh, monkeypatch):
    """ipyparallel's client hears of engines from its connection reply, then from
    notifications on a SUB socket it connects after that reply: an engine that completes its
    registration in between is never announced to it (seen with ranks on other hosts, whose
    CurveZMQ subscription is slow to hold). Here neither path tells the client of engine 0,
    as in that race; the start still finds it, from the controller's own list."""
    from spmd.cluster.channel.client import SpmdClient

    hidden = []
    update_engines = SpmdClient._update_engines

    def update_without_engine_0(self, engines):
        caller = sys._getframe(1).f_code.co_name
        if caller in ("_connect", "_register_engine"):  # (the reply, the notification)
            hidden.extend(k for k in engines if int(k) == 0)
            engines = {k: v for k, v in engines.items() if int(k) != 0}
        update_engines(self, engines)

    monkeypatch.setattr(SpmdClient, "_update_engines", update_without_engine_0)
    out = run(fresh, "%spmd start -n 2 --start-timeout 60")
    assert out.error is None, out.error
    assert hidden == [0]  # (it was hidden once, by one of the two paths)
    assert session(fresh).record().client.ids == [0, 1]
    psum_runs(fresh)


def test_starts_and_stops_leave_no_descriptors_open_in_the_notebook(fresh):
    """Each start had left the cluster's event loop (its selector and self-pipe) and the rank
    server's pipe open: a notebook that starts and stops all day ran out of descriptors."""
    def cycle() -> None:
        for line in ("%spmd start -n 2 --backend none", "x = 1", "%spmd restart", "%spmd stop"):
            assert run(fresh, line).error is None, line

    cycle()  # (the first start opens what stays for the process's life: zmq's context)
    before = set(os.listdir("/proc/self/fd"))
    cycle()
    cycle()
    left = {fd: os.readlink(f"/proc/self/fd/{fd}")
            for fd in set(os.listdir("/proc/self/fd")) - before
            if os.path.exists(f"/proc/self/fd/{fd}")}
    assert left == {}


def test_a_shutdown_while_the_main_thread_takes_the_kernels_start_raises_nothing(fresh):
    """ipykernel's control thread runs the shutdown while the main thread may take the
    kernel's background start (``pending`` becomes None). A trace on the shutdown's thread
    makes that land at the worst moment for certain: right after the shutdown's first line
    that reads ``pending``, before the next one runs."""
    import linecache

    from spmd.magics.commands.lifecycle import Lifecycle
    from spmd.magics.start.arguments import start_settings
    from spmd.magics.start.background import BackgroundStart

    magics = fresh.magics_manager.registry["SpmdMagics"]
    _opts, settings = start_settings(["-n", "2", "--backend", "none"])
    # (a start refused at once: nothing runs, and its cancel still has its session to end)
    pending = BackgroundStart(settings, refused="%spmd start: not wanted here.")
    before = magics.session, magics.starting
    magics.pending, magics.session, magics.starting = pending, None, None
    code, taken, errors = Lifecycle.shutdown.__code__, [], []
    previous = [""]

    def trace(frame, event, _arg):
        return lines if frame.f_code is code else None

    def lines(frame, event, _arg):
        if event == "line":
            if not taken and "self.pending" in previous[0]:
                magics.pending = None  # (what _take_pending does on the main thread)
                taken.append(frame.f_lineno)
            previous[0] = linecache.getline(code.co_filename, frame.f_lineno)
        return lines

    def shut_down() -> None:
        sys.settrace(trace)
        try:
            magics.shutdown()
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=shut_down)
    try:
        thread.start()
        thread.join(30)
        assert taken, "the trace never came between the shutdown's read of pending and its use"
        assert not errors, errors
        assert pending.session.cancelled.is_set()  # (the start it had read was given up)
    finally:
        magics._shutting_down = False
        magics.pending = None
        magics.session, magics.starting = before


def test_the_heart_monitor_ends_with_a_controller_killed_outright(tmp_path):
    """A controller SIGKILLed (the launcher's kill one second after its SIGTERM, on a busy
    machine) cannot end the heart monitor it forked: the monitor ends by itself."""
    controller = subprocess.Popen(
        [sys.executable, "-m", "spmd.controller", f"--profile-dir={tmp_path}",
         "--ip=127.0.0.1", "--IPController.use_threads=True", "--IPController.db_class=NoDB",
         "--log-level=WARN"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        monitors = []
        while not monitors and time.monotonic() < deadline:
            monitors = psutil.Process(controller.pid).children()
            time.sleep(0.1)
        assert monitors, "the controller started no heart monitor"
        controller.kill()
        controller.wait()
        assert not wait_until_gone(monitors, 10)
    finally:
        controller.kill()
        controller.wait()
