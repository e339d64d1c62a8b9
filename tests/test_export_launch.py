"""An exported job's launch (local, or MPICH's mpiexec) run as a terminal user runs it, on jobs
written here with no cluster: ^C (once or twice, or while the processes start), a failed rank
(jax's too) or a normal end ends every process of the job, and what its ranks started, with
the right status; a cell that sets up the job again carries on; paths with quotes, dollars
and backticks, and the ranks' own interpreter, reach the ranks as they are."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import spmd_processes, wait_until_gone
from jobs import TAG, free_port, run_job, tagged, write_job

pytestmark = pytest.mark.timeout(300)


# -- the launch (ours, mpiexec's) ends its processes as a terminal user expects ------------

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
    """Every process of ``procs`` ends within 10 s. A zombie has ended: what reaps it (the
    launch's shell is gone) is not the job's, and may take its time (psutil.wait_procs waits
    for a zombie as for a live process: a second or two here, its whole timeout where
    nothing reaps)."""
    import time

    import psutil

    def running(proc) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, alive


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
    """^C (SIGINT to the job's process group, as a terminal sends it) half a second after every
    rank said ready: no process of the job is left 10 s later, though jax's ranks ignore
    SIGTERM; a second ^C at once kills them at once, before the first one's 3 s grace is
    over. The status is ^C's."""
    import time

    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    launch = write_job(str(tmp_path), READY, launcher=launcher)
    with _running(launch, str(tmp_path)) as (job, procs):
        assert len([p for p in procs if _named(p, "python")]) == 2
        time.sleep(0.5)  # (rank 0 into its collective)
        pressed = time.monotonic()
        for press in range(presses):
            if press:
                # (a moment later, as a person presses again: two SIGINTs sent together reach
                # the launch's shell as one, and the second ^C would go untested)
                time.sleep(0.3)
            os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=10) == 130
        if presses == 2:
            assert time.monotonic() - pressed < 2.5  # (not the SIGKILL 3 s after the first)
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


def _rank_1_fails(tmp_path, launcher: str, setup: str, then=lambda: None) -> None:
    """Rank 1 exits with code 3 while rank 0 waits (after ``setup``): the launch ends within
    10 s with status 3, and no process of the job is left; ``then`` is called before the
    test's clean-up kills what the launch's process group still holds."""
    cells = ["import sys, time\n" + setup
             + f"print('{TAG} ready', rank, flush=True)\n"
             "if rank == 1:\n    time.sleep(0.5)\n    sys.exit(3)\n"
             "time.sleep(120)"]
    launch = write_job(str(tmp_path), cells, backend="none", launcher=launcher)
    with _running(launch, str(tmp_path)) as (job, procs):
        assert job.wait(timeout=10) == 3
        _none_left(procs)
        then()


@pytest.mark.parametrize("launcher", ["local", "mpi"])
def test_a_failed_rank_ends_the_job_with_its_status(launcher, tmp_path):
    """Rank 1 exits with code 3 while rank 0 waits, ignoring SIGTERM as jax's ranks do: the
    launch ends within 10 s with status 3, and no process is left. (Under mpiexec, the
    status is the failed process's, not the SIGKILL mpiexec gave rank 0.)"""
    if launcher == "mpi" and not shutil.which("mpiexec"):
        pytest.skip("MPICH's mpiexec is not installed (apt-get install mpich)")
    _rank_1_fails(tmp_path, launcher, "import signal\n"
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (as jax's own handler does)\n")


def test_a_job_that_ends_at_its_stop_leaves_no_timer(tmp_path):
    """Rank 1 fails, and rank 0 ends at the stop's first signal: the launch ends at once and
    ends the timer of the SIGKILL it had set, with that timer's sleep (left running, it held
    the job's output open for the rest of its 3 s). (mpiexec's launch sets its timer only at
    a ^C: a failed rank ends mpiexec by itself.)"""
    def no_timer_left() -> None:
        timers = [p for p in spmd_processes() if _named(p, "sleep")]
        assert not wait_until_gone(timers, 1.0), timers

    _rank_1_fails(tmp_path, "local", "", then=no_timer_left)


@pytest.mark.parametrize(("fails", "status", "launcher"), [
    ("sys.exit(3)", 3, "local"), ("1 / 0", 1, "local"),
    # (site's exit() is sys.exit's own path under the local launch: mpiexec's only)
    ("sys.exit(3)", 3, "mpi"), ("exit(3)", 3, "mpi"), ("1 / 0", 1, "mpi")])
def test_a_failed_jax_rank_leaves_at_once_and_ends_the_job(fails, status, launcher, tmp_path):
    """Rank 1 of a jax job exits with code 3 (or raises) while rank 0 waits for it in a
    collective: rank 1 leaves at once, not after jax's exit barrier (which waits for rank 0),
    and the launch ends within 10 s with rank 1's status, with no process left."""
    cells = ["import sys, time\nfrom jax.experimental import multihost_utils\n"
             f"print('{TAG} ready', rank, flush=True)\n"
             f"if rank == 1:\n    time.sleep(0.5)\n    {fails}\n"
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
             "time.sleep(rank / 2)  # (rank 0 done first, 0.5 s before rank 1)"]
    with _running(write_job(str(tmp_path), cells), str(tmp_path)) as (job, procs):
        assert job.wait(timeout=60) == 0
        _none_left(procs)


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
        # (both ranks start in some 20 ms, sleep until END_AT, and end there together: 0.5 s
        # leaves them ample time. Only the statuses are read)
        env = dict(os.environ, MASTER_PORT=str(free_port()), END_AT=str(time.time() + 0.5))
        done = subprocess.run(["bash", launch], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60, env=env)
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

    fails = "if rank == 1:\n    time.sleep(0.5)\n    sys.exit(3)\n" if ends != "ctrl-c" else ""
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


# -- paths and interpreters reach the ranks as they are ----------------------------------

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
