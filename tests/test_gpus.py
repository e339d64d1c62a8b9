"""GPUs shared out among the ranks of a host, tested by configuration: this machine has no
GPU, so a fake ``nvidia-smi`` on the ranks' PATH lists 1, 2 or 8, and each rank's
``CUDA_VISIBLE_DEVICES`` (what jax and torch read when they start) is checked on real ranks."""

from __future__ import annotations

import os

import pytest
from conftest import run
from IPython.core.error import UsageError

from spmd.engine.join.placement import GpuError, share_gpus

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("gpus", "ranks", "per_process", "expected"),
    [
        (1, 1, None, [["0"]]),
        (2, 2, None, [["0"], ["1"]]),
        (8, 2, None, [["0", "1", "2", "3"], ["4", "5", "6", "7"]]),
        (8, 4, 1, [["0"], ["1"], ["2"], ["3"]]),
        (8, 2, 0, [[], []]),
        (0, 2, None, [None, None]),
    ],
)
def test_gpus_share_out_by_local_rank(gpus, ranks, per_process, expected):
    visible = [str(i) for i in range(gpus)]
    got = [share_gpus(r, ranks, visible, per_process, "node1") for r in range(ranks)]
    assert got == expected


@pytest.mark.parametrize(
    ("gpus", "ranks", "per_process", "message"),
    [
        (1, 2, None, "node1 has 1 GPU, which cannot be shared evenly by its 2 ranks"),
        (8, 3, None, "node1 has 8 GPUs, which cannot be shared evenly by its 3 ranks"),
        (2, 2, 2, "node1 has 2 GPUs, too few for 2 ranks with --gpus-per-process 2"),
        (0, 2, 1, "--gpus-per-process 1 was given, but node1 has no GPUs"),
    ],
)
def test_gpus_that_cannot_be_shared_say_why(gpus, ranks, per_process, message):
    with pytest.raises(GpuError, match=message):
        share_gpus(0, ranks, [str(i) for i in range(gpus)], per_process, "node1")


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """``fake_gpus(n)``: the ranks started next see an nvidia-smi that lists ``n`` GPUs."""

    def make(count: int) -> None:
        smi = tmp_path / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(count)))
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return make


@pytest.fixture
def fresh(shell):
    magics = shell.magics_manager.registry["SpmdMagics"]
    if magics.session is not None and magics.session.running:
        magics.session.stop()
    yield shell
    if magics.session is not None and magics.session.running:
        magics.session.stop()
    magics.auto.on = False


@pytest.mark.parametrize(
    ("gpus", "extra", "expected"),
    [
        (8, "--backend jax", "[rank 0] 0,1,2,3 0\n[rank 1] 4,5,6,7 1\n"),
        (2, "--backend none", "[rank 0] 0 0\n[rank 1] 1 1\n"),
        (8, "--backend jax --gpus-per-process 1", "[rank 0] 0 0\n[rank 1] 1 1\n"),
        # 0 hides the GPUs: set, and empty (left unset, each rank would see all 8)
        pytest.param(
            8, "--backend none --gpus-per-process 0", "[rank 0]  0\n[rank 1]  1\n", id="hidden"
        ),
    ],
)
def test_each_rank_sees_its_own_gpus_before_jax_starts(fresh, fake_gpus, gpus, extra, expected):
    fake_gpus(gpus)
    out = run(fresh, f"%spmd start -n 2 {extra}")
    assert out.error is None, out.stdout + out.stderr
    out = run(fresh, "import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['LOCAL_RANK'])")
    assert out.stdout == expected
    if "jax" in extra:  # set before jax was imported (jax reads it once, when it starts)
        out = run(
            fresh,
            "import jax\nfrom spmd.engine.bootstrap import TIMELINE as t\n"
            "print(jax.process_count(), t['backend_before_gpus'], t['gpus'] < t['imported'])",
        )
        assert out.stdout == "[ranks 0-1] 2 0.0 True\n", out.stdout + out.stderr
    status = run(fresh, "%spmd status").stdout
    assert status.splitlines()[0].split() == [
        "rank", "host", "pid", "state", "devices", "gpus", "last", "cell"
    ]
    run(fresh, "%spmd stop")


def test_one_gpu_for_two_ranks_is_a_usage_error(fresh, fake_gpus):
    fake_gpus(1)
    message = r"^\S+ has 1 GPU, which cannot be shared evenly by its 2 ranks: start a number"
    with pytest.raises(UsageError, match=message):
        fresh.run_line_magic("spmd", "start -n 2 --backend none")


def test_gpus_per_process_on_a_host_without_gpus_is_a_usage_error(fresh, fake_gpus):
    fake_gpus(0)
    message = r"^--gpus-per-process 1 was given, but \S+ has no GPUs: leave it out"
    with pytest.raises(UsageError, match=message):
        fresh.run_line_magic("spmd", "start -n 2 --backend none --gpus-per-process 1")
