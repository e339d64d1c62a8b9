"""On a rank: join torch.distributed's default process group, as ``%spmd start`` asked.

Every rank gets the variables torch's own launchers set (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so code written for
``torchrun`` runs unchanged, then ``init_process_group`` with the init method asked for:

- ``tcp``: ``tcp://MASTER_ADDR:MASTER_PORT`` with rank and world size;
- ``env``: ``env://``, which reads the variables above;
- ``file:///path``: a FileStore every rank opens (the notebook removes the file at stop: a
  stale one breaks the next start).

Two things torch does not do on its own, done here:

- For ``tcp`` and ``env``, rank 0's TCPStore would listen on every interface. Rank 0 makes
  the store first, on a socket bound to the master address only (``master_listen_fd``), and
  keeps it; torch's rendezvous makes its store with ``multi_tenant=True``, so it reuses ours.
- gloo listens on the address its host name resolves to, which may be 127.0.1.1 (Debian) or
  an interface the other hosts cannot reach. Unless the user set ``GLOO_SOCKET_IFNAME``, it is
  the interface that reaches the master: ``lo`` when every rank is on this machine.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

BACKENDS = ("gloo", "nccl", "mpi")
INIT_METHODS = ("tcp", "env", "file")

# What this rank passed to init_process_group (``spmd.init_process_group_args``).
INIT_ARGS: dict[str, Any] = {}
# Rank 0's store and its socket: they must live as long as the process group.
_KEEP: list[Any] = []


class TorchSetupError(RuntimeError):
    """torch on this rank cannot join as asked (no NCCL, no GPU, no MPI); the text says what
    to do instead."""


def join(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_size: int,
    master: str,
    backend: str,
    init_method: str,
    gpus_given: bool,
    host: str,
    timeout: float,
) -> dict[str, Any]:
    """Join the default process group; this rank's facts for the rank table."""
    import torch
    import torch.distributed as dist

    addr, _, port = master.rpartition(":")
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_size),
        MASTER_ADDR=addr,
        MASTER_PORT=port,
    )
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_toward(addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    device = _check_backend(torch, dist, backend, rank, local_rank, gpus_given, host)
    args: dict[str, Any] = {"backend": backend}
    if backend != "mpi":  # MPI knows rank and size from mpiexec, and refuses both
        if init_method == "env":
            args["init_method"] = "env://"
        else:
            args["init_method"] = f"tcp://{master}" if init_method == "tcp" else init_method
            args.update(rank=rank, world_size=world_size)
        if init_method in ("tcp", "env") and rank == 0:
            _KEEP.append(_store_on(addr, int(port), timeout))
    INIT_ARGS.clear()
    INIT_ARGS.update(args)
    # torch reads TORCH_DISTRIBUTED_DEBUG (--check-collectives) when torch.distributed is
    # imported: in the rank server, before this rank's environment was given to it.
    dist.set_debug_level_from_env()
    dist.init_process_group(**args)
    return {
        "torch_backend": backend,
        "torch_device": str(device),
        "local_devices": 1,
        "global_devices": dist.get_world_size(),
        "platform": device.type,
    }


def _check_backend(torch, dist, backend, rank, local_rank, gpus_given, host):
    """The device this rank computes on; TorchSetupError where the backend cannot work."""
    version = torch.__version__
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise TorchSetupError(
                f"torch {version} on {host} has no NCCL (it is a CPU build): use "
                "--torch-backend gloo, or install a CUDA build of torch there."
            )
        if not torch.cuda.is_available():
            raise TorchSetupError(
                f"--torch-backend nccl needs a GPU for each rank, and rank {rank} on {host} "
                "sees none: use --torch-backend gloo."
            )
        # With CUDA_VISIBLE_DEVICES narrowed to this rank's GPUs, its first is device 0;
        # with every GPU visible, torchrun's convention: the local rank.
        index = 0 if gpus_given else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if backend == "mpi" and not dist.is_mpi_available():
        raise TorchSetupError(
            f"torch {version} on {host} was built without MPI (only torch built from source "
            "on a host with MPI has it): use --torch-backend gloo."
        )
    return torch.device("cpu")


def keep_store(timeout: float) -> None:
    """(rank 0, before a cell's env:// rendezvous) Make rank 0's store on the master address
    only, where none is kept (a cluster started with ``--init-method file``): torch's own would
    listen on every interface."""
    if _KEEP or os.environ.get("RANK") != "0" or "MASTER_PORT" not in os.environ:
        return
    _KEEP.append(_store_on(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           timeout))


def _store_on(addr: str, port: int, timeout: float):
    """Rank 0's TCPStore, listening on ``addr`` only (torch's own binds every interface)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.create_server((addr, port), family=family, backlog=1024)
    store = dist.TCPStore(
        addr,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        multi_tenant=True,  # torch's rendezvous asks for the same, and so finds this one
        master_listen_fd=sock.fileno(),
    )
    return sock, store


def interface_toward(addr: str) -> str:
    """The name of this machine's interface that reaches ``addr`` ('' if none is found)."""
    import psutil

    from spmd.engine.join.address import address_toward

    try:
        mine = address_toward(addr)
    except OSError:
        return ""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == mine for a in addresses):
            return name
    return ""
