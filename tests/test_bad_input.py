"""Bad input: one UsageError with one clear sentence, and nothing left running."""

from __future__ import annotations

import shutil
import time

import pytest
from conftest import run, spmd_processes
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(120)


def usage_error(shell, line: str) -> str:
    out = run(shell, line)
    assert isinstance(out.error, UsageError), f"{line!r} gave {out.error!r}"
    left = spmd_processes()
    assert not left, f"{line!r} left processes running: {[p.cmdline() for p in left]}"
    return str(out.error)


@pytest.mark.parametrize(
    "line, says",
    [
        ("%spmd start -n 0", "-n must be a whole number of at least 1, like -n 4, not '0'"),
        ("%spmd start -n -3", "-n must be a whole number of at least 1"),
        ("%spmd start -n x", "-n must be a whole number of at least 1, like -n 4, not 'x'"),
        ("%spmd start", "the following arguments are required: -n"),
        ("%spmd start -n 2 --bogus", "unrecognized arguments: --bogus"),
        (
            "%spmd start -n 2 --devices-per-process 0",
            "--devices-per-process must be a whole number",
        ),
        (
            "%spmd start -n 2 --backend tensorflow",
            "--backend takes jax, torch, jax,torch or none, not 'tensorflow'",
        ),
        ("%spmd start -n 2 --timeout -1", "a timeout is a number of seconds above 0"),
        ("%spmd launch -n 2", "%spmd has no command 'launch'"),
        ("%spmd", "Say what to do"),
        ('%spmd start -n "2', "%spmd start -n \"2: no closing quotation: close the quote"),
        ('%%spmd --timeout "1\nprint(1)', '%%spmd --timeout "1: no closing quotation'),
        ('%spmd push x"', "no closing quotation"),
        ("%spmd start -n 2 --timeout nan", "a timeout is a number of seconds above 0, not 'nan'"),
        ("%spmd start -n 2 --timeout inf", "a timeout is a number of seconds above 0, not 'inf'"),
        ("%spmd start -n 2 --grace nan", "--grace takes seconds (like 2) or off, not 'nan'"),
        ("%%spmd --grace nan\nprint(1)", "--grace takes seconds (like 2) or off, not 'nan'"),
        ("%spmd start -n 100000", "-n 100000 is more ranks than this machine has room for"),
        (
            "%spmd start -n 2 --launcher local --hosts a,b",
            "--hosts is for ranks on other hosts: add --launcher ssh, mpi or slurm.",
        ),
        ("%spmd start -n 2 --launcher ssh", "--launcher ssh needs --hosts, like --hosts node1"),
        ("%spmd start -n 2 --launcher pbs", "invalid choice: 'pbs'"),
        ("%spmd start -n 2 --hosts a,a", "--hosts names a host twice (a,a): give each host once"),
        ("%spmd start -n 2 --hosts a:x", "--hosts takes host names with an optional count"),
        ("%spmd start -n 4 --hosts a:1,b:2", "the counts in --hosts a:1,b:2 add up to 3, not -n 4"),
        ("%spmd start -n 1 --hosts a,b", "-n 1 is fewer ranks than the 2 hosts given"),
        ("%spmd start -n 2 --launcher mpi --launcher-arg oops", "--launcher-arg takes KEY=VALUE"),
        (
            "%spmd start -n 2 --launcher mpi --launcher-arg colour=red",
            "the mpi launcher has no setting 'colour'; its settings are:",
        ),
        (
            "%spmd start -n 2 --launcher-arg mpi_args=-v",
            "--launcher-arg is for ranks on other hosts: add --launcher ssh, mpi or slurm.",
        ),
        ("%spmd start -n 2 --python /nonexistent/python", "--python /nonexistent/python is not"),
        ("%spmd start -n 2 --gpus-per-process x", "--gpus-per-process takes a whole number"),
        ("%spmd gather x --max-bytes 1e400", "--max-bytes takes a number of bytes, like 1e9"),
        ("%spmd gather x -o", "-o takes a variable name, like %spmd gather x -o full."),
        ("%spmd gather x --max-bytes", "--max-bytes takes a number of bytes"),
    ],
)
def test_bad_start_lines(shell, line, says):
    assert says in usage_error(shell, line)


