"""A cluster whose notebook process died lingers, and a new notebook process attaches to it
(spmd/cluster/linger.py): real kernels killed with SIGKILL, real ranks, real jax."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from conftest import SPMD_KERNEL, kernel_stream, spmd_processes, wait_until_gone
from jupyter_client.manager import start_new_kernel

NOTEBOOK = "/work/notebooks/linger-test.ipynb"
PSUM = ("print(jax.pmap(lambda v: jax.lax.psum(v, 'i'), axis_name='i')"
        "(jnp.ones(jax.local_device_count())))")


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """A Jupyter runtime folder of the test's own (the records live there), in the
    environment of this process and of the kernels it starts."""
    folder = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(folder))
    yield dict(os.environ, JUPYTER_RUNTIME_DIR=str(folder), JPY_SESSION_NAME=NOTEBOOK)
    # (a test that failed half-way leaves nothing lingering; stop --all reads the records)
    if folder.is_dir() and any(p.name.startswith("spmd-cluster-") for p in folder.iterdir()):
        spmd_cli("stop", "--all")


def kernel(env):
    try:
        return start_new_kernel(kernel_name="python3", env=env)
    except RuntimeError as exc:
        # (jupyter_client picks the kernel's ports free, and the kernel binds them a moment
        # later: with two workers starting processes, one was taken meanwhile; once more)
        if "died before replying" not in str(exc):
            raise
        return start_new_kernel(kernel_name="python3", env=env)


def run_ok(kc, code: str) -> str:
    reply, text = kernel_stream(kc, code)
    assert reply["content"]["status"] == "ok", text + str(reply["content"])
    return text


def kill(km, kc) -> int:
    """SIGKILL the kernel (no atexit, no stop): its pid."""
    pid = km.provisioner.process.pid
    kc.stop_channels()
    os.kill(pid, signal.SIGKILL)
    km.provisioner.process.wait()
    km.cleanup_resources()
    return pid


def spmd_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True,
                          timeout=60)


def wait_for(ready, what: str, timeout: float = 30) -> None:
    """Until ``ready()``, looked at every 0.05 s; a failure naming ``what`` after
    ``timeout`` seconds (only a hang gets there)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.05)


def rank_logs_with(text: str) -> int:
    """How many of the lingering cluster's processes' own logs (a rank's output file) hold
    ``text``."""
    from spmd.cluster import linger

    folder = os.path.join(linger.choose().profile_dir, "log")
    found = 0
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name), errors="replace") as f:
                found += text in f.read()
        except OSError:
            continue
    return found


def wait_for_the_ranks_to_see_the_notebook_gone(ranks: int = 2) -> None:
    """Until every rank has found its notebook gone (the line it writes to its log then: its
    watch looks every second)."""
    from spmd.engine.life.unattended import GONE_LINE

    wait_for(lambda: rank_logs_with(GONE_LINE) >= ranks, "the ranks finding the notebook gone")


def wait_for_the_cell_to_end_unattended(ranks: int = 2) -> None:
    """Until every rank has written, to its log, how its cell ended with no notebook."""
    from spmd.engine.life.unattended import CELL_ENDED

    wait_for(lambda: rank_logs_with(CELL_ENDED) >= ranks, "the cell's end in the ranks' logs")


@pytest.mark.timeout(240)
def test_a_killed_notebooks_ranks_keep_x_and_a_new_kernel_attaches(runtime):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --linger 2m")
        run_ok(kc, "import jax, jax.numpy as jnp\nx = jnp.arange(3) + jax.process_index()")
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert len(started) >= 4  # the rank server, two ranks, the controller
    # (each found the notebook gone, and lingers: nothing ended with the notebook)
    from spmd.cluster import linger

    record = linger.choose()
    wait_for(lambda: linger.gone_at(record) is not None, "the controller finding it gone")
    wait_for_the_ranks_to_see_the_notebook_gone()
    time.sleep(0.5)
    assert all(p.is_running() for p in started)
    listed = spmd_cli("list")
    assert listed.returncode == 0 and NOTEBOOK in listed.stdout, listed.stdout

    km, kc = kernel(runtime)
    try:
        text = run_ok(kc, "%load_ext spmd\n%spmd attach")  # (this notebook's, by its path)
        assert "Attached to cluster" in text and "2 ranks (jax)" in text, text
        assert run_ok(kc, "print(x)") == "[rank 0] [0 1 2]\n[rank 1] [1 2 3]\n"
        assert run_ok(kc, PSUM) == "[ranks 0-1] [2.]\n"
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
        assert spmd_cli("list").stdout.strip() == "No cluster of this user runs."
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(180)
def test_a_linger_never_attached_ends_every_process_folder_and_record(runtime):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --linger 3s")
        folders = run_ok(kc, "%%local\ns = get_ipython().magics_manager.registry['SpmdMagics'].session\n"
                             "print(s.record().profile_dir, s.record().cache_dir)").split()
        assert all(os.path.isdir(f) for f in folders)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert started
    gone_at = time.monotonic()
    assert not wait_until_gone(started, timeout=3 + 15)
    # (it lingered: with none, each ends within its watch's second of the notebook's end)
    assert time.monotonic() - gone_at > 2.5
    assert not any(os.path.exists(f) for f in folders), folders
    records = os.listdir(runtime["JUPYTER_RUNTIME_DIR"])
    assert not [r for r in records if r.startswith("spmd-cluster-")], records


