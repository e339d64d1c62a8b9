"""How %spmd export writes each kind of cell in the script: magics and shell escapes as
plain Python, a cell's value, a --ranks cell, the notebook's own names left out, the export
page's listings. Cells whose script form differed from what the notebook did are run on 2
ranks, exported, and run for real: the job prints what the ranks printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ready_cluster, run
from jobs import TAG, printed_by_ranks, run_job, tagged

pytestmark = pytest.mark.timeout(300)


def test_the_export_pages_listings_are_what_the_export_writes():
    """The quickstart.sh and quickstart.py of docs/how-to/export.md, exported from the
    quickstart's cells on 4 ranks of 2 devices, are what the export writes now, byte for byte
    (the Python's folder aside: the page's is the machine's it was written on)."""
    from pathlib import Path

    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    page = (Path(__file__).parents[1] / "docs" / "how-to" / "export.md").read_text()
    launch = page.split("Run it with: bash quickstart.sh\n\n")[1].split("\n```\n")[0] + "\n"
    script = page.split("`quickstart.py`:\n\n```python\n")[1].split("```\n")[0]
    written = launch.split("\n")[3].split('"')[1].rpartition(":")[0]  # (export PATH="...:$PATH")
    seed = re.search(r"^export PYTHONHASHSEED=(\d+)$", launch, re.M).group(1)
    job = Job(Settings(n=4, backend="jax", cpu_devices=2), "local",
              [Rank(r, r) for r in range(4)], "quickstart.py", master="127.0.0.1",
              hash_seed=seed)
    cells = ["import jax\nprint(jax.device_count(), jax.local_device_count())",
             "print(jax.process_index())",
             "xs = jax.numpy.ones(jax.local_device_count())\n"
             "jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs)"]
    assert job.script([Ran(c, count=i, showed_value=i == 4)
                       for i, c in enumerate(cells, 2)]) == script
    here = os.path.dirname(sys.executable)
    assert job.launch_file().text() == launch.replace(written, here)


def test_translated_magics_run_as_plain_python(tmp_path):
    """The Python each magic and shell escape became, run by a Python without IPython."""
    from spmd.magics.export.to_python import plain

    cell = (
        "%env GREETING=hello\n"
        f"%cd {tmp_path}\n"
        "!echo $GREETING > greeting.txt\n"
        "files = !ls\n"
        "%time n = len(files)\n"
        "%matplotlib inline\n"
        "print(files, n)\n"
    )
    converted = plain(cell, set())  # (no name defined before it: $GREETING is the shell's)
    assert "# %matplotlib inline: figures shown in the notebook" in converted.code
    source = "".join(f"import {m}\n" for m in sorted(converted.imports)) + converted.code
    done = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, text=True,
                          cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['greeting.txt'] 1\n"
    assert (tmp_path / "greeting.txt").read_text() == "hello\n"
    # %%writefile as IPython: the text ends with a newline (a cell's text has none), so -a
    # cells add whole lines
    written = plain(f"%%writefile {tmp_path}/w.txt\nline")
    more = plain(f"%%writefile -a {tmp_path}/w.txt\nmore")
    exec("import pathlib\n" + written.code + more.code, {})
    assert (tmp_path / "w.txt").read_text() == "line\nmore\n"
    assert "# %%foo x: an IPython cell magic with no plain-Python form" in plain(
        "%%foo x\nbody\n").code
    # as IPython splits a command: $name and {expr} of names defined before (not a shell
    # loop's $f, not inside single quotes), quotes inside an expression
    shell = plain("!echo '$d' $d \"{d['k']}\"\n!for f in a b; do echo $f; done\n", {"d"}).code
    done = subprocess.run([sys.executable, "-c", "import subprocess\nd = {'k': 'v'}\n" + shell],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "$d {k: v} v\na\nb\n", shell + done.stdout + done.stderr
    # a line magic's argument is expanded as IPython expands it, for names defined before
    # (and %run keeps the file's names, as IPython's does)
    magics = plain("%cd -q {d}\n%env WHERE=$d\n%run {d}/w.py\nprint(where())\n", {"d"}).code
    (tmp_path / "w.py").write_text("import os\ndef where():\n    return os.getcwd()\n"
                                   "print(os.getcwd(), os.environ['WHERE'])\n")
    done = subprocess.run([sys.executable, "-c", f"import os, runpy\nd = {str(tmp_path)!r}\n"
                           + magics], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.stdout == f"{tmp_path} {tmp_path}\n{tmp_path}\n", \
        magics + done.stdout + done.stderr
    # a magic with no Python form inside a block keeps the block one
    compile(plain("if x:\n    %matplotlib inline\n").code, "cell", "exec")


def test_every_kind_of_cell_leaves_a_script_that_compiles(tmp_path):
    """Cells whose plain form could break the script: a value with a comment after it, a
    --ranks cell of magics only, a failed cell that is not Python (kept with --cells all)."""
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    ranks = [Rank(r, r) for r in range(2)]
    job = Job(Settings(n=2, backend="none"), "local", ranks, str(tmp_path / "all.py"),
              keep_failed=True)
    script = job.script([
        Ran("x = 2\nx * 21  # the answer", showed_value=True),
        Ran("%matplotlib inline", ranks=(0,)),
        Ran("await thing()", failed="SyntaxError on ranks 0-1"),
        Ran("print('after', x)"),
    ])
    compile(script, "all.py", "exec")
    assert "print(repr(x * 21))  # the answer" in script
    assert "if rank in (0,):\n    # %matplotlib inline" in script and "    pass" in script
    assert "# await thing()" in script
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "42\nafter 2\n", done.stdout + done.stderr


def test_a_value_with_non_ascii_text_and_a_comment_is_printed_whole(tmp_path):
    """ast gives columns in UTF-8 bytes: a value line with non-ASCII text and a comment after
    it was cut inside the comment, and the cell became a SyntaxError, commented out whole."""
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    job = Job(Settings(n=2, backend="none"), "local", [Rank(r, r) for r in range(2)],
              str(tmp_path / "text.py"))
    script = job.script([Ran('word = "café"\nword + " 日本語"  # a note', showed_value=True)])
    assert 'print(repr(word + " 日本語"))  # a note' in script
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, RANK="0", WORLD_SIZE="2"))
    assert done.stdout == "'café 日本語'\n", done.stdout + done.stderr


def test_cells_that_read_the_notebooks_own_names_are_left_out(tmp_path):
    """Out, In and get_ipython() are the notebook's: a cell that reads one is left out, with its
    text commented for a person to rewrite (kept, it ended every process with a NameError); a
    magic the export translated is kept, as is a name the script itself defines."""
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    job = Job(Settings(n=2, backend="none"), "local", [Rank(r, r) for r in range(2)],
              str(tmp_path / "names.py"))
    script = job.script([
        Ran("x = 6 * 7", count=1),
        Ran("y = Out[1] + len(In)", count=2),
        Ran("get_ipython().user_ns['z'] = 1", count=3),
        Ran("%env GREETING=hi\n!echo $GREETING", count=4),
        Ran("Out = {1: x}\nprint(Out[1])", count=5),
    ])
    assert job.left_out == ["In [2] (reads In, Out)", "In [3] (reads get_ipython())"]
    assert "# -- In [2]: left out, it reads the notebook's own In, Out, which a script does " \
           "not have;\n# write here the value it read:\n# y = Out[1] + len(In)\n" in script
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, RANK="0", WORLD_SIZE="2"))
    assert done.returncode == 0 and done.stdout.endswith("hi\n42\n"), done.stdout + done.stderr


