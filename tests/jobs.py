"""Exported jobs for the tests: a script and its launch written by ``%spmd export``'s own Job,
for cells and a cluster described here, without starting one."""

from __future__ import annotations

import os


def write_job(folder: str, cells: list[str], backend: str = "jax", python: str = "",
              launcher: str = "local", hosts: tuple = (), launcher_args: tuple = ()) -> str:
    """The job of ``cells`` on 2 processes (one per host of ``hosts``, if given), launched by
    ``launcher``, written in ``folder``; the path of its launch."""
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.ranks import Ran, Rank, Settings
    from spmd.magics.export import Job

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
