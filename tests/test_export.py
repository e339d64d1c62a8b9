"""%spmd export: the cells 4 ranks ran, written as a script and its launch, then run for real as
a job: 4 local processes, MPICH's mpiexec, an sbatch job on the test suite's Slurm, and torchrun
for torch. Each job prints what the notebook's ranks printed."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import slurm as test_slurm
from conftest import ready_cluster, run, session
from IPython.core.error import UsageError
from jobs import write_job

pytestmark = pytest.mark.timeout(300)

# Every line the notebook's cells print carries this, so the job's lines can be told apart
# from jax's and torch's own (and from what earlier tests' ranks printed).
TAG = f"export-check-{os.getpid()}"

JAX_CELLS = [
    "import jax, jax.numpy as jnp, numpy as np\n"
    "from jax.sharding import NamedSharding, PartitionSpec as P\n"
    "mesh = jax.make_mesh((8,), ('x',))",
    # a sharded array: each process prints the shards it holds
    "x = jax.make_array_from_callback(\n"
    "    (16,), NamedSharding(mesh, P('x')), lambda i: np.arange(16, dtype=np.float32)[i])\n"
    f"print('{TAG} shards', jax.process_index(), [s.data.tolist() for s in x.addressable_shards])",
    # a jitted step over the global array
    "@jax.jit\ndef step(x):\n    return x * 2 + 1\n"
    f"y = step(x)\nprint('{TAG} step', jax.process_index(), float(jnp.sum(y)))",
    "z = 1",
    "z = z + 10",
    "z = z + 10",  # (run twice: the export has it twice, in the order it ran)
    "if jax.process_index() == 1:\n    1 / 0",  # fails on rank 1: left out
    "%%local\nnotebook_only = 1",  # the notebook only: left out
    f"!echo {TAG} shell z={{z}}\nnb = z  # (kept as written)",
    "if z < 0:\n    name = input('name? ')",  # needs a person: flagged, never reached
    f"'{TAG} value z=%d devices=%d' % (z, jax.device_count())",  # the cell's result
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How a job's launch labels each line with its rank: ours and MPICH's ("[rank 1] "), srun's
# ("1: ").
LABEL = re.compile(r"^(?:\[rank (\d+)\] |\s*(\d+): )")


def labelled(text: str) -> list[tuple[int | None, str]]:
    """The tagged lines of ``text``, sorted, each with the rank its label names (None: none)."""
    found = []
    for line in text.splitlines():
        if TAG in line and not line.startswith("--- cell"):
            label = LABEL.match(line)
            rank = label and int(label.group(1) or label.group(2))
            found.append((rank, line[label.end():].strip() if label else line.strip()))
    return sorted(found, key=lambda pair: pair[1])


def tagged(text: str) -> list[str]:
    return [line for _, line in labelled(text)]


def printed_by_ranks(shell, n: int) -> list[str]:
    """The tagged lines the ranks printed in the notebook (each rank's log)."""
    return sorted(
        line for rank in range(n) for line in tagged(session(shell).logs.read(rank)[0])
    )


def run_job(command: list[str], cwd: str, env: dict | None = None, timeout: float = 180):
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="",
                                   **(env or {})))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="spmd-export-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def jax_notebook(module_shell, folder):
    """4 ranks ran JAX_CELLS since a restart; exported for every launcher. (what the ranks
    printed, the cells' results, the export cell's output)"""
    shell = ready_cluster(module_shell, "start -n 4 -d 2")
    assert run(shell, "%spmd restart").error is None
    results = []
    for cell in JAX_CELLS:
        out = run(shell, cell)
        results += [t for t in out.texts if TAG in t]  # (the value, as one process shows it)
    assert len(results) == 1, results  # (one result, the same on every rank)
    said = {}
    for launcher in ("local", "mpi", "slurm"):
        out = run(shell, f"%spmd export {folder}/train_{launcher}.py --launcher {launcher}")
        assert out.error is None, out.stderr
        said[launcher] = out.stdout
    out = run(shell, f"%spmd export {folder}/train_raw.py --launcher local --raw-output")
    assert out.error is None, out.stderr
    printed = sorted(printed_by_ranks(shell, 4) + [results[0]] * 4)
    assert len(printed) == 16, printed  # (shards, step, shell, value: on each rank)
    return printed, said


