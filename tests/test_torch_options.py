"""torch's options to %spmd start refused before anything starts, each in one sentence: an
option without --backend torch, an init method or backend this start cannot give, and on the
CPU build of torch (no NCCL, no MPI) NCCL and MPI; the GPU each rank picks for NCCL, checked
on a stand-in torch."""

from __future__ import annotations

import shutil
import types

import pytest
from conftest import run, spmd_processes
from IPython.core.error import UsageError

from spmd.engine.join import torch_group

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    "line, says",
    [
        (
            "%spmd start -n 2 --torch-backend gloo",
            "--torch-backend is for --backend torch: add it.",
        ),
        ("%spmd start -n 2 --init-method env", "--init-method is for --backend torch: add it."),
        (
            "%spmd start -n 2 --backend torch --torch-backend mpi",
            "--torch-backend mpi needs ranks started by mpiexec: add --launcher mpi.",
        ),
        (
            "%spmd start -n 2 --backend torch --init-method udp://x",
            "--init-method takes tcp, env, file or file:///path/to/a/file, not 'udp://x'",
        ),
        (
            "%spmd start -n 2 --backend torch --init-method file:///no/such/folder/f",
            "the folder of --init-method file:///no/such/folder/f does not exist",
        ),
        (
            "%spmd start -n 2 --backend torch --hosts a,b --init-method file",
            "--init-method file keeps its file in a folder of this machine",
        ),
        ("%spmd start -n 2 --backend torch,torch", "--backend takes jax, torch, jax,torch or none"),
        ("%spmd start -n 2 --backend torch --torch-backend xla", "invalid choice: 'xla'"),
    ],
)
def test_torch_bad_options_are_refused_before_anything_starts(fresh, line, says):
    shell = fresh
    out = run(shell, line)
    assert isinstance(out.error, UsageError), out.error
    assert says in str(out.error)
    assert not spmd_processes()


def test_torch_nccl_on_a_cpu_build_says_to_use_gloo(fresh):
    shell = fresh
    out = run(shell, "%spmd start -n 2 --backend torch --torch-backend nccl")
    assert isinstance(out.error, UsageError), out.error
    assert "has no NCCL (it is a CPU build): use --torch-backend gloo" in str(out.error)
    assert not spmd_processes()


@pytest.mark.skipif(not shutil.which("mpiexec"), reason="no mpiexec (apt-get install mpich)")
def test_torch_mpi_backend_without_mpi_in_torch_says_to_use_gloo(fresh):
    shell = fresh
    out = run(shell, "%spmd start -n 2 --backend torch --torch-backend mpi --launcher mpi")
    assert isinstance(out.error, UsageError), out.error
    assert "was built without MPI" in str(out.error)
    assert "use --torch-backend gloo" in str(out.error)
    assert not spmd_processes()


def _stand_in_torch(gpus: int):
    """torch with ``gpus`` CUDA devices, for the one thing this machine cannot run."""
    chosen = []
    cuda = types.SimpleNamespace(is_available=lambda: gpus > 0, set_device=chosen.append)
    torch = types.SimpleNamespace(__version__="2.13.0+cu130", cuda=cuda, device=lambda *a: a)
    dist = types.SimpleNamespace(is_nccl_available=lambda: True, is_mpi_available=lambda: False)
    return torch, dist, chosen


@pytest.mark.parametrize("gpus_given, local_rank, device", [(True, 3, 0), (False, 3, 3)])
def test_torch_nccl_picks_the_ranks_own_gpu(gpus_given, local_rank, device):
    torch, dist, chosen = _stand_in_torch(gpus=8)
    got = torch_group._check_backend(torch, dist, "nccl", 3, local_rank, gpus_given, "node1")
    # CUDA_VISIBLE_DEVICES narrowed to the rank's own GPU: it is device 0 there
    assert chosen == [device]
    assert got == ("cuda", device)


def test_torch_nccl_without_a_gpu_names_the_rank_and_host():
    torch, dist, _ = _stand_in_torch(gpus=0)
    with pytest.raises(torch_group.TorchSetupError, match="rank 2 on node1 sees none"):
        torch_group._check_backend(torch, dist, "nccl", 2, 0, False, "node1")