@pytest.mark.timeout(240)
def test_attach_refuses_in_one_sentence_and_the_terminal_stops_a_cluster(runtime):
    km, kc = kernel(runtime)
    try:
        reply, text = kernel_stream(kc, "%load_ext spmd\n%spmd attach")
        assert reply["content"]["status"] == "error"
        assert "No cluster is lingering to attach: start one with %spmd start." in text + str(
            reply["content"]["evalue"])
        run_ok(kc, "%spmd start -n 2 --backend none --linger 1m")
        record = next(r for r in os.listdir(runtime["JUPYTER_RUNTIME_DIR"])
                      if r.startswith("spmd-cluster-"))
        assert os.stat(os.path.join(runtime["JUPYTER_RUNTIME_DIR"], record)).st_mode & 0o077 == 0
        cluster_id = record[len("spmd-cluster-"):-len(".json")]
        other_km, other_kc = kernel(runtime)
        try:  # a second notebook cannot take a cluster a live one holds
            reply, _ = kernel_stream(other_kc, f"%load_ext spmd\n%spmd attach {cluster_id}")
            assert reply["content"]["status"] == "error"
            assert "is attached to notebook process" in reply["content"]["evalue"]
            reply, _ = kernel_stream(other_kc, "%spmd attach nosuchid")
            assert "No cluster has the id 'nosuchid'" in reply["content"]["evalue"]
        finally:
            other_kc.stop_channels()
            other_km.shutdown_kernel(now=True)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert started
    from spmd.cluster import attach, linger
    from spmd.cluster.session import Session

    # another version of jax or of this project: refused, and nothing changed
    path = os.path.join(runtime["JUPYTER_RUNTIME_DIR"], record)
    with open(path) as f:
        kept = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(kept, versions=dict(kept["versions"], jax="0.0.1")), f)
    chosen = linger.choose(cluster_id)
    with pytest.raises(linger.AttachError, match="runs jax 0.0.1, .*python -m spmd stop"):
        attach.attach(Session(chosen.the_settings()), chosen)
    with open(path, "w") as f:
        json.dump(kept, f)
    assert [r.held_by() for r in linger.every()] == [0]  # (nothing changed: it lingers on)
    chosen = linger.choose()  # (the only one lingering)
    stopped = spmd_cli("stop", cluster_id)
    assert stopped.returncode == 0, stopped.stderr
    assert f"Stopped cluster {cluster_id} (2 ranks)." in stopped.stdout
    assert not wait_until_gone(started, timeout=10)
    # ended between the list and the attach
    with pytest.raises(linger.AttachError, match="has ended: start one with %spmd start"):
        attach.attach(Session(chosen.the_settings()), chosen)
    assert spmd_cli("list").stdout.strip() == "No cluster of this user runs."
    assert spmd_cli("stop", "nosuchid").returncode == 1


@pytest.mark.timeout(120)
def test_linger_zero_ends_the_ranks_with_the_notebook(runtime):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 0")
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert started and not wait_until_gone(started, timeout=10)
    assert not [r for r in os.listdir(runtime["JUPYTER_RUNTIME_DIR"]) if r.startswith("spmd-")]