def test_export_runs_as_4_local_processes_printing_what_the_ranks_printed(jax_notebook, folder):
    printed, said = jax_notebook
    assert "Run it with: bash train_local.sh" in said["local"]
    assert f'{sys.executable} "$(dirname "$0")"/train_local.py > >(label "$rank")' in said[
        "local"]  # (shown)
    out = run_job(["bash", "train_local.sh"], cwd=folder)
    assert tagged(out) == printed
    # each line begins with its rank, the process index the line itself prints
    assert {(rank, line.split()[2]) for rank, line in labelled(out) if " step " in line} == {
        (r, str(r)) for r in range(4)}
    raw = run_job(["bash", "train_raw.sh"], cwd=folder)  # (--raw-output: as written)
    assert tagged(raw) == printed and {rank for rank, _ in labelled(raw)} == {None}
    # the three runs of z's cells, in the order they ran, and !echo's expansion of {z}
    assert f"{TAG} shell z=21" in out


def test_export_runs_with_mpich_mpiexec(jax_notebook, folder):
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec is not installed (apt-get install mpich)")
    printed, said = jax_notebook
    assert "mpiexec -n 4 -prepend-pattern '[rank %r] ' -genv MASTER_ADDR 127.0.0.1" in said["mpi"]
    out = run_job(["bash", "train_mpi.sh"], cwd=folder)
    assert tagged(out) == printed
    assert {(rank, line.split()[2]) for rank, line in labelled(out) if " step " in line} == {
        (r, str(r)) for r in range(4)}


def test_an_mpi_job_labels_each_line_once_whatever_its_buffering(tmp_path):
    """print('step', x, 'on', rank) of a jax float under mpiexec, with PYTHONUNBUFFERED=1 (as
    a terminal or a container may have it): each line has one label, its rank's. (Unbuffered,
    print wrote its words one by one and mpiexec labelled each piece it read: '[rank 0]
    step[rank 0]  [rank 0] 992.0[rank 0]  ...'.) The last value takes a moment to turn into
    text, as a big array's does, so that its line comes apart for certain."""
    if shutil.which("mpiexec") is None:
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    cells = ["import time\nimport jax.numpy as jnp\nx = jnp.float32(992.0) + rank\n"
             "class Slow:\n    def __str__(self):\n        time.sleep(0.05)\n"
             "        return 'slow'\n"
             f"for i in range(20):\n    print('{TAG} step', x, 'on', rank)\n"
             f"print('{TAG} last', Slow(), 'on', rank)"]
    launch = write_job(str(tmp_path), cells, launcher="mpi")
    done = subprocess.run(["bash", launch], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, MASTER_PORT=str(free_port()),
                                                PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if TAG in line]
    assert sorted(lines) == sorted(
        [f"[rank {r}] {TAG} step {992.0 + r} on {r}" for r in range(2) for _ in range(20)]
        + [f"[rank {r}] {TAG} last slow on {r}" for r in range(2)]), done.stdout


@pytest.fixture
def slurm():
    why = test_slurm.why_not()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    with test_slurm.Slurm() as made:
        yield made


def test_export_runs_as_an_sbatch_job_on_slurm(jax_notebook, folder, slurm):
    printed, said = jax_notebook
    assert "Run it with: sbatch train_slurm.sbatch" in said["slurm"]
    with open(f"{folder}/train_slurm.sbatch") as f:
        batch = f.read()
    assert "#SBATCH --ntasks=4" in batch
    assert f"srun --kill-on-bad-exit=1 --label {sys.executable}" in batch
    submitted = run_job(["sbatch", "--wait", "--parsable", "train_slurm.sbatch"], cwd=folder,
                        env=slurm.env)
    job = submitted.strip().split(";")[0]
    with open(f"{folder}/train_slurm-{job}.out") as f:
        out = f.read()
    assert tagged(out) == printed
    assert {(rank, line.split()[2]) for rank, line in labelled(out) if " step " in line} == {
        (r, str(r)) for r in range(4)}
    assert not slurm.jobs()


