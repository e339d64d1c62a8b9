"""torch.distributed on one shared cluster of two real ranks (``--backend torch``: gloo over
tcp): torchrun's variables, the loopback only, the faults of a gloo collective and the
census's word on one, init_process_group and destroy_process_group in a cell, tensors and
DTensors in %spmd gather and %spmd sharding, as a cell's value and printed. (Other starts:
test_torch_starts; the options' bad input and NCCL: test_torch_options; the census of a
timeout and of --check-collectives: test_torch_census.)"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import numpy as np
import psutil
import pytest
from conftest import ready_cluster, report, restart_and_run, run, session, spmd_processes
from IPython.core.error import UsageError
from torch_ranks import ALL_REDUCE, ALREADY, SETUP, listening

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(module_shell):
    return ready_cluster(module_shell, "start -n 2 --backend torch", SETUP)


def restart_and_all_reduce(shell) -> None:
    assert restart_and_run(shell, SETUP, ALL_REDUCE) == "[ranks 0-1] 3.0\n"


def test_torch_ranks_get_torchruns_variables_and_all_reduce(cluster):
    out = run(
        cluster,
        "print({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
        "'LOCAL_WORLD_SIZE')}, dist.get_backend(), os.environ['MASTER_ADDR'])",
    )
    assert out.error is None
    assert "[rank 0] {'RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '2'} gloo 127.0.0.1" in out.stdout
    assert "[rank 1] {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2'} gloo 127.0.0.1" in out.stdout
    out = run(cluster, ALL_REDUCE)
    assert out.stdout == "[ranks 0-1] 3.0\n"
    out = run(cluster, "import spmd\nspmd.init_process_group_args()")
    args = out.outputs[-1]["text/plain"]
    port = run(cluster, "print(os.environ['MASTER_PORT'])").stdout.split()[-1]
    assert f"'init_method': 'tcp://127.0.0.1:{port}'" in args
    assert "'backend': 'gloo'" in args


def test_torch_rank_processes_listen_on_loopback_only(cluster):
    # torch's TCPStore on rank 0 and gloo's pairs would listen on every interface, or on the
    # host name's address, if the ranks did not choose.
    pids = [r.pid for r in session(cluster).ranks]
    assert run(cluster, ALL_REDUCE).error is None
    assert listening(pids) == {"127.0.0.1"}
    out = run(cluster, "print(os.environ['GLOO_SOCKET_IFNAME'])")
    assert out.stdout == "[ranks 0-1] lo\n"


def test_torch_rank_that_raises_before_all_reduce_gets_a_divergence_report(cluster):
    out = run(
        cluster,
        "t = torch.ones(3)\n"
        "if rank == 1:\n"
        "    raise ValueError('bad batch on rank 1')\n"
        "dist.all_reduce(t)",
    )
    text = report(out)
    assert text.startswith("Error on 1 of 2 ranks (1); rank 0 did not raise.\n")
    assert (
        "The ranks diverged: rank 0 is waiting in a collective that rank 1 never reached: "
        "rank 1 raised an error first." in text
    )
    assert "[rank 1] ValueError: bad batch on rank 1" in text
    assert "[rank 0] was running at cell line 4: dist.all_reduce(t)" in text
    assert "torch/distributed/distributed_c10d.py" in text
    # gloo does not let SIGINT in while it waits: the report says so, and restart ends it
    assert "Rank 0 did not respond to the interrupt (still inside C code); a restart ends them." in text
    restart_and_all_reduce(cluster)


def test_torch_rank_killed_inside_a_gloo_collective_gets_the_death_report(cluster):
    victim = session(cluster).ranks[1].pid
    out = run(
        cluster,
        "t = torch.ones(3)\n"
        "if rank == 1:\n"
        "    os.kill(os.getpid(), 9)\n"
        "dist.all_reduce(t)",
    )
    text = report(out)
    assert text.startswith(
        "Rank 1 died: killed by SIGKILL (sent by hand, or by the out-of-memory killer). "
    ), text
    # gloo raises in the survivor at once; its error is the report's, not a half-made stack
    assert "Rank 0 then raised an error, below" in text
    assert re.search(r"\[rank 0\] RuntimeError: .*(Connection closed by peer|Connection reset by peer)", text)
    assert "The other ranks were stopped. Next: %spmd restart starts a fresh cluster." in text
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert session(cluster).ranks[1].state == "died"
    restart_and_all_reduce(cluster)


def test_torch_interrupt_names_the_ranks_gloo_keeps_from_answering(cluster):
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        out = run(
            cluster,
            "%%spmd --grace off\n"
            "t = torch.ones(3)\n"
            "if rank == 1:\n"
            "    time.sleep(60)\n"
            "dist.all_reduce(t)",
        )
    finally:
        timer.cancel()
    text = report(out)
    assert (
        "Interrupted: ranks 0-1 are running; rank 0 is waiting in a collective for rank 1, "
        "still in its own code." in text
    )
    assert "Rank 0 did not respond to the interrupt (still inside C code); a restart ends them." in text
    assert "[rank 1] was running at cell line 3: time.sleep(60)" in text
    restart_and_all_reduce(cluster)


def test_torch_tensors_are_gathered_as_a_list_by_rank(cluster):
    assert run(cluster, "t = torch.arange(3.) + 10 * rank").error is None
    gathered = run(cluster, "%spmd gather t").outputs[-1]["text/plain"]
    assert gathered == (
        "[array([0., 1., 2.], dtype=float32), array([10., 11., 12.], dtype=float32)]"
    )
    text = run(cluster, "%spmd sharding t").outputs[-1]["text/plain"]
    assert text.startswith("t: each rank holds an array of its own")
    assert "  rank 1: float32[3] on CPU 1" in text


DTENSORS = (
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.tensor import distribute_tensor, Shard, Replicate, Partial\n"
    "mesh = init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))\n"
    "full = torch.arange(12.).reshape(6, 2)\n"
    "rows = distribute_tensor(full, mesh, [Shard(0)])\n"
    "cols = distribute_tensor(full, mesh, [Shard(1)])\n"
    "same = distribute_tensor(full, mesh, [Replicate()])\n"
    "parts = torch.distributed.tensor.DTensor.from_local(torch.ones(2), mesh, [Partial()])\n"
    "print(rows.to_local().tolist())"
)


def test_torch_dtensor_is_drawn_over_its_mesh_and_gathered_from_its_shards(cluster):
    out = run(cluster, DTENSORS)
    assert out.error is None, report(out)
    assert "[rank 1] [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]" in out.stdout
    text = run(cluster, "%spmd sharding rows").outputs[-1]["text/plain"]
    assert text.splitlines()[:3] == [
        "rows: float32[6,2], mesh dp=2, (Shard(dim=0)), 2 blocks on 2 devices of 2 processes",
        "  [0:3, 0:2]  CPU 0 (process 0)",
        "  [3:6, 0:2]  CPU 1 (process 1)",
    ]
    text = run(cluster, "%spmd sharding same").outputs[-1]["text/plain"]
    assert "[0:6, 0:2]  CPU 0 (process 0), CPU 1 (process 1)   replicated ×2" in text
    full = np.arange(12.0).reshape(6, 2)
    for name in ("rows", "cols", "same"):
        gathered = run(cluster, f"%spmd gather {name} -o got")
        assert gathered.error is None, gathered.error
        got = cluster.user_ns["got"]
        assert got.dtype == np.float32 and (got == full).all(), (name, got)
    # the picture drawn on the ranks from the placements alone is shown once
    shown = run(cluster, "import spmd\nspmd.show_sharding(cols, 'cols')")
    assert shown.error is None
    assert len(shown.outputs) == 1
    assert shown.outputs[0]["text/plain"].startswith("cols: float32[6,2], mesh dp=2, (Shard(dim=1))")
    refused = run(cluster, "%spmd gather parts")
    assert isinstance(refused.error, UsageError)
    assert "parts is Partial(sum) on its mesh" in str(refused.error)
    assert "gather parts.full_tensor()" in str(refused.error)


def test_a_dtensor_as_a_cells_value_is_shown_once_as_one_process_prints_it(cluster, monkeypatch):
    """A DTensor as the cell's value is the whole tensor, as torch prints it in one process
    (summarized corners for a big one, only they travel), under one line that says what it
    is; Out[n] is its value, fetched when used. Partial ones stay per rank."""
    import torch

    assert run(cluster, DTENSORS).error is None
    full = torch.arange(12.).reshape(6, 2)
    for name in ("rows", "cols", "same"):
        out = run(cluster, name)
        assert out.error is None, report(out)
        assert out.texts == [repr(full)], (name, out.texts)
        spec = {"rows": "Shard(dim=0)", "cols": "Shard(dim=1)", "same": "Replicate()"}[name]
        assert out.stdout == f"(one DTensor over 2 processes: mesh dp=2, ({spec}))\n"
    big = torch.arange(200 * 300, dtype=torch.float64).reshape(200, 300) / 7
    out = run(cluster, "big = distribute_tensor(torch.arange(200 * 300, dtype=torch.float64)"
                       ".reshape(200, 300) / 7, mesh, [Shard(1)])\nbig")
    assert out.error is None, report(out)
    assert out.texts == [repr(big)]
    assert "..." in out.texts[0]
    assert cluster.user_ns["_"].received == 36 * 8  # (the corners, 6×6 float64, not 480 kB)
    local = run(cluster, "%%local\nimport numpy as np\nprint(float(np.asarray(_).sum()), _.shape)")
    assert local.stdout == f"{float(big.sum())} (200, 300)\n", local.stdout + local.stderr
    out = run(cluster, "w = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()\nw")
    assert out.texts == [repr(full.clone().requires_grad_())]
    out = run(cluster, "w * 2")
    assert out.texts == [repr(full.clone().requires_grad_() * 2)]
    out = run(cluster, "parts")  # (each rank holds a part of a sum: as torch prints it there)
    assert "(one DTensor" not in out.stdout
    assert out.texts[0].startswith("DTensor(local_tensor=tensor([1., 1.])")
    assert "Partial(sum)" in out.texts[0]
    # where the notebook's Python cannot print torch tensors, each rank's DTensor as it is
    monkeypatch.setitem(sys.modules, "torch._tensor_str", None)
    out = run(cluster, "rows")
    assert out.error is None and out.stdout == ""
    assert out.texts[0].startswith("[rank 0]\nDTensor(local_tensor=tensor([[0., 1.],"), out.texts
    assert "\n[rank 1]\nDTensor(local_tensor=tensor([[ 6.,  7.]," in out.texts[0], out.texts


def test_a_printed_dtensor_is_the_whole_tensor_as_torch_prints_it(cluster, tmp_path):
    """print(dt), an f-string and display(dt) of a DTensor sharded over the ranks show the
    whole tensor as torch prints it in one process (as the DTensor as a cell's value is);
    what the program itself sees (str(dt) written to a file) is torch's own text."""
    import torch

    assert run(cluster, DTENSORS).error is None
    full = torch.arange(12.).reshape(6, 2)
    out = run(cluster, "print(rows)\nprint(f'cols: {cols}!')")
    assert out.error is None, report(out)
    assert out.stdout == f"[ranks 0-1]\n{full!r}\ncols: {full!r}!\n", out.stdout
    out = run(cluster, "display(rows)")
    assert [o.get("text/plain") for o in out.outputs] == [repr(full)], out.outputs
    out = run(cluster, f"open(f'{tmp_path}/{{rank}}', 'w').write(str(rows))\nprint(parts)")
    assert (tmp_path / "0").read_text().startswith("DTensor(local_tensor=tensor([[0., 1.],")
    # a Partial one (each rank holds a part of a sum) as each rank prints it, here alike
    assert out.stdout.startswith("[ranks 0-1] DTensor(local_tensor=tensor([1., 1.])"), out.stdout
    assert "Partial(sum)" in out.stdout
    assert "\x00" not in out.stdout, out.stdout


@pytest.mark.timeout(240)
def test_torch_sizes_that_differ_on_plain_gloo_are_named_from_the_surviving_rank(cluster):
    """all_reduce of 4 floats against 5 on plain gloo: gloo aborts one rank, whose census
    dies with it; the survivor's names its side, and gloo's "collective mismatch" line gets
    the hint that --check-collectives names both."""
    out = run(cluster, "t = torch.ones(4 + rank)\ndist.all_reduce(t)")
    text = report(out)
    dead = session(cluster).ranks[0].state == "died"
    assert re.search(rf"^Rank {1 - dead} died: killed by SIGABRT \(it aborted: jax, XLA and "
                     "torch's gloo do this", text, re.M), text
    survivor, size = (1, 5) if dead else (0, 4)
    assert (f"Census of the cell's cross-process programs:\n  Rank {survivor}'s 1st "
            f"collective: all_reduce float32[{size}]; rank {1 - survivor} died inside "
            "all_reduce (a rank's census dies with it).\n  Hint: gloo names neither side of "
            "a collective whose sizes differ: %spmd start --check-collectives") in text, text
    restart_and_all_reduce(cluster)


def test_a_dtensor_changed_in_place_prints_its_value_at_each_print(cluster):
    """w.add_(1) between two prints of w, in one cell and in a loop: each print shows w as
    it is then, as one process prints it (the parts are taken at the print, not once a
    cell)."""
    import torch

    setup = ("from torch.distributed.device_mesh import init_device_mesh\n"
             "from torch.distributed.tensor import distribute_tensor, Shard\n"
             "mesh = init_device_mesh('cpu', (2,))\n"
             "w = distribute_tensor(torch.arange(4.), mesh, [Shard(0)])")
    assert run(cluster, setup).error is None
    out = run(cluster, "w.add_(1); print(w); w.add_(1); print(w)")
    assert out.error is None, report(out)
    base = torch.arange(4.)
    assert out.stdout == f"[ranks 0-1]\n{base + 1!r}\n{base + 2!r}\n", out.stdout
    out = run(cluster, "for s in range(2):\n    w.add_(1)\n    print(w)")
    assert out.stdout == f"[ranks 0-1]\n{base + 3!r}\n{base + 4!r}\n", out.stdout


def test_a_dtensor_printed_in_the_cell_that_imports_it_is_the_whole_tensor(cluster):
    """On ranks that had not imported torch's DTensor yet (a restart gives new ones), the cell
    that imports it, makes one and prints it shows the whole tensor, as a later cell does."""
    import torch

    out = restart_and_run(
        cluster, SETUP,
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import distribute_tensor, Shard\n"
        "w = distribute_tensor(torch.arange(4.), init_device_mesh('cpu', (2,)), [Shard(0)])\n"
        "print(w)")
    assert out == f"[ranks 0-1] {torch.arange(4.)!r}\n", out


def test_a_dtensor_changed_through_its_local_shard_prints_anew(cluster):
    """Not every change of a DTensor moves its version counter (its local shard changed in
    place, a checkpoint's load): each print shows it as it is then, never an earlier copy."""
    import torch

    setup = ("from torch.distributed.device_mesh import init_device_mesh\n"
             "from torch.distributed.tensor import distribute_tensor, Shard\n"
             "w = distribute_tensor(torch.arange(4.), init_device_mesh('cpu', (2,)), [Shard(0)])")
    assert run(cluster, setup).error is None
    out = run(cluster, "print(w)\nw.to_local().add_(10)\nprint(w)")
    assert out.error is None, report(out)
    assert out.stdout == f"[ranks 0-1]\n{torch.arange(4.)!r}\n{torch.arange(4.) + 10!r}\n", \
        out.stdout


def test_init_process_group_in_a_cell_says_the_group_exists_and_carries_on(cluster):
    """The first line of a torchrun script, in a cell of ranks the start joined: one line,
    the same on every rank, torch's return value (None), and the cells after it work (before:
    "trying to initialize the default process group twice!" on every rank)."""
    out = run(cluster, 'dist.init_process_group("gloo")\n' + ALL_REDUCE)
    assert out.error is None, report(out)
    assert out.stdout == f"[ranks 0-1]\n{ALREADY}\n3.0\n", out.stdout
    # every way a script names the same group: none given, env://, rank and size as they are
    out = run(cluster, "from torch.distributed import init_process_group\n"
                       "print(init_process_group())\n"
                       "init_process_group(backend=dist.Backend.GLOO, init_method='env://', "
                       "world_size=int(os.environ['WORLD_SIZE']), rank=rank)")
    assert out.error is None, report(out)
    assert out.stdout == f"[ranks 0-1]\n{ALREADY}\nNone\n{ALREADY}\n", out.stdout
    # (torch's own signature and help, as a notebook shows them)
    out = run(cluster, "import inspect\nfrom torch.distributed import distributed_c10d\n"
                       "print(inspect.signature(dist.init_process_group) == "
                       "inspect.signature(distributed_c10d.init_process_group), "
                       "dist.init_process_group.__doc__ == distributed_c10d.init_process_group"
                       ".__doc__, dist.init_process_group.__name__)")
    assert out.stdout == "[ranks 0-1] True True init_process_group\n", out.stdout


def test_init_process_group_with_another_backend_or_size_names_the_start_that_gives_it(cluster):
    """Another backend or world size: one sentence with the %spmd start that gives it, no
    traceback; another rank: where the rank comes from. The group is left as it was."""
    said = "[ranks 0-1] AlreadyStarted: torch.distributed is already initialized: %spmd start " \
           "joined the 2 processes in one group, backend gloo (this asks for "
    for cell, asked, line in [
        ('dist.init_process_group("nccl")', "backend nccl", "-n 2 --backend torch "
         "--torch-backend nccl"),
        ('dist.init_process_group("gloo", world_size=4, rank=rank)', "4 processes",
         "-n 4 --backend torch --torch-backend gloo"),
        ("dist.init_process_group('mpi', 'tcp://127.0.0.1:1?world_size=3')",
         "3 processes, backend mpi", "-n 3 --backend torch --torch-backend mpi"),
    ]:
        out = run(cluster, cell + "\nprint('not reached')")
        text = report(out)
        assert f"{said}{asked}): %spmd stop, then %spmd start {line} gives it." in text, text
        assert "Traceback" not in text and "ValueError" not in text, text
        assert len(text.splitlines()) < 5 and "not reached" not in out.stdout, text
    out = run(cluster, "dist.init_process_group('gloo', rank=0, world_size=2)")
    text = report(out)
    assert ("[rank 1] AlreadyStarted: torch.distributed is already initialized: %spmd start made "
            "this process rank 1 of 2 (this asks for rank 0): leave rank out (torch reads the "
            "RANK variable), or pass rank=dist.get_rank().") in text, text
    assert run(cluster, ALL_REDUCE).stdout == "[ranks 0-1] 3.0\n"


def test_destroy_process_group_then_init_joins_again_as_under_torchrun(cluster):
    """destroy_process_group() and a new init_process_group("gloo") (env://, from the
    variables torchrun sets, rank 0's kept store found again): all_reduce gives the sum, the
    census records it, a second init says a cell made the group, and a restart and a stop
    after a destroy end every rank."""
    # (rank 1 comes late, as a rank may: rank 0 must not read rank 1's address of the old group)
    out = run(cluster, 'dist.destroy_process_group()\nprint(dist.is_initialized())\n'
                       'time.sleep(rank)\ndist.init_process_group("gloo")\n' + ALL_REDUCE)
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1]\nFalse\n3.0\n", out.stdout
    out = run(cluster, "t = torch.arange(4.) * (rank + 1)\ndist.all_reduce(t)\n"
                       "print(t.tolist(), dist.get_world_size(), dist.get_backend())")
    assert out.stdout == "[ranks 0-1] [0.0, 3.0, 6.0, 9.0] 2 gloo\n", out.stdout
    listed = run(cluster, "%spmd census").stdout
    assert "Ranks 0-1: 1 cross-process launch\n" in listed and "all_reduce float32[4]" \
        in listed, listed
    out = run(cluster, "dist.init_process_group('gloo')")
    assert out.stdout == ("[ranks 0-1] torch.distributed is already initialized: a cell joined "
                          "the 2 processes in one group, backend gloo: carrying on.\n"), out.stdout
    # twice more, each on a fresh group (torch names it anew: the kept store's keys are reused)
    out = run(cluster, "for _ in range(2):\n    dist.destroy_process_group()\n"
                       "    dist.init_process_group('gloo')\n" + ALL_REDUCE)
    assert out.stdout == "[ranks 0-1] 3.0\n", report(out) if out.error else out.stdout
    old = [r.pid for r in session(cluster).ranks]
    assert run(cluster, "dist.destroy_process_group()").error is None
    restart_and_all_reduce(cluster)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                   != psutil.STATUS_ZOMBIE for pid in old)
    assert run(cluster, "dist.destroy_process_group()").error is None
    out = run(cluster, "%spmd stop")
    assert out.error is None and "Warning" not in out.stderr, out.stdout + out.stderr
    assert not spmd_processes()