def late_cell(folder) -> str:
    """A cell that prints a step, says it began (a file in ``folder``), waits for a file
    ``go`` there, prints the other steps, and fails on rank 1."""
    return f"""import os, time
for i in range(6):
    print('step', i, flush=True)
    if i == 0:
        open(os.path.join({str(folder)!r}, 'began-' + os.environ['SPMD_RANK']), 'w').close()
        while not os.path.exists(os.path.join({str(folder)!r}, 'go')):
            time.sleep(0.05)
    time.sleep(0.05)
if os.environ['SPMD_RANK'] == '1':
    raise ValueError('rank 1 failed late')
"""


def began(folder, ranks: int = 2) -> None:
    """Until the cell of ``late_cell(folder)`` (or one like it) runs on every rank."""
    wait_for(lambda: len([n for n in os.listdir(folder) if n.startswith("began-")]) >= ranks,
             "the cell beginning on the ranks")


@pytest.mark.timeout(240)
def test_a_cell_running_when_the_notebook_died_is_reported_at_attach(runtime, tmp_path):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 2m")
        kc.execute(late_cell(tmp_path))
        began(tmp_path)  # (a step printed while the notebook was there)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    # (the cell goes on once the ranks print to their logs, and ends with nobody to tell)
    wait_for_the_ranks_to_see_the_notebook_gone()
    (tmp_path / "go").touch()
    wait_for_the_cell_to_end_unattended()
    km, kc = kernel(runtime)
    try:
        text = run_ok(kc, "%load_ext spmd\n%spmd attach")
        assert ("The cell that ran meanwhile ('import os, time') ended without an error on "
                "rank 0; raised ValueError: rank 1 failed late on rank 1.") in text, text
        assert "While no notebook was attached they printed: rank 0 " in text, text
        log = run_ok(kc, "%spmd log 1")  # (what it printed once it found the notebook gone)
        assert "--- cell 1: (while no notebook was attached)\n" in log and "step 5" in log, log
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("spmd_kernelspec")
def test_a_kernel_killed_while_its_shutdown_waits_leaves_nothing_lingering(runtime):
    """Jupyter kills a kernel whose shutdown takes too long: the shutdown disarmed the linger
    as it began, so the ranks end with the kernel, and no record is left. Here the shutdown
    waits for a cell held at a rank's input() prompt that nobody answers (the stop waits up
    to 4 s for it), and the kernel is killed meanwhile."""
    km, kc = start_new_kernel(kernel_name=SPMD_KERNEL, env=runtime)
    try:
        run_ok(kc, "x = 1")  # (its cluster is up, lingering should the kernel die)
        assert [r for r in os.listdir(runtime["JUPYTER_RUNTIME_DIR"])
                if r.startswith("spmd-cluster-")]
        started = spmd_processes(km.provisioner.process.pid)
        assert started
        from spmd.cluster import linger
        from spmd.cluster.launchers import profiles
        from spmd.engine.life.orphans import read_owner

        (record,) = linger.every()  # (held by the kernel)
        owner = os.path.join(record.profile_dir, profiles.OWNER_FILE)
        assert "keeper" in read_owner(owner)
        kc.execute("input('? ')", allow_stdin=True)
        assert kc.get_stdin_msg(timeout=60)["msg_type"] == "input_request"
        kc.shutdown()  # (Kernel > Shut Down: on the control channel)
        # (the shutdown began: its record gone, no keeper of the folders; then it waits)
        wait_for(lambda: not linger.every() and "keeper" not in read_owner(owner),
                 "the shutdown disarming the linger")
    finally:
        kill(km, kc)
    assert not wait_until_gone(started, timeout=15)
    assert not [r for r in os.listdir(runtime["JUPYTER_RUNTIME_DIR"]) if r.startswith("spmd-")]


def notebook_killed_in_a_cell(runtime, start: str, cell: str, folder) -> int:
    """A kernel that starts a cluster with ``start``, runs ``cell`` on the ranks, and is
    killed once every rank runs it (as ``began_line(folder)`` in the cell says): its pid."""
    km, kc = kernel(runtime)
    try:
        run_ok(kc, f"%load_ext spmd\n{start}")
        kc.execute(cell)
        began(folder)
    finally:
        pid = kill(km, kc)
    return pid


def began_line(folder) -> str:
    """A cell's line that says the rank runs it (a file in ``folder``, which ``began`` waits
    for)."""
    return (f"open(os.path.join({str(folder)!r}, 'began-' + os.environ['SPMD_RANK']), "
            "'w').close()\n")