def test_an_sbatch_job_ends_when_one_task_fails(slurm, tmp_path):
    """Task 1 exits with code 3 while task 0 waits for it in a collective: srun ends the step
    at once (--kill-on-bad-exit), not when jax's heartbeat gives up (100 s). The job fails
    with srun's status (the highest of its tasks': 137 for the one it killed), and its output
    names the task that failed first and that task's code."""
    import time

    cells = ["import sys\nfrom jax.experimental import multihost_utils\n"
             "if rank == 1:\n    sys.exit(3)\n"
             "multihost_utils.sync_global_devices('task 0 waits')"]
    launch = write_job(str(tmp_path), cells, launcher="slurm")
    began = time.monotonic()
    done = subprocess.run(["sbatch", "--wait", os.path.basename(launch)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **slurm.env))
    assert done.returncode != 0, done.stdout + done.stderr
    assert time.monotonic() - began < 60
    assert not slurm.jobs()
    job = done.stdout.split()[-1]
    with open(tmp_path / f"job-{job}.out") as f:
        assert "task 1: Exited with exit code 3" in f.read()


def test_export_leaves_out_failed_and_local_cells_and_flags_input(jax_notebook, folder):
    _, said = jax_notebook
    with open(f"{folder}/train_local.py") as f:
        script = f.read()
    compile(script, "train_local.py", "exec")
    assert "import spmd" not in script and "get_ipython" not in script
    assert "jax.config.update(\"jax_num_cpu_devices\", 2)" in script
    assert "jax.distributed.initialize(coordinator, num_processes=world_size, " in script
    # run order, each run once: z = z + 10 twice
    assert script.count("z = z + 10") == 2
    assert script.index("z = 1") < script.index("z = z + 10")
    failed = re.search(r"# -- In \[\d+\]: left out, it failed in the notebook: "
                       r"ZeroDivisionError on rank 1\n", script)
    assert failed, script
    assert "1 / 0" not in script
    assert re.search(r"# -- In \[\d+\]: left out, a %%local cell", script)
    assert "notebook_only" not in script
    assert "subprocess.run(f'echo " in script and "nb = z  # (kept as written)" in script
    flag = "# needs a person: input() waits for an answer"
    assert script.count(flag) == 1 and script.index(flag) < script.index("input('name? ')")
    assert "print(repr('" in script  # (the cell's result, printed as the notebook showed it)
    # the cell says what it wrote, what it left out and why, and what needs a person
    assert re.search(r"Wrote \S+train_local.py \(\d+ cells the ranks ran", said["local"])
    assert re.search(r"Left out: In \[\d+\] \(ZeroDivisionError on rank 1\), In \[\d+\] "
                     r"\(%%local\)", said["local"]), said["local"]
    assert re.search(r"1 cell needs a person, flagged in the script: In \[\d+\] \(input\(\)",
                     said["local"])


def test_export_all_cells_keeps_the_failed_one_with_its_comment(module_shell, folder):
    shell = ready_cluster(module_shell, "start -n 2 --backend none")
    assert run(shell, "%spmd restart").error is None
    run(shell, "import os\nif os.environ['SPMD_RANK'] == '1':\n    1 / 0")
    assert run(shell, "%%local\nlr, marker = 0.5, object()").error is None
    assert run(shell, "%spmd push lr marker").error is None
    out = run(shell, f"%spmd export {folder}/all.py --cells all --launcher local")
    assert out.error is None, out.error
    assert re.search(r"Left out: In \[\d+\] \(%%local\)\.\n", out.stdout), out.stdout
    with open(f"{folder}/all.py") as f:
        script = f.read()
    kept = "# (it failed in the notebook: ZeroDivisionError on rank 1)\nimport os\n"
    assert kept in script, script
    # a pushed value whose repr is Python, written as it was; one that is not, said
    assert "# (%spmd push: from the notebook)\nlr = 0.5\n# marker: pushed from the notebook "\
        "(object); define it here\n" in script, script


