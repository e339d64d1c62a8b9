"""What the project leaves on disk: the ranks' logs outlive a death and a restart (until the
next %spmd start), and a killed notebook's folders are removed by the next notebook's start."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
from conftest import report, run, session, spmd_processes, wait_until_gone

pytestmark = pytest.mark.timeout(180)


# on: the restart forks new ranks, and the logs stay open; off: the death stops the cluster
# (closing the logs), and the restart starts afresh, opening them again to write on in them
@pytest.mark.parametrize("rank_server", ["on", "off"])
def test_a_dead_ranks_log_is_kept_and_named_in_the_report(fresh, rank_server):
    started = run(fresh, f"%spmd start -n 2 --backend none --rank-server {rank_server}")
    assert started.error is None, started.stderr
    assert run(fresh, "import os\nrank = int(os.environ['SPMD_RANK'])").error is None
    assert run(fresh, "print('before', rank)").error is None
    died = run(fresh, "if rank == 1:\n    os._exit(3)\nimport time; time.sleep(30)")
    text = report(died)
    assert text.startswith("Rank 1 died: exit code 3"), text
    path = session(fresh).logs.path(1)
    assert f"Every line its cells printed: %spmd log 1 ({path}" in text
    # the cluster was stopped after the death; its logs were not
    log = run(fresh, "%spmd log 1")
    assert log.error is None and "before 1" in log.stdout, log.stdout
    # a restart (forked, or afresh) writes on in the same logs
    assert run(fresh, "%spmd restart").error is None
    assert run(fresh, "import os\nrank = int(os.environ['SPMD_RANK'])\nprint('after', rank)").error is None
    both = run(fresh, "%spmd log 1").stdout
    assert "before 1" in both and "after 1" in both
    # a new start begins new logs, and the old folder is gone
    assert run(fresh, "%spmd stop").error is None
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    assert not os.path.exists(path)
    assert run(fresh, "%spmd log 1").stdout.startswith("Rank 1 has printed nothing")


KILLED_NOTEBOOK = textwrap.dedent(
    """
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "spmd")
    shell.run_cell("%spmd start -n 2 --linger 0")
    shell.run_cell("print('a line for the log')")
    magics = shell.magics_manager.registry["SpmdMagics"]
    s = magics.session
    print("FOLDERS", s.record().profile_dir, s.record().cache_dir, s.logs.folder, flush=True)
    import time
    time.sleep(600)
    """
)


def test_a_killed_notebooks_folders_are_removed_by_the_next_start(fresh, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(KILLED_NOTEBOOK)
    notebook = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True
    )
    try:
        folders = []
        for line in notebook.stdout:
            if line.startswith("FOLDERS"):
                folders = line.split()[1:]
                break
        assert len(folders) == 3 and all(os.path.isdir(f) for f in folders), folders
        for folder in folders:  # private: other users of the machine cannot read them
            assert os.stat(folder).st_mode & 0o077 == 0, folder
    finally:
        notebook.send_signal(signal.SIGKILL)
        notebook.wait()
        notebook.stdout.close()
    # its ranks end by themselves (they watch the notebook); its folders stay ...
    assert not wait_until_gone(spmd_processes(parent_pid=notebook.pid), 15)
    assert all(os.path.isdir(f) for f in folders)
    # ... until the next notebook starts a cluster
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    assert not any(os.path.exists(f) for f in folders), folders
    mine = session(fresh).record().profile_dir
    assert os.path.isdir(mine)  # (a live notebook's folders are not touched)
    pattern = os.path.join(tempfile.gettempdir(), "spmd-*", "owner.json")
    assert all(os.path.dirname(p) not in folders for p in glob.glob(pattern))