@pytest.mark.parametrize(
    "line",
    [
        "%%spmd\nprint(1)",
        "%spmd stop",
        "%spmd status",
        "%spmd interrupt",
        "%spmd where",
        "%spmd sharding x",
        "%spmd gather x",
        "%spmd push x",
    ],
)
def test_commands_that_need_a_cluster_say_how_to_start_one(shell, line):
    # as in a fresh notebook: no cluster was ever started (earlier modules stopped theirs)
    shell.magics_manager.registry["SpmdMagics"].session = None
    shell.user_ns["x"] = 1
    assert (
        usage_error(shell, line) == "No SPMD cluster is running: start one with %spmd start -n 4."
    )


def test_second_start_says_stop_or_restart_first(shell):
    assert run(shell, "%spmd start -n 2 --backend none").error is None
    try:
        before = {p.pid for p in spmd_processes()}
        out = run(shell, "%spmd start -n 2")
        assert isinstance(out.error, UsageError)
        assert "already running: use %spmd stop or %spmd restart first" in str(out.error)
        assert {p.pid for p in spmd_processes()} == before  # nothing new started
        bad_ranks = run(shell, "%%spmd --ranks 0,5\nprint(1)")
        assert "--ranks 0,5: this cluster has ranks 0-1." in str(bad_ranks.error)
    finally:
        run(shell, "%spmd stop")


def test_jax_missing_in_the_engines_environment(shell, tmp_path, monkeypatch):
    # A jax that cannot be imported, first on the engines' path: as if it were not installed.
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'jax'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    message = usage_error(shell, "%spmd start -n 2")
    assert message.startswith("jax cannot be imported in the engines' Python (")
    assert "No module named 'jax')" in message  # why, as the engine's Python said it
    assert message.endswith("install it there, or start with --backend none.")