def test_export_shares_gpus_as_the_cluster_did(tmp_path):
    """The start-up a Slurm job runs: each task's own GPUs, from its local rank, unless Slurm
    showed it only its own (run for real, with Slurm's variables as srun sets them, on ranks
    that had 2 GPUs each)."""
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

    settings = Settings(n=4, backend="none", where=Placement(launcher="slurm"))
    ranks = [Rank(r, r, gpus=[str(2 * (r % 2)), str(2 * (r % 2) + 1)]) for r in range(4)]
    job = Job(settings, "slurm", ranks, str(tmp_path / "gpus.py"))
    script = job.script([Ran("print(rank, world_size, os.environ['CUDA_VISIBLE_DEVICES'])")])
    # (what it sees: the node's 4 GPUs, its own 2 (Slurm's --gpus-per-task bound them), none)
    for visible, its_own in (("0,1,2,3", "2,3"), ("4,6", "4,6"), (None, "2,3")):
        env = dict(os.environ, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1")
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"3 4 {its_own}\n", visible


TORCH_CELLS = [
    "import torch, torch.distributed as dist\nrank = dist.get_rank()",
    # (one write per line: torchrun's processes write each of print's pieces as it comes)
    f"t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
    f"print(f'{TAG} all_reduce {{rank}} {{t.item()}}\\n', end='')",
    "torch.manual_seed(0)\n"
    "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "torch.manual_seed(rank)\n"
    "loss = model(torch.randn(8, 4)).pow(2).mean()\n"
    "loss.backward()\nopt.step()\n"
    f"weights = [round(v, 5) for v in model.module.weight.flatten().tolist()]\n"
    f"print(f'{TAG} ddp {{rank}} {{weights}}\\n', end='')",
]


def test_torch_export_runs_under_torchrun(module_shell, folder):
    pytest.importorskip("torch")
    shell = ready_cluster(module_shell, "start -n 4 --backend torch")
    assert run(shell, "%spmd restart").error is None
    for cell in TORCH_CELLS:
        out = run(shell, cell)
        assert out.error is None, out.stderr
    printed = printed_by_ranks(shell, 4)
    # 4 all_reduce lines and 4 DDP lines, the same weights on every rank (DDP keeps them so)
    assert len(printed) == 8
    assert len({line.split(" ", 3)[-1] for line in printed if " ddp " in line}) == 1
    out = run(shell, f"%spmd export {folder}/ddp.py --launcher torchrun")
    assert out.error is None, out.stderr
    assert "torchrun --standalone --nproc-per-node 4" in out.stdout
    with open(f"{folder}/ddp.py") as f:
        script = f.read()
    assert 'dist.init_process_group("gloo", init_method="env://")' in script
    job = run_job(["bash", "ddp.sh"], cwd=folder, env={"OMP_NUM_THREADS": "1"})
    assert tagged(job) == printed


def test_torchrun_on_hosts_of_different_sizes_gives_each_its_count_and_place(tmp_path):
    """A cluster of 1 rank on host a and 2 on host b, exported for torchrun: each host's launch
    runs its own count with its place (--node-rank), and the world is 3 in the ranks' order.
    The two hosts are played here by two launches on this machine, rank 0's address given."""
    pytest.importorskip("torch")
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

    where = Placement(launcher="ssh", hosts=(("a", 1), ("b", 2)))
    job = Job(Settings(n=3, backend="torch", where=where), "torchrun",
              [Rank(r, r) for r in range(3)], str(tmp_path / "nodes.py"), master="127.0.0.1")
    (tmp_path / "nodes.py").write_text(job.script([Ran(
        f"print('{TAG} node', rank, dist.get_rank(), dist.get_world_size(), flush=True)")]))
    launch = job.launch_file()
    (tmp_path / "nodes.sh").write_text(launch.text())
    assert launch.command() == "bash nodes.sh 0 on a, bash nodes.sh 1 on b"
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(["bash", "nodes.sh", str(i)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    out = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], out
    assert tagged(out[0]) == [f"{TAG} node 0 0 3"]
    assert tagged(out[1]) == [f"{TAG} node {r} {r} 3" for r in (1, 2)]
    done = subprocess.run(["bash", "nodes.sh"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0 and "give this host's place: 0 on a (1 process), 1 on b (2 processes)" in done.stderr


def test_the_export_pages_listings_are_what_the_export_writes():
    """The quickstart.sh and quickstart.py of docs/how-to/export.md, exported from the
    quickstart's cells on 4 ranks of 2 devices, are what the export writes now, byte for byte
    (the Python's folder aside: the page's is the machine's it was written on)."""
    from pathlib import Path

    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

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
    from spmd.magics.to_python import plain

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


def test_every_kind_of_cell_leaves_a_script_that_compiles(tmp_path):
    """Cells whose plain form could break the script: a value with a comment after it, a
    --ranks cell of magics only, a failed cell that is not Python (kept with --cells all)."""
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

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
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

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
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

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
    from spmd.magics.to_python import plain

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
def cases_job(module_shell, folder):
    """CASES run on 2 ranks in ``folder`` since a restart, and exported; what the ranks
    printed, and the job's folder."""
    shell = ready_cluster(module_shell, "start -n 2")
    assert run(shell, "%spmd restart").error is None
    where = os.path.join(folder, "cases")
    os.makedirs(where)
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


# -- the local launch ends its processes as a terminal user expects -------------------------

def _start(launch: str, cwd: str, env: dict | None = None) -> subprocess.Popen:
    """``bash LAUNCH`` in a process group of its own, as a terminal runs a command."""
    return subprocess.Popen(["bash", launch], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, MASTER_PORT=str(free_port()),
                                     PYTHONUNBUFFERED="1", **(env or {})))


@contextlib.contextmanager
def _running(launch: str, cwd: str):
    """The job of ``bash LAUNCH`` once every rank printed 'ready', and its processes then;
    whatever the test leaves running is killed by its process group."""
    import psutil

    job = _start(launch, cwd)
    try:
        _wait_for_lines(job, f"{TAG} ready", 2)
        yield job, psutil.Process(job.pid).children(recursive=True)
    finally:
        _end(job)


def _named(proc, word: str) -> bool:
    """Whether ``proc``'s name holds ``word``; False for a child gone since it was listed
    (the launch's shell forks short-lived children, such as a command substitution's)."""
    import psutil

    try:
        return word in proc.name()
    except psutil.NoSuchProcess:
        return False


def _end(job: subprocess.Popen, procs: list = ()) -> None:
    """Kill the launch ``job``, every process under it and ``procs`` (each rank runs in a
    session of its own: the launch's process group does not hold it)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        procs = [*procs, *psutil.Process(job.pid).children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.communicate()


def _none_left(procs: list) -> None:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def _wait_for_lines(job: subprocess.Popen, word: str, count: int, timeout: float = 120) -> str:
    """What the job printed, once ``word`` came ``count`` times."""
    import select
    import time

    out, deadline = b"", time.monotonic() + timeout
    while out.decode(errors="replace").count(word) < count:
        assert time.monotonic() < deadline, out.decode(errors="replace")
        if select.select([job.stdout], [], [], 1.0)[0]:
            chunk = os.read(job.stdout.fileno(), 65536)
            assert chunk or job.poll() is None, out.decode(errors="replace")
            out += chunk
    return out.decode(errors="replace")


# (rank 0 waits for rank 1 in a collective, where a SIGINT waits too; rank 1 sleeps)
READY = [f"import time\nfrom jax.experimental import multihost_utils\n"
         f"print('{TAG} ready', jax.process_index(), flush=True)\n"
         "if rank == 1:\n    time.sleep(120)\n"
         "multihost_utils.sync_global_devices('rank 0 waits')"]


@pytest.mark.parametrize("launcher", ["local", "mpi"])
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_ends_every_process_of_a_jax_job(presses, launcher, tmp_path):
    """^C (SIGINT to the job's process group, as a terminal sends it) one second after every
    rank said ready: no process of the job is left 10 s later, though jax's ranks ignore
    SIGTERM; a second ^C at once kills them at once. The status is ^C's."""
    import time

    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    launch = write_job(str(tmp_path), READY, launcher=launcher)
    with _running(launch, str(tmp_path)) as (job, procs):
        assert len([p for p in procs if _named(p, "python")]) == 2
        time.sleep(1)
        for _ in range(presses):
            os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=10) == 130
        _none_left(procs)


def test_ctrl_c_while_the_processes_start_ends_those_started(tmp_path):
    """^C as soon as the first process exists, while the launch starts the others: the trap
    is already set, so the launch ends what it started (before, the trap came after the
    start: a ^C then ended the shell alone, and its processes, which ignore SIGINT, ran on)."""
    import time

    import psutil

    launch = write_job(str(tmp_path), ["import time\ntime.sleep(60)"], backend="none")
    job = _start(launch, str(tmp_path))
    try:
        shell, deadline = psutil.Process(job.pid), time.monotonic() + 30
        while not (procs := [p for p in shell.children() if _named(p, "python")]):
            assert time.monotonic() < deadline
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=10) == 130
        _none_left(procs)
    finally:
        _end(job)


@pytest.mark.parametrize("launcher", ["local", "mpi"])
def test_a_failed_rank_ends_the_job_with_its_status(launcher, tmp_path):
    """Rank 1 exits with code 3 while rank 0 waits, ignoring SIGTERM as jax's ranks do: the
    launch ends within 10 s with status 3, and no process is left. (Under mpiexec, the
    status is the failed process's, not the SIGKILL mpiexec gave rank 0.)"""
    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    cells = ["import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (as jax's own handler does)\n"
             f"print('{TAG} ready', rank, flush=True)\n"
             "if rank == 1:\n    time.sleep(1)\n    sys.exit(3)\n"
             "time.sleep(120)"]
    launch = write_job(str(tmp_path), cells, backend="none", launcher=launcher)
    with _running(launch, str(tmp_path)) as (job, procs):
        assert job.wait(timeout=10) == 3
        _none_left(procs)


@pytest.mark.parametrize("launcher", ["local", "mpi"])
@pytest.mark.parametrize(("fails", "status"), [("sys.exit(3)", 3), ("exit(3)", 3), ("1 / 0", 1)])
def test_a_failed_jax_rank_leaves_at_once_and_ends_the_job(fails, status, launcher, tmp_path):
    """Rank 1 of a jax job exits with code 3 (or raises) while rank 0 waits for it in a
    collective: rank 1 leaves at once, not after jax's exit barrier (which waits for rank 0),
    and the launch ends within 10 s with rank 1's status, with no process left."""
    cells = ["import sys, time\nfrom jax.experimental import multihost_utils\n"
             f"print('{TAG} ready', rank, flush=True)\n"
             f"if rank == 1:\n    time.sleep(1)\n    {fails}\n"
             "multihost_utils.sync_global_devices('wait for rank 1')"]
    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    launch = write_job(str(tmp_path), cells, launcher=launcher)
    with _running(launch, str(tmp_path)) as (job, procs):
        assert job.wait(timeout=10) == status
        _none_left(procs)


def test_a_jax_job_that_ends_normally_exits_0(tmp_path):
    """The end of the script undoes the leave-at-once: a process that finished first waits for
    the others at jax's exit barrier, and the job's status is 0."""
    cells = ["import time\n"
             f"print('{TAG} ready', rank, flush=True)\n"
             "time.sleep(2 * rank)  # (rank 0 done first)"]
    with _running(write_job(str(tmp_path), cells), str(tmp_path)) as (job, procs):
        assert job.wait(timeout=60) == 0
        _none_left(procs)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_cell_that_sets_up_the_job_again_carries_on_in_the_script(tmp_path, backend):
    """A cell's own ``dist.init_process_group("gloo")`` (or ``jax.distributed.initialize()``),
    as scripts written for torchrun begin: in the notebook the ranks were told they had it and
    carried on; the exported script does the same (before: torch's "trying to initialize the
    default process group twice!", jax's "should only be called once")."""
    again = ('import torch.distributed as dist\ndist.init_process_group("gloo")\n'
             "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nprint('" + TAG +
             " sum', t.item(), flush=True)" if backend == "torch" else
             "jax.distributed.initialize()\nfrom jax.experimental import multihost_utils\n"
             "total = multihost_utils.process_allgather(jax.numpy.array([rank + 1.0])).sum()\n"
             "print('" + TAG + " sum', float(total), flush=True)")
    job = _start(write_job(str(tmp_path), [again], backend=backend), str(tmp_path))
    try:
        out = _wait_for_lines(job, f"{TAG} sum 3.0", 2)
        assert job.wait(timeout=60) == 0, out
    finally:
        _end(job)


def test_the_ssh_launch_quotes_paths_with_quotes_dollars_and_backticks(tmp_path):
    """A script and a Python in a folder named with ', $ and a backtick, launched over ssh (an
    ssh that runs the command as sshd does, with the login shell, here): each path reaches
    the remote shell whole, and nothing in it is expanded on this machine."""
    where = tmp_path / "it's $HOME `echo x`"
    where.mkdir()
    (where / "py3").symlink_to(os.path.realpath(sys._base_executable))
    # (options, then the host, then the command, run by a shell whose input ends with this
    # ssh, as sshd's does)
    ssh = tmp_path / "ssh"
    ssh.write_text(f"#!{sys.executable}\nimport subprocess, sys\nargs = sys.argv[1:]\n"
                   "while args[0] == '-o':\n    args = args[2:]\n"
                   "shell = subprocess.Popen(['bash', '-c', ' '.join(args[1:])], "
                   "stdin=subprocess.PIPE)\nsys.exit(shell.wait())\n")
    ssh.chmod(0o755)
    launch = write_job(str(where), [f"import sys\nprint('{TAG} ran', rank, sys.executable)"],
                       backend="none", launcher="ssh", python=str(where / "py3"),
                       hosts=(("here", 2),), launcher_args=(("ssh_cmd", str(ssh)),))
    out = run_job(["bash", launch], cwd=str(where))
    assert tagged(out) == [f"{TAG} ran {r} {where / 'py3'}" for r in range(2)], out
    # a Python under the home folder (--python ~/...): the home's there, and here
    home = tmp_path / "home"
    (home / "my env").mkdir(parents=True)
    (home / "my env" / "py3").symlink_to(os.path.realpath(sys._base_executable))
    for launcher, args in (("ssh", {"hosts": (("here", 2),),
                                    "launcher_args": (("ssh_cmd", str(ssh)),)}),
                           ("local", {})):
        launch = write_job(str(where), [f"import sys\nprint('{TAG} ran', rank, sys.executable)"],
                           backend="none", launcher=launcher, python="~/my env/py3", **args)
        out = run_job(["bash", launch], cwd=str(where), env={"HOME": str(home)})
        assert tagged(out) == [f"{TAG} ran {r} {home / 'my env' / 'py3'}" for r in range(2)], out


def test_the_launch_runs_the_ranks_interpreter_by_its_path(tmp_path):
    """A notebook whose Python is not called `python` (here the base interpreter by another
    name), launched with PATH=/usr/bin:/bin: the job runs that interpreter, not whatever
    `python` the PATH finds."""
    base = os.path.realpath(sys._base_executable)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "py3").symlink_to(base)
    launch = write_job(str(tmp_path), [f"import sys\nprint('{TAG} ran', rank, sys.executable)"],
                        backend="none", python=str(bin_dir / "py3"))
    done = subprocess.run(["bash", launch], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PATH="/usr/bin:/bin",
                                               PYTHONUNBUFFERED="",
                                               MASTER_PORT=str(free_port())))
    assert done.returncode == 0, done.stdout + done.stderr
    assert tagged(done.stdout) == [f"{TAG} ran {r} {bin_dir / 'py3'}" for r in range(2)]


