"""torch.distributed on real ranks started otherwise than test_torch's shared cluster
(``--backend torch`` over tcp): with the env and file init methods (a file named, a stale one
replaced, none left after the stop), beside jax on ports of their own, and init_process_group
in a cell of each of them, its destroy and init again. Each test starts its own cluster."""

from __future__ import annotations

import os

import pytest
from conftest import report, run, session, spmd_processes
from torch_ranks import ALL_REDUCE, ALREADY, SETUP, listening

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("method", ["env", "file", "named-file"])
def test_torch_init_methods_env_and_file_join_and_clean_up(fresh, tmp_path, method):
    shell = fresh
    init = method
    if method == "named-file":
        init_file = tmp_path / "spmd-init"
        init_file.write_text("left by a crashed run: a stale file breaks the next start")
        init = f"file://{init_file}"
    try:
        out = run(shell, f"%spmd start -n 2 --backend torch --init-method {init}")
        assert out.error is None, out.stderr
        assert run(shell, SETUP).error is None
        out = run(shell, ALL_REDUCE)
        assert out.stdout == "[ranks 0-1] 3.0\n"
        out = run(shell, "import spmd\nprint(spmd.init_process_group_args()['init_method'])")
        if method == "env":
            assert out.stdout == "[ranks 0-1] env://\n"
        else:
            used = out.stdout.split()[-1]
            assert used.startswith("file:///")
            assert os.path.exists(used[len("file://"):])
            if method == "named-file":
                assert used == init
    finally:
        run(shell, "%spmd stop")
    if method != "env":
        assert not os.path.exists(used[len("file://"):]), "the init file outlived the cluster"


def test_torch_and_jax_together_on_separate_ports(fresh):
    shell = fresh
    try:
        out = run(shell, "%spmd start -n 2 --backend jax,torch")
        assert out.error is None, out.stderr
        out = run(
            shell,
            SETUP + "\nimport jax, jax.numpy as jnp, spmd\n"
            "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')\n"
            "print(psum(jnp.ones(1)), jax.process_index() == rank)\n" + ALL_REDUCE,
        )
        assert out.error is None, report(out)
        assert out.stdout == "[ranks 0-1]\n[2.] True\n3.0\n"
        jax_at = run(shell, "spmd.initialize_args()['coordinator_address']").outputs[-1]
        torch_at = run(shell, "os.environ['MASTER_PORT']").outputs[-1]
        assert jax_at["text/plain"].strip("'").split(":")[1] != torch_at["text/plain"].strip("'")
    finally:
        run(shell, "%spmd stop")


@pytest.mark.parametrize("backend, init, line", [
    ("torch", "env", "-n 3 --backend torch --torch-backend gloo --init-method env"),
    ("torch", "file", "-n 3 --backend torch --torch-backend gloo"),
    ("jax,torch", "tcp", "-n 3 --backend jax,torch --torch-backend gloo"),
], ids=["env", "file", "beside-jax"])
def test_init_process_group_again_after_the_other_starts(fresh, backend, init, line):
    """The same after a start with env:// or a file, and beside jax: the one line, the start
    that gives another size (as this one was asked), and a destroy and init that joins again
    (with a file, rank 0's rendezvous makes the store: there was none on MASTER_PORT)."""
    shell = fresh
    out = run(shell, f"%spmd start -n 2 --backend {backend} --init-method {init}")
    assert out.error is None, out.stderr
    assert run(shell, SETUP).error is None
    out = run(shell, 'dist.init_process_group("gloo")\n' + ALL_REDUCE)
    assert out.stdout == f"[ranks 0-1]\n{ALREADY}\n3.0\n", report(out) if out.error else out.stdout
    text = report(run(shell, 'dist.init_process_group("gloo", world_size=3)'))
    assert f"(this asks for 3 processes): %spmd stop, then %spmd start {line} gives it." in text
    out = run(shell, 'dist.destroy_process_group()\ntime.sleep(rank)\n'
                     'dist.init_process_group("gloo")\n' + ALL_REDUCE)
    assert out.stdout == "[ranks 0-1] 3.0\n", report(out) if out.error else out.stdout
    # (rank 0's new store listens on the master address only, as the start's does)
    pids = [r.pid for r in session(shell).ranks]
    assert listening(pids) <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening(pids)
    assert run(shell, "%spmd stop").error is None
    assert not spmd_processes()