def test_a_rank_whose_join_hangs_is_named_with_where_it_waits(shell, tmp_path, monkeypatch):
    """A rank that is still joining when the start's time is nearly over says where it is (as
    a hang in jax.distributed.initialize would), instead of a bare "did not initialize"; and
    nothing of the start is left."""
    fake = tmp_path / "jax"  # (a jax whose import never ends, on every rank's join thread)
    fake.mkdir()
    (fake / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    t0 = time.monotonic()
    message = usage_error(shell, "%spmd start -n 2 --rank-server off --start-timeout 6")
    assert time.monotonic() - t0 < 30
    assert message.startswith("Rank ") and (" failed to initialize: StillJoining: still "
                                            "joining after 3 s, at:\n") in message, message
    assert f'File "{fake}/__init__.py", line 2, in <module>' in message, message
    assert "time.sleep(60)" in message and "<frozen" not in message, message


def test_jax_initialized_in_the_notebook_warns(shell):
    import jax

    jax.devices()  # the notebook process now has backends: it must not join the job
    out = run(shell, "%spmd start -n 2 --backend none")
    try:
        assert out.error is None
        assert "Warning: jax has initialized its backends in this notebook process" in out.stderr
    finally:
        run(shell, "%spmd stop")


@pytest.mark.parametrize("hub", ["ignores", "ends"])
def test_a_controller_that_does_not_answer_fails_the_start_with_its_last_lines(
        shell, tmp_path, monkeypatch, hub):
    # The controller's hub takes a connection request and answers none, or ends its process
    # there: the start ends at the hub's wait and says whether the controller runs and what
    # it wrote, not ipyparallel's bare timeout.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if b'spmd.controller' in open('/proc/self/cmdline', 'rb').read():\n"
        "    from ipyparallel.controller import hub\n"
        "    def request(self, client_id, msg):\n"
        f"        print('the hub {hub} at a connection request', file=sys.stderr, flush=True)\n"
        f"        {'os._exit(7)' if hub == 'ends' else 'pass'}\n"
        "    hub.Hub.connection_request = request\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from spmd.cluster import startup

    monkeypatch.setattr(startup, "HUB_SECONDS", 3)
    out = run(shell, "%spmd start -n 2 --backend none")
    assert isinstance(out.error, UsageError), out.error
    message = str(out.error)
    # (a controller that ended by itself leaves its heart monitor, which ends within 0.5 s
    # of it: hearts.py)
    deadline = time.monotonic() + 5
    while spmd_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not spmd_processes()
    assert message.startswith(
        "The controller did not answer the notebook within 3 s (its process still runs): "
        "start again." if hub == "ignores" else
        "The controller's process ended during start-up (exit code 7): start again."
    ), message
    assert f"the hub {hub} at a connection request" in message


@pytest.mark.parametrize("handle", ["taken", "too late"])
def test_an_engine_that_dies_at_start_fails_the_start_at_once(shell, tmp_path, monkeypatch,
                                                              handle):
    # sitecustomize runs first in every new Python on the path: rank 1's process exits at
    # once; a rank forked by the rank server (whose sitecustomize ran with no rank) exits as
    # it enters its folder, once its rank is set, before its engine starts
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "def exit_if_rank_1(*_):\n"
        "    if os.environ.get('SPMD_RANK') == '1':\n"
        "        print('rank 1 cannot start', file=sys.stderr, flush=True)\n"
        "        os._exit(3)\n"
        "exit_if_rank_1()\n"
        "sys.addaudithook(lambda event, args: event == 'os.chdir' and exit_if_rank_1())\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    if handle == "too late":
        # The notebook takes a forked rank's handle after every fork is asked for: rank 1
        # may have ended, and been reaped by the server, by then. It is still told as an exit.
        from spmd.cluster.launchers.servers import RankServer

        forked = RankServer.forked
        reaped = []

        def forked_then_reaped(self, key, timeout=30.0):
            pid = forked(self, key, timeout)
            if key.endswith("/1"):
                assert self.exit_code(pid, timeout=20)[0]
                reaped.append(pid)
            return pid

        monkeypatch.setattr(RankServer, "forked", forked_then_reaped)
    t0 = time.monotonic()
    message = usage_error(shell, "%spmd start -n 2 --backend none")
    assert time.monotonic() - t0 < 30  # not the 120 s registration timeout
    assert message.startswith("An engine process exited during start-up (rank 1, exit code 3)")
    assert "rank 1 cannot start" in message
    if handle == "too late":
        assert len(reaped) == 1  # (the rank server forked it, and it was gone before its handle)


def test_the_controller_writes_its_connection_file_whole(tmp_path):
    # Engines poll for this file while the controller writes it; they must never read half
    # of it (a JSONDecodeError killed an engine at start about once in 60 starts).
    import json
    import logging
    import threading
    from types import SimpleNamespace

    from spmd.controller.start import save_connection_dict

    controller = SimpleNamespace(
        profile_dir=SimpleNamespace(security_dir=str(tmp_path)), log=logging.getLogger("test")
    )
    path = tmp_path / "ipcontroller-engine.json"
    big = {"key": "k" * 4_000_000, "interface": "tcp://127.0.0.1"}
    torn, done = [], threading.Event()

    def engine_polling():
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except json.JSONDecodeError:
                torn.append(len(text))

    reader = threading.Thread(target=engine_polling)
    reader.start()
    try:
        for _ in range(5):
            save_connection_dict(controller, path.name, big)
            path.unlink()
    finally:
        done.set()
        reader.join()
    assert not torn, f"an engine could read a half-written file ({len(torn)} times)"
    save_connection_dict(controller, path.name, big)
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left


def test_a_killed_notebooks_profile_folder_is_removed_by_the_next_start(shell):
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    import psutil

    gone = subprocess.Popen(["sleep", "0"])
    created = psutil.Process(gone.pid).create_time()
    gone.wait()
    stale = Path(tempfile.mkdtemp(prefix="spmd-"))
    (stale / "owner.json").write_text(json.dumps({"pid": gone.pid, "create_time": created}))
    (stale / "log").mkdir()
    me = psutil.Process()
    alive = Path(tempfile.mkdtemp(prefix="spmd-"))  # another notebook's, still running
    (alive / "owner.json").write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))
    try:
        out = run(shell, "%spmd start -n 1 --backend none")
        assert out.error is None, out.stdout
        assert not stale.exists() and alive.exists()
    finally:
        run(shell, "%spmd stop")
        shutil.rmtree(alive, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
