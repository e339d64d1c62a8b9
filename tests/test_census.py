"""The census on real ranks: each cell's cross-process launches recorded on every rank, and
the first place where the ranks' sequences part named in reports, in a warning after a cell
that ended, and by ``%spmd census``; jax's on one shared 2 x 2 cluster. (torch's collectives:
test_torch_census; the guide's three pitfalls on 4 x 2: test_notebooks.)"""

from __future__ import annotations

import pytest
from conftest import ready_cluster, report, run

pytestmark = pytest.mark.timeout(180)

SETUP = """import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
rank = jax.process_index()
mesh = jax.make_mesh((4,), ('i',))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('i')), np.ones((2,), np.float32))
def total(x):
    return x.sum()
total = jax.jit(total)"""


@pytest.fixture
def cluster(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 2", SETUP)


def test_the_same_launches_give_no_warning_and_the_census_lists_them(cluster):
    out = run(cluster, "for step in range(3):\n    s = total(x)\nprint(s)")
    assert out.error is None and out.stdout == "[ranks 0-1] 4.0\n"
    assert "Warning" not in out.stderr, out.stderr
    listed = run(cluster, "%spmd census").stdout
    assert "Ranks 0-1: 3 cross-process launches\n" in listed, listed
    assert "1-3  jit(total) float32[4] (line 6)" in listed, listed
    assert listed.rstrip().endswith("Every rank launched the same.")


def test_different_programs_at_one_place_are_named_after_a_cell_that_ended(cluster):
    out = run(cluster, "f = jax.jit(lambda x: x.sum())\n"
                       "g = jax.jit(lambda x: x.max())\n"
                       "if rank == 1:\n    f = g\nprint(f(x))")
    assert out.error is None, report(out)
    # nothing hung, yet the ranks ran different programs: the warning says so
    assert ("Warning: the ranks' 1st cross-process programs differ: rank 0 jit(<lambda>) "
            "float32[4] (line 1); rank 1 jit(<lambda>) float32[4] (line 2).") in out.stderr, \
        out.stderr
    assert "Every process must launch the same programs in the same order" not in out.stderr
    listed = run(cluster, "%spmd census").stdout
    assert "Rank 0: 1 cross-process launch\n          1  jit(<lambda>) float32[4] (line 1)" \
        in listed, listed
    assert "Hint: Every process must launch the same programs in the same order" in listed


def test_a_divergence_report_names_the_launch_one_rank_never_made(cluster):
    out = run(cluster, "for step in range(2 - rank):\n    s = total(x)\nprint(s)")
    text = report(out)
    assert "The ranks diverged: rank 0 is waiting in a collective" in text, text
    assert ("The ranks launched different numbers of cross-process programs: rank 0 launched "
            "2, rank 1 launched 1. Rank 1 had no 2nd; rank 0 is at its 2nd, jit(total) "
            "float32[4].") in text, text
    assert "Hint: Make every process run the same number of steps" in text
    # (the census section comes after the stacks)
    assert text.index("at cell line") < text.index("Census of the cell's")


def test_the_census_compares_what_each_rank_recorded(cluster):
    """The mutation check: rank 1 records nothing, and the census sees the difference."""
    out = run(cluster, "census = get_ipython().kernel.launches\ncensus.off = rank == 1\n"
                       "try:\n    for step in range(3):\n        s = total(x)\n"
                       "finally:\n    census.off = False")
    assert out.error is None
    assert ("Warning: the ranks launched different numbers of cross-process programs: rank 0 "
            "launched 3, rank 1 launched 0.") in out.stderr, out.stderr


def test_census_of_an_earlier_cell_and_bad_arguments(cluster):
    run(cluster, "s = total(x)")
    number = cluster.displayhook.prompt_count
    run(cluster, "print('no launch')")
    assert "launched no cross-process program" in run(cluster, "%spmd census").stdout
    listed = run(cluster, f"%spmd census {number}").stdout
    assert listed.startswith(f"In [{number}]:\nRanks 0-1: 1 cross-process launch"), listed
    for bad in ("%spmd census x", "%spmd census 1 2", "%spmd census 99999"):
        error = run(cluster, bad).error
        assert error is not None and "census" in str(error), (bad, error)


def test_jitted_functions_keep_jax_api_under_the_census(cluster):
    """jax.jit and jax.pmap hand out the census's wrapper: what jax's own object offers
    still works (lower, static arguments, methods, jit of jit, grad, vmap, the name)."""
    out = run(cluster, """import functools, jax.numpy as jnp
@functools.partial(jax.jit, static_argnums=1)
def power(v, k):
    return v ** k
class Model:
    scale = 3.0
    @functools.partial(jax.jit, static_argnums=0)
    def apply(self, v):
        return v * 2
twice = jax.jit(jax.jit(lambda v: v * 2))
import copy
copied = copy.deepcopy(power)  # (copy and pickle rebuild the wrapper without __init__)
print(copied(2.0, 3), power.lower(2.0, 3).compile()(2.0), power.__name__,
      Model().apply(1.0), twice(1.0), jax.grad(jax.jit(lambda v: v ** 2))(3.0),
      jax.vmap(jax.jit(lambda v: v + 1))(jnp.arange(2.0)),
      jax.pmap(lambda v: v + 1)(jnp.zeros(jax.local_device_count())))""")
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1] 8.0 8.0 power 2.0 2.0 6.0 [1. 2.] [1. 1.]\n", out.stdout
    # (the jitted calls above ran on each process's own values: only the pmap, over every
    # process's devices, is a cross-process launch)
    listed = run(cluster, "%spmd census").stdout
    assert "Ranks 0-1: 1 cross-process launch\n          1  pmap(<lambda>) float32[2] (line 16)" \
        in listed, listed


