"""%spmd export of the cells 4 ranks ran (2 devices each), written as a script and its
launch, then run for real as a job: 4 local processes, MPICH's mpiexec, an sbatch job on the
test suite's Slurm. Each job prints what the notebook's ranks printed. Beside them, what
those launches do of their own: mpiexec's labels, an sbatch job's end when a task fails, its
name, and the GPUs each of its tasks takes."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest
import slurm as test_slurm
from conftest import ready_cluster, run
from jobs import TAG, free_port, labelled, printed_by_ranks, run_job, tagged, write_job

pytestmark = pytest.mark.timeout(300)

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


def test_an_sbatch_script_of_a_name_with_spaces(tmp_path):
    """A script named with spaces (and a %, #, quotes, a backslash): its sbatch job's name has
    none, and its output file is the script's name with the job's id."""
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

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


def test_export_shares_gpus_as_the_cluster_did(tmp_path):
    """The start-up a Slurm job runs: each task's own GPUs, from its local rank, unless Slurm
    showed it only its own (run for real, with Slurm's variables as srun sets them, on ranks
    that had 2 GPUs each)."""
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

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
