"""%spmd export for torchrun: the cells 4 torch ranks ran (an all_reduce, a DDP step),
exported and run under torchrun, printing what the ranks printed; and a cluster of hosts of
different sizes, each host's launch given its own count and place."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ready_cluster, run
from jobs import TAG, free_port, printed_by_ranks, run_job, tagged

pytestmark = pytest.mark.timeout(300)

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


def test_torch_export_runs_under_torchrun(module_shell, tmp_path):
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
    out = run(shell, f"%spmd export {tmp_path}/ddp.py --launcher torchrun")
    assert out.error is None, out.stderr
    assert "torchrun --standalone --nproc-per-node 4" in out.stdout
    with open(tmp_path / "ddp.py") as f:
        script = f.read()
    assert 'dist.init_process_group("gloo", init_method="env://")' in script
    job = run_job(["bash", "ddp.sh"], cwd=str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    assert tagged(job) == printed


def test_torchrun_on_hosts_of_different_sizes_gives_each_its_count_and_place(tmp_path):
    """A cluster of 1 rank on host a and 2 on host b, exported for torchrun: each host's launch
    runs its own count with its place (--node-rank), and the world is 3 in the ranks' order.
    The two hosts are played here by two launches on this machine, rank 0's address given."""
    pytest.importorskip("torch")
    from spmd.cluster.launchers.remote import Placement
    from spmd.cluster.records import Ran, Rank, Settings
    from spmd.magics.export.script import Job

    where = Placement(launcher="ssh", hosts=(("a", 1), ("b", 2)))
    job = Job(Settings(n=3, backend="torch", where=where), "torchrun",
              [Rank(r, r) for r in range(3)], str(tmp_path / "nodes.py"), master="127.0.0.1")
    # (one write per line: host b's two processes share one pipe, and print's pieces of two
    # unbuffered processes interleave)
    (tmp_path / "nodes.py").write_text(job.script([Ran(
        "import sys\nsys.stdout.write("
        f"f'{TAG} node {{rank}} {{dist.get_rank()}} {{dist.get_world_size()}}\\n')\n"
        "sys.stdout.flush()")]))
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