FOREVER = "import time\nwhile True:\n    time.sleep(0.1)"


@pytest.mark.timeout(240)
def test_spmd_interrupt_reaches_the_cell_that_ran_when_the_notebook_died(runtime, tmp_path):
    pid = notebook_killed_in_a_cell(
        runtime, "%spmd start -n 2 --backend none --linger 2m",
        "import os\n" + began_line(tmp_path) + FOREVER, tmp_path)
    started = spmd_processes(pid)
    km, kc = kernel(runtime)
    try:
        text = run_ok(kc, "%load_ext spmd\n%spmd attach")
        assert "Ranks 0-1 still run the cell that was running when the notebook process " \
               "ended" in text, text
        text = run_ok(kc, "%spmd interrupt")  # (before: "there is nothing to interrupt")
        assert text == "Interrupted ranks 0-1; every rank is idle now.\n", text
        text = run_ok(kc, "print('next')")
        assert "[rank 1, in a cell from before the attach]" in text, text
        assert "KeyboardInterrupt" in text, text
        assert ("The cell that was running when the notebook process ended has now ended "
                "with KeyboardInterrupt on ranks 0-1.") in text, text
        assert text.endswith("[ranks 0-1] next\n"), text
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(240)
def test_what_the_cell_from_before_an_attach_prints_and_how_it_ends_reach_the_notebook(
        runtime, tmp_path):
    go_on = tmp_path / "go-on"
    cell = (f"import os, time\n{began_line(tmp_path)}while not os.path.exists({str(go_on)!r}):\n"
            "    time.sleep(0.1)\n"
            "print('printed after the attach', os.environ['SPMD_RANK'], flush=True)\n"
            "time.sleep(2)\n"
            "if os.environ['SPMD_RANK'] == '1':\n"
            "    raise ValueError('rank 1 failed after the attach')\n")
    pid = notebook_killed_in_a_cell(
        runtime, "%spmd start -n 2 --backend none --linger 2m", cell, tmp_path)
    started = spmd_processes(pid)
    km, kc = kernel(runtime)
    try:
        text = run_ok(kc, "%load_ext spmd\n%spmd attach")
        assert "Ranks 0-1 still run the cell" in text, text
        go_on.touch()
        text = run_ok(kc, "print('next')")  # (before: nothing of it, anywhere)
        assert text.startswith("Waiting for the cell from before the attach to end on ranks "
                               "0-1 (Interrupt stops it)...\n"), text
        for rank in (0, 1):
            assert (f"[rank {rank}, in a cell from before the attach] printed after the "
                    f"attach {rank}\n") in text, text
        assert "ValueError: rank 1 failed after the attach" in text, text
        assert ("The cell that was running when the notebook process ended has now ended "
                "without an error on rank 0; with ValueError: rank 1 failed after the attach "
                "on rank 1.") in text, text
        assert text.endswith("[ranks 0-1] next\n"), text
        assert "printed after the attach 1" in run_ok(kc, "%spmd log 1")
        # (the rank copied it to its own log too, and how the cell ended)
        log = run_ok(kc, "%%local\ns = get_ipython().magics_manager.registry['SpmdMagics']"
                         ".session\nprint(open(s.record().cluster.rank_launchers()[1].output_file)"
                         ".read())")
        assert "printed after the attach 1" in log, log
        assert "--- the cell ended: ValueError: rank 1 failed after the attach | import os" in log
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(240)
def test_a_death_after_an_attach_shows_the_ranks_last_lines_since(runtime):
    """The attach reads each rank's log; a death report afterwards reads it again (before:
    ipyparallel's copy from the attach's read, without the rank's last words)."""
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 2m")
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd attach")
        reply, _ = kernel_stream(
            kc, "import os\nif os.environ['SPMD_RANK'] == '1':\n"
                "    os.write(2, b'the last words after the attach\\n')\n    os._exit(3)")
        assert reply["content"]["status"] == "error"
        said = "\n".join(reply["content"]["traceback"])
        assert "Rank 1" in said and "the last words after the attach" in said, said
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


ARRAY = ("import time, jax, numpy as np\n"
         "from jax.sharding import NamedSharding, PartitionSpec as P\n"
         "mesh = jax.make_mesh((jax.device_count(),), ('i',))\n"
         "x = jax.make_array_from_callback((4,), NamedSharding(mesh, P('i')), "
         "lambda i: np.arange(4.0)[i])")


