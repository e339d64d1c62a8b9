"""A cluster whose notebook process died lingers, and a new notebook process attaches to it
(spmd/cluster/linger.py): real kernels killed with SIGKILL, real ranks, real jax."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import kernel_stream, spmd_processes, wait_until_gone
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
    spmd_cli("stop", "--all")  # (a test that failed half-way leaves nothing lingering)


def kernel(env):
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    return km, kc


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
    time.sleep(3)  # (past the watch's period: nothing ended with the notebook)
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
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --linger 5s")
        folders = run_ok(kc, "%%local\ns = get_ipython().magics_manager.registry['SpmdMagics'].session\n"
                             "print(s.profile_dir, s.cache_dir)").split()
        assert all(os.path.isdir(f) for f in folders)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert started
    gone_at = time.monotonic()
    assert not wait_until_gone(started, timeout=5 + 15)
    assert time.monotonic() - gone_at > 4  # (it lingered)
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
    assert linger.lingering() and not linger.lingering()[0].held_by()
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


LATE_CELL = """import os, time
for i in range(6):
    print('step', i, flush=True)
    time.sleep(0.5)
if os.environ['SPMD_RANK'] == '1':
    raise ValueError('rank 1 failed late')
"""


@pytest.mark.timeout(240)
def test_a_cell_running_when_the_notebook_died_is_reported_at_attach(runtime):
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 2m")
        kc.execute(LATE_CELL)
        time.sleep(1.2)  # (a step or two printed while the notebook was there)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    time.sleep(4)  # (the cell ends meanwhile, with nobody to tell)
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


@pytest.mark.timeout(120)
def test_a_notebook_killed_once_its_stop_began_leaves_nothing_lingering(runtime):
    """Jupyter kills a kernel whose shutdown takes too long: a stop that had begun has
    disarmed the linger, so the ranks end with the kernel, and no record is left."""
    km, kc = kernel(runtime)
    try:
        run_ok(kc, "%load_ext spmd\n%spmd start -n 2 --backend none --linger 5m")
        run_ok(kc, "%%local\nfrom spmd.cluster import linger\n"
                   "linger.disarm(get_ipython().magics_manager.registry['SpmdMagics']"
                   ".session.launch)")  # (what a stop or a shutdown does first)
    finally:
        pid = kill(km, kc)
    started = spmd_processes(pid)
    assert started and not wait_until_gone(started, timeout=10)
    assert not [r for r in os.listdir(runtime["JUPYTER_RUNTIME_DIR"]) if r.startswith("spmd-")]