def test_two_ranks_that_end_at_once_give_the_failures_status(tmp_path):
    """Rank 1 exits with 3 and rank 0 with 0 at the same moment, 10 times: the job's status is
    3 each time (the wait loop read one status a pass, and dropped the other process that had
    died: 0 in 1 of 6 runs)."""
    import time

    cells = ["import os, time\n"
             "time.sleep(max(0.0, float(os.environ['END_AT']) - time.time()))\n"
             "os._exit(3 if rank == 1 else 0)"]
    launch = write_job(str(tmp_path), cells, backend="none")
    statuses = []
    for _ in range(10):
        env = dict(os.environ, MASTER_PORT=str(free_port()), END_AT=str(time.time() + 1.5))
        done = subprocess.run(["bash", launch], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env=env)
        statuses.append(done.returncode)
    assert statuses == [3] * 10, statuses


# (each rank starts a process of its own after 'ready', as a `!cmd` or a Popen does)
CHILD = (f"print('{TAG} ready', rank, flush=True)\n"
         "import subprocess, sys, time\n"
         "child = subprocess.Popen(['sleep', '1000'])\n"
         # (one write: mpiexec labels each piece it reads)
         f"print(f'{TAG} child {{child.pid}} started', flush=True)\n")


@pytest.mark.parametrize("launcher", ["local", "mpi"])
@pytest.mark.parametrize("ends", ["ctrl-c", "a failed rank"])
def test_the_end_of_a_job_ends_what_its_ranks_started(ends, launcher, tmp_path):
    """Each rank starts a child after 'ready'; the job is ended by ^C, or by rank 1 failing:
    both children are gone afterwards (the launch had signalled its ranks alone: a child of
    a rank ran on)."""
    import psutil

    fails = "if rank == 1:\n    time.sleep(1)\n    sys.exit(3)\n" if ends != "ctrl-c" else ""
    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    launch = write_job(str(tmp_path), [CHILD + fails + "time.sleep(120)"], backend="none",
                       launcher=launcher)
    job, children = _start(launch, str(tmp_path)), []
    try:
        out = _wait_for_lines(job, " started", 2)
        children = [psutil.Process(int(pid))
                    for pid in re.findall(rf"{TAG} child (\d+) started", out)]
        assert len(children) == 2 and all(c.name() == "sleep" for c in children), out
        if ends == "ctrl-c":
            os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=10) == (130 if ends == "ctrl-c" else 3)
        _none_left(children)
    finally:
        _end(job, children)