@pytest.mark.timeout(240)
def test_a_global_array_printed_with_no_notebook_reaches_the_log_as_plain_text(
        runtime, tmp_path):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --linger 2m")
        run_ok(kc, ARRAY)
        kc.execute(f"import os\nopen(os.path.join({str(tmp_path)!r}, 'began-' + "
                   "str(jax.process_index())), 'w').close()\n"
                   f"while not os.path.exists(os.path.join({str(tmp_path)!r}, 'go')):\n"
                   "    time.sleep(0.05)\nprint('x is', x)")
        began(tmp_path)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    # (x is printed with nobody there)
    wait_for_the_ranks_to_see_the_notebook_gone()
    (tmp_path / "go").touch()
    wait_for_the_cell_to_end_unattended()
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd attach")
        log = run_ok(kc, "%spmd log 0")
        assert "x is Array(" in log, repr(log)
        assert "\x00" not in log and "spmd-printed" not in log, repr(log)
        run_ok(kc, "%spmd stop")
        assert not wait_until_gone(started)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.timeout(180)
def test_an_attach_from_a_folder_with_an_owner_file_takes_the_cluster(
        runtime, tmp_path, monkeypatch):
    """A cluster without a compilation cache (--backend none), attached from a folder that
    holds an owner.json (before: take() marked the cluster this process's, then raised a
    TypeError, leaving it held with no session)."""
    from spmd.cluster import attach, linger
    from spmd.cluster.launchers import profiles
    from spmd.cluster.session import Session

    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 1m")
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    here = tmp_path / "here"
    here.mkdir()
    profiles.mark_owner(str(here))
    monkeypatch.chdir(here)
    record = linger.choose()
    assert record.cache_dir is None
    session = Session(record.the_settings())
    try:
        attach.attach(session, record)
        assert [r.held_by() for r in linger.every()] == [os.getpid()]
        assert session.running and len(session.ranks) == 2
    finally:
        session.stop()
    assert not wait_until_gone(started)


def on_the_lock(folder: str) -> tuple[set[int], set[int]]:
    """(the processes holding, those waiting for) the lock on the cluster folder's lock file,
    as /proc/locks lists them."""
    from spmd.engine.life.orphans import LOCK_FILE

    found = os.stat(os.path.join(folder, LOCK_FILE))
    device = (os.major(found.st_dev), os.minor(found.st_dev))
    held, waiting = set(), set()
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            blocked = len(fields) > 1 and fields[1] == "->"
            fields = [fields[0], *fields[2:]] if blocked else fields
            try:
                major, minor, inode = fields[5].split(":")
                pid = int(fields[4])
            except (IndexError, ValueError):
                continue
            if (int(major, 16), int(minor, 16)) == device and int(inode) == found.st_ino:
                (waiting if blocked else held).add(pid)
    return held, waiting


@pytest.mark.timeout(180)
def test_an_attach_as_the_linger_ends_keeps_the_cluster(runtime):
    """A process whose linger is over ends holding the cluster folder's lock, which an attach
    holds while it writes the owner file: one that found the linger over while an attach held
    it reads the new owner, and stays (before: it read the old one, and ended)."""
    from spmd.cluster import linger
    from spmd.cluster.launchers import profiles
    from spmd.engine.life.orphans import folder_lock

    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 2s")
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    record = linger.choose()
    lock = folder_lock(record.profile_dir)  # (an attach under way: linger.take)
    assert lock is not None
    # the processes that watch the owner file: the rank server, the controller, the two
    # ranks (not the controller's heart monitor, which ends with the controller)
    watching = [p for p in started if p.ppid() != record.controller_pid()]
    assert len(watching) == 4, [p.cmdline() for p in started]
    try:
        # (the linger is over for every process: each waits for the lock)
        wait_for(lambda: on_the_lock(record.profile_dir)[1] >= {p.pid for p in watching},
                 "every process waiting for the lock", timeout=2 + 30)
        assert all(p.is_running() for p in started)
        profiles.mark_owner(record.profile_dir)  # (this process holds the cluster now)
    finally:
        os.close(lock)
    # (each took the lock in turn, read the new owner, and let go)
    wait_for(lambda: on_the_lock(record.profile_dir) == (set(), set()), "the lock let go")
    time.sleep(1.5)  # (and looked at the owner once more, a watch's second later)
    assert all(p.is_running() and p.status() != "zombie" for p in started)
    assert [r.held_by() for r in linger.every()] == [os.getpid()]
    stopped = spmd_cli("stop", record.id)
    assert stopped.returncode == 0, stopped.stderr
    assert not wait_until_gone(started)


