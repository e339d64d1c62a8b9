"""On a rank: which rank it is, its place on its host, and the GPUs it may use.

Whoever launched the process says the rank: our own launchers set ``$SPMD_RANK``; mpiexec
and srun set their own variables, and their rank is ours (as MPI programs expect). The GPUs
are chosen here, on the rank's own host, because only that host knows how many it has, and
before jax or torch starts, because both read ``CUDA_VISIBLE_DEVICES`` once, at start-up.
"""

from __future__ import annotations

import os
import re
import subprocess

RANK_ENV = "SPMD_RANK"
LOCAL_RANK_ENV = "SPMD_LOCAL_RANK"  # this rank's position among the ranks of its host
LOCAL_SIZE_ENV = "SPMD_LOCAL_SIZE"  # how many ranks its host has
GPUS_PER_PROCESS_ENV = "SPMD_GPUS_PER_PROCESS"
BACKEND_ENV = "SPMD_BACKEND"  # jax, torch, "jax,torch" or none
CPU_DEVICES_ENV = "SPMD_CPU_DEVICES"  # jax's CPU devices per process (-d)
TORCH_INIT_ENV = "SPMD_TORCH_INIT"  # tcp, env or file:///path

# (rank, local rank, local size), as each launcher names them.
_LAUNCHER_VARS = (
    (RANK_ENV, LOCAL_RANK_ENV, LOCAL_SIZE_ENV),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's hydra
    ("SLURM_PROCID", "SLURM_LOCALID", None),
)


class GpuError(RuntimeError):
    """The GPUs of a host cannot be shared out as asked."""


def place(env=os.environ) -> tuple[int, int, int]:
    """(rank, local rank, ranks on this host) of this process."""
    for rank_var, local_var, size_var in _LAUNCHER_VARS:
        if rank_var in env:
            rank = int(env[rank_var])
            local = int(env.get(local_var, rank))
            size = int(env[size_var]) if size_var and size_var in env else _slurm_local_size(env)
            return rank, local, size or 1
    return 0, 0, 1


def this_rank() -> int:
    """This process's rank (the launcher said it, before any backend started)."""
    return place()[0]


def _slurm_local_size(env) -> int:
    """Slurm's tasks on this node, from ``SLURM_TASKS_PER_NODE`` ("4(x2),3") and the node's
    index."""
    spec, node = env.get("SLURM_TASKS_PER_NODE"), int(env.get("SLURM_NODEID", 0))
    if not spec:
        return 0
    counts: list[int] = []
    for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", spec):
        counts += [int(count)] * int(times or 1)
    return counts[node] if node < len(counts) else 0


def host_gpus(env=os.environ) -> list[str]:
    """The GPUs this host lets this process see: ``CUDA_VISIBLE_DEVICES`` where the host sets
    it, else every GPU ``nvidia-smi`` lists (none where it is not installed)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def share_gpus(
    local_rank: int, local_size: int, gpus: list[str], per_process: int | None, host: str
) -> list[str] | None:
    """The GPUs of one rank: ``per_process`` each, or by default an equal share of the host's.

    None: leave the environment alone (no GPUs, none asked for). ``per_process`` 0 hides them.
    """
    if per_process == 0:
        return []
    if per_process is None:
        if not gpus:
            return None
        if len(gpus) % local_size:
            raise GpuError(
                f"{host} has {_gpus(len(gpus))}, which cannot be shared evenly by its {local_size} "
                "ranks: start a number of ranks that divides them, or give --gpus-per-process."
            )
        per_process = len(gpus) // local_size
    if not gpus:
        raise GpuError(
            f"--gpus-per-process {per_process} was given, but {host} has no GPUs: "
            "leave it out to run on the CPU."
        )
    if per_process * local_size > len(gpus):
        raise GpuError(
            f"{host} has {_gpus(len(gpus))}, too few for {local_size} ranks with "
            f"--gpus-per-process {per_process}: start fewer ranks there."
        )
    return gpus[local_rank * per_process : (local_rank + 1) * per_process]


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"
