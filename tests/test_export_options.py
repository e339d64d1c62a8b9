"""%spmd export's line on 2 ranks of no backend: --cells all (a failed cell kept, with its
comment; what %spmd push sent), the lines it refuses and why, and an export before any
start."""

from __future__ import annotations

import re

import pytest
from conftest import ready_cluster, run
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(300)


def test_export_all_cells_keeps_the_failed_one_with_its_comment(module_shell, tmp_path):
    shell = ready_cluster(module_shell, "start -n 2 --backend none")
    assert run(shell, "%spmd restart").error is None
    run(shell, "import os\nif os.environ['SPMD_RANK'] == '1':\n    1 / 0")
    assert run(shell, "%%local\nlr, marker = 0.5, object()").error is None
    assert run(shell, "%spmd push lr marker").error is None
    out = run(shell, f"%spmd export {tmp_path}/all.py --cells all --launcher local")
    assert out.error is None, out.error
    assert re.search(r"Left out: In \[\d+\] \(%%local\)\.\n", out.stdout), out.stdout
    with open(tmp_path / "all.py") as f:
        script = f.read()
    kept = "# (it failed in the notebook: ZeroDivisionError on rank 1)\nimport os\n"
    assert kept in script, script
    # a pushed value whose repr is Python, written as it was; one that is not, said
    assert "# (%spmd push: from the notebook)\nlr = 0.5\n# marker: pushed from the notebook "\
        "(object); define it here\n" in script, script


@pytest.mark.parametrize(
    "line, says",
    [
        ("%spmd export", "the following arguments are required: path"),
        ("%spmd export job.txt", "give a path ending in .py, like job.txt.py"),
        ("%spmd export job.py --launcher pbs", "invalid choice: 'pbs'"),
        ("%spmd export job.py --cells some", "invalid choice: 'some'"),
        ("%spmd export /no/such/folder/job.py", "cannot write /no/such/folder/job.py (No such "
                                                 "file or directory): give a path in a folder"),
        ("%spmd export job.py --launcher ssh", "--launcher ssh needs the hosts the ranks ran on"),
    ],
)
def test_bad_export_lines(module_shell, line, says):
    ready_cluster(module_shell, "start -n 2 --backend none")
    out = run(module_shell, line)
    assert isinstance(out.error, UsageError) and says in str(out.error), out.error


def test_export_before_any_start_says_how(shell):
    magics = shell.magics_manager.registry["SpmdMagics"]
    kept, magics.session = magics.session, None  # (as in a fresh notebook)
    try:
        out = run(shell, "%spmd export job.py")
    finally:
        magics.session = kept
    assert isinstance(out.error, UsageError)
    assert str(out.error).startswith("No cluster has run a cell here yet: %spmd start -n 4")
