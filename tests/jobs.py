"""Exported jobs for the tests: a script and its launch written by ``%spmd export``'s own Job,
for cells and a cluster described here, without starting one; a job run to its end; and what
the tests read in a job's output (the lines the cells printed, each with its rank's label)."""

from __future__ import annotations

import os
import re
import socket
import subprocess

from conftest import session

# Every line the tests' cells print carries this, so the job's lines can be told apart
# from jax's and torch's own (and from what earlier tests' ranks printed).
TAG = f"export-check-{os.getpid()}"


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
    """What ``command`` (a job's launch) printed; it must end with status 0."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="",
                                   **(env or {})))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def write_job(folder: str, cells: list[str], backend: str = "jax", python: str = "",
              launcher: str = "local", hosts: tuple = (), launcher_args: tuple = ()) -> str:
    """The job of ``cells`` on 2 processes (one per host of ``hosts``, if given), launched by
    ``launcher``, written in ``folder``; the path of its launch."""
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    where = Placement(launcher=launcher if launcher in ("ssh", "mpi") else "local",
                      hosts=hosts, launcher_args=launcher_args, python=python)
    settings = Settings(n=2, backend=backend, where=where)
    job = Job(settings, launcher, [Rank(r, r) for r in range(2)], os.path.join(folder, "job.py"))
    with open(job.path, "w") as f:
        f.write(job.script([Ran(c) for c in cells]))
    launch = job.launch_file()
    with open(launch.path, "w") as f:
        f.write(launch.text())
    return launch.path