def test_writefile_expands_the_home_folder_as_ipython_does(tmp_path):
    from spmd.magics.export.to_python import plain

    cell = plain("%%writefile ~/note.txt\nhello", set())
    source = "".join(f"import {m}\n" for m in sorted(cell.imports)) + cell.code
    subprocess.run([sys.executable, "-c", source], check=True, timeout=60,
                   env=dict(os.environ, HOME=str(tmp_path)))
    assert (tmp_path / "note.txt").read_text() == "hello\n"


# -- cells whose script form differed from what the notebook did, run for real -----------

CASES = [
    "import jax\nr = jax.process_index()",
    # %%writefile as IPython: {expr} and $name in the file name, the text's last newline
    "%%writefile helpers{r}.py\ndef helper(r):\n    return f'helper of {r}'",
    "%%writefile notes{r}\nfirst",
    "%%writefile -a notes$r\nsecond",
    # %run keeps the file's names
    "%run helpers{r}.py",
    f"print('{TAG} run', helper(r), open(f'notes{{r}}').read().splitlines())",
    # a --ranks cell: the lines of a string keep their text
    f'%%spmd --ranks 0\ntext = """a\n  b"""\nprint("{TAG} ranks", repr(text))',
    # the notebook's own names: a script has none (left out, not a NameError in the job)
    f"print('{TAG} history', len(In) > 0)",
    # a set's order: the same in every process of the job as on every rank (one secret)
    f"print('{TAG} set', list({{'alpha', 'beta', 'gamma', 'delta', 'epsilon'}}))",
    f"print('{TAG} end', r)",
]


@pytest.fixture(scope="module")
def cases_job(module_shell, tmp_path_factory):
    """CASES run on 2 ranks in a folder of their own since a restart, and exported; what the
    ranks printed, what the export said, and the job's folder."""
    shell = ready_cluster(module_shell, "start -n 2")
    assert run(shell, "%spmd restart").error is None
    where = str(tmp_path_factory.mktemp("cases"))
    for cell in [f"%cd {where}", *CASES, "%cd -"]:
        out = run(shell, cell)
        assert out.error is None, out.stdout + out.stderr
    out = run(shell, f"%spmd export {where}/cases.py --launcher local")
    assert out.error is None, out.stdout + out.stderr
    for name in os.listdir(where):  # (the job writes them afresh)
        if not name.startswith("cases."):
            os.remove(os.path.join(where, name))
    return printed_by_ranks(shell, 2), out.stdout, where


def test_the_job_does_what_the_cells_did(cases_job):
    """%%writefile's names and newlines, %run's names, a --ranks cell's string: the job prints
    the lines the ranks printed, but for the cell that read the notebook's In, left out."""
    printed, said, where = cases_job
    assert "Left out: In [" in said and "(reads In)" in said, said
    job = run_job(["bash", "cases.sh"], cwd=where)
    assert tagged(job) == [line for line in printed if "history" not in line]
    assert f"{TAG} ranks 'a\\n  b'" in printed and f"{TAG} end 1" in printed
    assert f"{TAG} run helper of 0 ['first', 'second']" in printed