def test_a_report_leaves_out_a_rank_that_had_not_begun_the_cell(cluster):
    """The report asks each rank for this cell's record: a rank that has not begun the cell
    (here held in a pre_run_cell hook before its record starts; at many ranks, a ^C or a
    death right after the send) answers with none, not with its last cell's, which would
    read as other programs than this cell's."""
    out = run(cluster, "s = total(x)\nimport time\n"
                       "def held(info=None, _once=[]):\n"
                       "    if not _once:\n        _once.append(1)\n        time.sleep(60)\n"
                       "if rank == 1:\n"
                       "    get_ipython().events.callbacks['pre_run_cell'].insert(0, held)")
    assert out.error is None, report(out)
    out = run(cluster, "%%spmd --timeout 3\nm = jax.jit(lambda x: x.max())(x)\n"
                       "m.block_until_ready()")
    text = report(out)
    assert "Timed out after 3 s" in text, text
    assert "programs differ" not in text, text
    assert ("Census of the cell's cross-process programs:\n  Rank 1 had not begun the cell "
            "(still before its first line): its launches are not compared.") in text, text


def test_the_watchdog_tells_a_rank_ahead_of_a_finished_one_from_one_behind_it():
    """(no ranks) A busy rank whose launches begin a finished rank's is behind; one with more,
    or with other shapes where the finished one had a launch, or blocked inside a launch past
    the finished one's last (``inside``), cannot meet it."""
    from spmd.cluster.lockstep.census import ahead, with_inside

    def record(*shapes: str, inside: str | None = None) -> dict:
        sigs = sorted(set(shapes) | ({inside} if inside else set()))
        rec = {"programs": [["pmap", "<lambda>", "line 1"]], "signatures": [[s] for s in sigs],
               "runs": [[0, sigs.index(s), 1] for s in shapes], "count": len(shapes),
               "dropped": 0}
        if inside:
            rec["inside"] = [["pmap", "<lambda>", "line 1"], [inside]]
        return with_inside(rec)

    finished = record("float32[2]", "float32[2]")
    digest = {0: [2, "hash"]}
    assert ahead({1: record()}, digest, {0: finished}) == []
    assert ahead({1: record("float32[2]")}, digest, {0: finished}) == []
    assert ahead({1: record("float32[2]", inside="float32[2]")}, digest, {0: finished}) == []
    assert ahead({1: record("float32[2]", "float32[2]", inside="float32[2]")}, digest,
                 {0: finished}) == [1]
    assert ahead({1: record("float32[3]")}, digest, {0: finished}) == [1]
    assert ahead({1: record(inside="float32[2]")}, {0: None}, {}) == [1]
    # (without the finished rank's whole record, the counts alone)
    assert ahead({1: record("float32[3]")}, digest, {}) == []