@pytest.mark.timeout(180)
def test_spmd_list_counts_the_linger_from_when_the_notebook_died(runtime):
    """(before: from the newest write to a rank's log, so a rank that prints always showed
    the whole linger)"""
    talk = ("import threading, time\ndef talk():\n    while True:\n"
            "        print('tick', flush=True)\n        time.sleep(0.3)\n"
            "threading.Thread(target=talk, daemon=True).start()")
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 1m")
        run_ok(kc, talk)
    finally:
        pid = kill(km, kc)
    killed = time.time()
    started = spmd_processes(pid)
    from spmd.cluster import linger

    # (the controller looks every second; until it has found the notebook gone, the list says
    # the whole linger)
    record = linger.choose()
    wait_for(lambda: linger.gone_at(record) is not None, "the controller finding it gone")
    gone = linger.gone_at(record)
    assert killed - 1 <= gone <= killed + 10, (killed, gone)
    # 4 s after: the ranks' logs were written to every 0.3 s meanwhile (counted from the
    # newest write, as before, 1m would be left)
    time.sleep(max(0.0, gone + 4 - time.time()))
    listed = spmd_cli("list").stdout.splitlines()
    assert listed[0].split()[-2:] == ["ENDS", "IN"], listed
    left = linger.parse_duration(listed[1].split()[-1])
    assert 35 <= left <= 57, listed
    assert spmd_cli("stop", "--all").returncode == 0
    assert not wait_until_gone(started)


KILLED_IN_A_CELL = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "spmd")
shell.run_cell(sys.argv[1])
s = shell.magics_manager.registry["SpmdMagics"].session
print("STARTED", s is not None and s.running, flush=True)
shell.run_cell(sys.argv[2])
"""


@pytest.mark.timeout(300)
def test_ssh_ranks_in_a_cell_end_when_the_linger_is_over(runtime, tmp_path):
    """Ranks on other hosts miss the controller's heartbeats only on their event loop, which
    does not turn while a cell runs: each host's rank server ends them itself once the
    controller has ended, at the linger's end (before: they ran on for ever)."""
    from hosts import Hosts, why_not

    reason = why_not()
    if reason:
        pytest.skip(f"no hosts in network namespaces here: {reason}")
    with Hosts(2) as hosts:
        script = tmp_path / "notebook.py"
        script.write_text(KILLED_IN_A_CELL)
        start = (f"%spmd start -n 2 --hosts {','.join(hosts.names)} --python {hosts.python} "
                 f"{hosts.launcher_arg} --backend none --linger 1s")
        # (each rank says it runs the cell with a file in the hosts' shared folder)
        cell = ("%%spmd\nimport os\n"
                f"open(os.path.join({hosts.folder!r}, 'in-the-cell-' + os.environ['SPMD_RANK']"
                "), 'w').close()\n" + FOREVER)
        notebook = subprocess.Popen([sys.executable, str(script), start, cell],
                                    stdout=subprocess.PIPE, text=True)
        try:
            line = next((ln for ln in notebook.stdout if ln.startswith("STARTED")), "")
            assert line.strip() == "STARTED True", line
            here = psutil.Process(notebook.pid).children(recursive=True)
            wait_for(lambda: len([n for n in os.listdir(hosts.folder)
                                  if n.startswith("in-the-cell-")]) == 2,
                     "the cell running on the ranks")
            # (taken before the notebook dies: with a linger of 1 s they may end soon after)
            sshd = {p.pid for p in hosts._sshd}
            there = [psutil.Process(p) for p in hosts.pids() if p not in sshd]
            assert len(there) >= 4  # (a server and a rank on each host)
        finally:
            notebook.kill()
            notebook.wait()
            notebook.stdout.close()
        assert not wait_until_gone(here, 1 + 20)
        assert not wait_until_gone(there, 30)


