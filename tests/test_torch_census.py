"""The census of torch.distributed's collectives on two real ranks (``--backend torch``): the
first collective where the ranks part named in a timeout's report, a subgroup's and
all_gather_object's rightly differing launches left unflagged, and, with torch's own check
(``--check-collectives``), a size mismatch that raises on every rank named with both sizes;
the check kept by a restart and by the exported job."""

from __future__ import annotations

import pytest
from conftest import report, run

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")

pytestmark = pytest.mark.timeout(180)


@pytest.mark.timeout(240)
def test_torch_collectives_that_differ_are_named_in_the_timeout_report(fresh):
    out = run(fresh, "%spmd start -n 2 --backend torch")
    assert out.error is None, out.stderr
    out = run(fresh, "%%spmd --timeout 2\nimport torch, torch.distributed as dist\n"
                     "t = torch.ones(4)\nif dist.get_rank() == 0:\n    dist.all_reduce(t)\n"
                     "else:\n    dist.broadcast(t, 0)")
    text = report(out)
    assert "Timed out after 2 s" in text, text
    assert ("The ranks' 1st cross-process programs differ: rank 0 all_reduce float32[4]; "
            "rank 1 broadcast float32[4].") in text, text
    # (the census's own wrapper is not shown among the ranks' frames)
    assert "launches.py" not in text
    assert run(fresh, "%spmd restart").error is None
    # a subgroup's collective, launched by its members only, as it should be: no warning;
    # objects whose sizes rightly differ: no warning either
    out = run(fresh, "import torch, torch.distributed as dist\nrank = dist.get_rank()\n"
                     "solo = dist.new_group([0])\nt = torch.ones(4)\n"
                     "if rank == 0:\n    dist.all_reduce(t, group=solo)\n"
                     "found = [None, None]\ndist.all_gather_object(found, 'x' * (rank + 1))\n"
                     "print(found)")
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] ['x', 'xx']\n" and "Warning" not in out.stderr, out.stderr


@pytest.mark.timeout(240)
def test_torchs_own_check_turns_a_size_mismatch_into_errors_the_census_names(fresh, tmp_path):
    """all_reduce of 4 floats against 5: gloo alone aborts one rank (its record dies with
    it); with torch's own check (--check-collectives: TORCH_DISTRIBUTED_DEBUG=DETAIL) both
    ranks raise, and the census names the op and both sizes. A restart keeps the check, and
    the exported job has it too."""
    out = run(fresh, "%spmd start -n 2 --backend jax --check-collectives")
    assert "--check-collectives turns on torch's own check of each collective, for " \
           "--backend torch" in str(out.error), out.error
    out = run(fresh, "%spmd start -n 2 --backend torch --check-collectives")
    assert out.error is None, out.stderr
    assert run(fresh, "%spmd restart").error is None
    out = run(fresh, "%%spmd --timeout 60\nimport torch, torch.distributed as dist\n"
                     "t = torch.ones(4 + dist.get_rank())\ndist.all_reduce(t)")
    assert ("Warning: the ranks' 1st cross-process program, all_reduce, had different shapes: "
            "rank 0 float32[4]; rank 1 float32[5]. The likely cause of the errors below.") \
        in out.stderr, out.stderr
    text = report(out)
    assert "Error on 2 of 2 ranks" in text and "Detected mismatch between collectives" in text
    out = run(fresh, f"%spmd export {tmp_path / 'job.py'}")
    assert out.error is None, out.stderr
    script = (tmp_path / "job.py").read_text()
    check = 'os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")'
    assert check in script and script.index(check) < script.index("import torch\n"), script
