"""Bad input: one UsageError with one clear sentence, and nothing left running."""

from __future__ import annotations

import time

import pytest
from conftest import run, spmd_processes
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(120)


def usage_error(shell, line: str) -> str:
    out = run(shell, line)
    assert isinstance(out.error, UsageError), f"{line!r} gave {out.error!r}"
    assert not spmd_processes(), f"{line!r} left processes running"
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
        ("%spmd start -n 2 --backend tensorflow", "invalid choice: 'tensorflow'"),
        ("%spmd start -n 2 --timeout -1", "a timeout is a number of seconds above 0"),
        ("%spmd launch -n 2", "%spmd has no command 'launch'"),
        ("%spmd", "Say what to do"),
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
    assert message.endswith("install it there, or start with --backend none.")


def test_jax_initialized_in_the_notebook_warns(shell):
    import jax

    jax.devices()  # the notebook process now has backends: it must not join the job
    out = run(shell, "%spmd start -n 2 --backend none")
    try:
        assert out.error is None
        assert "Warning: jax has initialized its backends in this notebook process" in out.stderr
    finally:
        run(shell, "%spmd stop")


def test_an_engine_that_dies_at_start_fails_the_start_at_once(shell, tmp_path, monkeypatch):
    # sitecustomize runs first in every new Python on the path: rank 1's process exits at once
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('SPMD_RANK') == '1':\n"
        "    print('rank 1 cannot start', file=sys.stderr)\n"
        "    os._exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    t0 = time.monotonic()
    message = usage_error(shell, "%spmd start -n 2 --backend none")
    assert time.monotonic() - t0 < 30  # not the 120 s registration timeout
    assert message.startswith("An engine process exited during start-up (rank 1)")
    assert "rank 1 cannot start" in message