def test_a_kernel_shut_down_while_its_attach_fails_starts_no_cluster(monkeypatch):
    """The SPMD kernel attaches to its notebook's lingering cluster in the background; a
    shutdown that comes meanwhile cancels it, and the attach then fails: nothing starts
    (before: a whole new cluster started, which lingered after the kernel was gone)."""
    import dataclasses

    from spmd.cluster import attach, linger
    from spmd.cluster.records import Settings, StartError
    from spmd.cluster.session import Session
    from spmd.magics.start.background import BackgroundStart

    settings = Settings(n=2, backend="none")
    record = linger.Record(
        id="ended", pid=1, notebook=NOTEBOOK, started=time.time(), linger=60.0,
        settings=dataclasses.asdict(settings), profile_dir="/nonexistent", cache_dir=None,
        cluster_id="ended", controller={}, controller_started=0.0, engine_set="", engines={},
        rank_server=0)

    def attach_that_fails(session, record):
        session.cancelled.wait(30)  # (the shutdown comes while it attaches)
        raise linger.AttachError("Cluster ended has ended: start one with %spmd start.")

    started = []

    def start(session):
        started.append(session)
        raise StartError("a cluster started")

    monkeypatch.setattr(attach, "attach", attach_that_fails)
    monkeypatch.setattr(Session, "start", start)
    early = BackgroundStart(settings, attach_to=record)
    early.cancel()  # (what the kernel's shutdown does with it)
    assert early.done and started == []
    assert early.error is not None and "cancelled" in str(early.error)


def test_the_folder_lock_is_not_inherited_by_a_fork_and_an_attach_waits_for_it_a_while(
        tmp_path, monkeypatch):
    """A rank that forks (DataLoader workers) while it holds the cluster folder's lock does
    not pass it on: once the rank lets go, an attach takes it (before: flock, whose lock the
    child kept, so the attach waited for ever). A lock held for good makes the attach fail in
    one sentence after a bounded wait."""
    import multiprocessing

    from spmd.cluster import linger
    from spmd.cluster.launchers import profiles
    from spmd.engine.life.orphans import folder_lock, started_at

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the folder made in it)
    folder = profiles.owned_folder("spmd-test-")
    held, go, child_done = (multiprocessing.get_context("fork").Event() for _ in range(3))

    def rank() -> None:  # (holds the lock, forks a worker that lives on, lets go)
        fd = folder_lock(folder)
        worker = multiprocessing.get_context("fork").Process(target=go.wait, args=(30,))
        worker.start()
        os.close(fd)
        held.set()
        worker.join()
        child_done.set()

    process = multiprocessing.get_context("fork").Process(target=rank)
    process.start()
    try:
        assert held.wait(30)
        fd = folder_lock(folder, wait=5)  # (the worker runs on, and holds nothing)
        assert fd is not None
        assert not child_done.is_set()
    finally:
        go.set()
        process.join(30)
    monkeypatch.setattr(linger, "LOCK_SECONDS", 0.3)
    monkeypatch.setattr(linger, "check", lambda record: None)
    record = linger.Record(
        id="locked", pid=os.getpid(), notebook="", started=time.time(), linger=60.0,
        settings={}, profile_dir=folder, cache_dir=None, cluster_id="locked",
        controller={"pid": os.getpid()}, controller_started=started_at(os.getpid()),
        engine_set="", engines={}, rank_server=0)
    here = multiprocessing.get_context("fork")

    def other_process_takes() -> None:
        try:
            linger.take(record)
        except linger.AttachError as exc:
            os._exit(0 if "stayed locked for 0.3 s" in str(exc) else 2)
        os._exit(1)

    other = here.Process(target=other_process_takes)  # (POSIX locks: per process)
    other.start()
    other.join(30)
    assert other.exitcode == 0
    os.close(fd)


def test_an_attach_that_finds_a_process_ended_leaves_the_owner_file_as_it_was(
        tmp_path, monkeypatch):
    """``still_there`` is asked under the lock before the owner file names the new notebook
    (before: after, so the cluster's other processes had reset their linger, and lingered a
    whole linger more once the attach gave the cluster back)."""
    from spmd.cluster import linger
    from spmd.cluster.launchers import profiles
    from spmd.engine.life.orphans import read_owner, started_at

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (the folder made in it)
    folder = profiles.owned_folder("spmd-test-")
    dead = {"pid": 1, "started": -1.0, "keeper": {"pid": os.getpid()}}
    profiles.write_owner(folder, dead)
    monkeypatch.setattr(linger, "check", lambda record: None)
    record = linger.Record(
        id="broken", pid=os.getpid(), notebook="", started=time.time(), linger=60.0,
        settings={}, profile_dir=folder, cache_dir=None, cluster_id="broken",
        controller={"pid": os.getpid()}, controller_started=started_at(os.getpid()),
        engine_set="", engines={}, rank_server=0)
    seen = []

    def still_there() -> None:
        seen.append(read_owner(os.path.join(folder, profiles.OWNER_FILE)))
        raise linger.AttachError("Cluster broken's linger ended as it was attached.")

    with pytest.raises(linger.AttachError, match="linger ended as it was attached"):
        linger.take(record, still_there=still_there)
    assert seen == [dead]
    assert read_owner(os.path.join(folder, profiles.OWNER_FILE)) == dead