def test_launches_quote_a_folder_with_quotes_dollars_and_backticks(tmp_path):
    """The Python's folder in the launch's PATH, named with ", ', $ and a backtick (as given,
    and under the home folder): the ranks' PATH begins with it, as it is."""
    where = tmp_path / "say \"hi\" it's $HOME `echo x`"
    where.mkdir()
    (where / "py3").symlink_to(os.path.realpath(sys._base_executable))
    cell = f"import os\nprint('{TAG} path', rank, os.environ['PATH'].split(':')[0])"
    for python, home in ((str(where / "py3"), str(tmp_path)),
                         (f"~/{where.name}/py3", str(tmp_path))):
        launch = write_job(str(tmp_path), [cell], backend="none", python=python)
        out = run_job(["bash", launch], cwd=str(tmp_path), env={"HOME": home})
        assert tagged(out) == [f"{TAG} path {r} {where}" for r in range(2)], out


def test_an_sbatch_script_of_a_name_with_spaces(tmp_path):
    """A script named with spaces (and a %, #, quotes, a backslash): its sbatch job's name has
    none, and its output file is the script's name with the job's id."""
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

    name = "my 'first' \"job\" #1 100% a\\b"
    job = Job(Settings(n=2, backend="none"), "slurm", [Rank(r, r) for r in range(2)],
              str(tmp_path / f"{name}.py"))
    (tmp_path / f"{name}.py").write_text(job.script([Ran(f"print('{TAG} ran', rank)")]))
    launch = job.launch_file()
    (tmp_path / f"{name}.sbatch").write_text(launch.text())
    assert launch.command() == f"sbatch {shlex.quote(name + '.sbatch')}"
    assert "#SBATCH --job-name=my__first___job___1_100__a_b\n" in launch.text()
    why = test_slurm.why_not()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    with test_slurm.Slurm() as slurm:
        submitted = run_job(["sbatch", "--wait", "--parsable", f"{name}.sbatch"],
                            cwd=str(tmp_path), env=slurm.env)
        job_id = submitted.strip().split(";")[0]
        # (a backslash would turn Slurm's pattern off: an _ in its place)
        out = (tmp_path / f"{name.replace(chr(92), '_')}-{job_id}.out").read_text()
        assert tagged(out) == [f"{TAG} ran {r}" for r in range(2)], out