class _Client:
    def __init__(self) -> None:
        import collections

        self.late = collections.deque(maxlen=5)
        self.late_dropped = 0


def test_streams_heard_after_a_ranks_log_was_read_reach_the_notebook_in_order():
    """Held streams of a rank whose log was read go only where they came before the read
    began; those after it are kept (before: every held stream of that rank was dropped), in
    the order heard, and what does not fit is counted."""
    from spmd.cluster.adopted import Adopted

    adopted = Adopted({"m": 10}, {10: 0, 11: 1})
    client = _Client()

    def line(engine: int, text: str) -> None:
        adopted.heard(engine, "stream", {"name": "stdout", "text": text}, "m", client.late)

    line(10, "in the log\n")
    adopted.reading(0)
    line(10, "after the read\n")
    line(11, "rank 1, unread\n")
    adopted.release({0}, client.late)
    line(10, "after the release\n")
    assert [item[2]["text"] for item in client.late] == [
        "after the read\n", "rank 1, unread\n", "after the release\n"]
    for i in range(4):
        line(11, f"{i}\n")
    assert len(client.late) == 5 and adopted.take_dropped() == 2


def test_the_attach_reads_only_what_follows_this_deaths_mark(monkeypatch):
    """A rank whose log's last mark is an earlier death's, or whose long log has no mark in
    its tail while the death is new, has not noticed the death yet: none of its lines are said
    to be printed while no notebook was attached (before: they were)."""
    import types

    from spmd.cluster.adopted import Adopted
    from spmd.engine.life.unattended import GONE_LINE, GONE_STAMP
    from spmd.magics.start import away

    now = time.time()

    def mark(at: float) -> str:
        return f"{GONE_LINE}{time.strftime(GONE_STAMP, time.gmtime(at))}; follows ---\n"

    monkeypatch.setattr(away, "ATTACH_TAIL", 100)
    logs = {0: mark(now - 3600) + "an earlier death's line\n",
            1: "x" * 200,
            2: mark(now - 3600) + "old\n" + mark(now) + "printed while away\n"}
    written = {}
    adopted = Adopted({}, {0: 0, 1: 1, 2: 2})
    adopted.gone_at = now
    client = _Client()
    session = types.SimpleNamespace(
        ranks=[0, 1, 2], gen=types.SimpleNamespace(adopted=adopted),
        record=lambda: types.SimpleNamespace(
            cluster=types.SimpleNamespace(output_of=lambda rank, tail: logs[rank]),
            client=client),
        logs=types.SimpleNamespace(begin_cell=lambda title: None, flush=lambda: None,
                                   write=lambda rank, text: written.update({rank: text})))
    printed, ended = away._read_logs(session)
    assert printed == {2: 1} and written == {2: "printed while away\n"}
    adopted.gone_at = now - 60  # (long ago: every rank noticed; rank 1 printed more)
    printed, _ = away._read_logs(session)
    assert set(printed) == {1, 2}


def test_a_question_to_a_controller_that_does_not_answer_is_given_up(monkeypatch):
    """``queue_status``, asked at every cell while the cell from before an attach runs,
    waited for ever on a controller that died; now a few seconds, then nothing is known."""
    import types

    from spmd.cluster import adopted
    from spmd.cluster.channel.client import SpmdClient

    never = types.SimpleNamespace(wait=lambda timeout=None: False)
    client = types.SimpleNamespace(_send=lambda *a, **k: never, _query_stream=None)
    t0 = time.monotonic()
    assert SpmdClient.queue_status_within(client, timeout=0.2) is None
    client.queue_status_within = lambda **k: SpmdClient.queue_status_within(client, 0.2)
    assert adopted._pending(client) is None
    assert time.monotonic() - t0 < 5
