"""Two cells of JAX's tutorials that one process runs and several processes did not: a float64
numpy value put on a mesh of every device (jax's check calls it different on each process),
and a mesh of the first devices, which are one process's only. Each is checked against one
process of all 8 devices running the same cells; the workaround's parts of jax are looked for
at the start, and the docs show the program that shows jax's fault."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
from conftest import ready_cluster, report, run

from spmd.magics.cells.render import RankErrors

pytestmark = pytest.mark.timeout(240)

SETUP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
rank = jax.process_index()
"""

PUT = ("x = np.random.default_rng(0).normal(size=(8,))\n"
       "y = jax.device_put(x, NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))\n"
       "print(y, y.dtype)")
FIRST_TWO = ("m2 = jax.make_mesh((2,), ('i',), axis_types=(jax.sharding.AxisType.Auto,))\n"
             "h = jax.shard_map(lambda a: a * 2, mesh=m2, in_specs=P('i'), "
             "out_specs=P('i'))(jnp.arange(4.0))\n"
             "print(h)\n"
             "rows = list(h)")


def one_process(cell: str) -> str:
    """What ``cell`` prints in one process with all 8 devices."""
    program = "\n".join(["import jax", "jax.config.update('jax_num_cpu_devices', 8)", SETUP,
                         cell])
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def two(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 4", SETUP)


def test_a_float64_value_the_same_on_every_process_is_put_as_one_process_puts_it(two):
    """jax's device_put check gathers the value as float32 (x64 off) and compares it with the
    float64 input: every rank raised "not the same on each process". Here the cell prints
    what one process prints."""
    out = run(two, PUT)
    assert out.error is None, report(out)
    assert out.stdout == "[ranks 0-1]\n" + one_process(PUT), out.stdout


def test_a_value_that_differs_by_process_still_raises_jaxs_error(two):
    out = run(two, "z = jax.device_put(np.arange(8.0) + rank, "
                   "NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))")
    assert isinstance(out.error, RankErrors), out
    assert "passed to device_put is not the same on each process" in str(out.error)
    # and a program's own assert_equal is jax's, float64 and all (a grace no loaded machine
    # reaches: rank 0's copy of the gathered value may come seconds after rank 1 raised)
    out = run(two, "%%spmd --grace 60\nfrom jax.experimental import multihost_utils\n"
                   "multihost_utils.assert_equal(np.float64(0.1))")
    assert isinstance(out.error, RankErrors), out
    assert "AssertionError" in str(out.error)


def test_a_mesh_of_one_processs_devices_is_said_above_jaxs_error(two):
    """jax.make_mesh((2,), ...) takes the first 2 of 8 devices, process 0's: print(h) shows
    the value as one process does; list(h) fails on rank 1 with jax's bare assertion, and one
    sentence above it says that rank 1 holds none of the mesh's devices and what to make
    instead."""
    reference = one_process(FIRST_TWO)
    out = run(two, FIRST_TWO)
    assert isinstance(out.error, RankErrors), out
    lines = "\n".join(out.error._render_traceback_())
    said = lines.find("The mesh this fails on is over 2 devices of process 0 only, and "
                      "process 1 holds none of them, so its arrays on that mesh hold nothing: "
                      "make the mesh over all jax.device_count() = 8 devices of every process "
                      "instead, as jax.make_mesh((8,), ...) or "
                      "jax.sharding.Mesh(np.array(jax.devices()).reshape(...), ...) does.")
    assert 0 <= said < lines.find("AssertionError"), lines
    assert "[rank 1] AssertionError" in lines, lines
    assert out.stdout.startswith("[ranks 0-1] " + reference), out.stdout


def test_an_error_that_meets_no_mesh_gets_no_sentence_about_one(two):
    """A mesh of one process's devices defined in the notebook plays no part in an error jax
    did not raise: no sentence about it (the cell's frame holds every name of the notebook)."""
    out = run(two, "last = jax.sharding.Mesh(np.array(jax.devices()[-2:]), ('x',))\n"
                   "if rank == 0:\n    raise ValueError('boom')")
    text = "\n".join(out.error._render_traceback_())
    assert "ValueError: boom" in text and "The mesh this fails on" not in text, text


def test_the_hint_names_the_array_the_failing_rank_could_not_print(two):
    """Each rank's own array on its own device (committed) beside an array over both
    processes: np.asarray fails on the second, and the hint names it, not the rank's own."""
    out = run(two, "mine = jax.device_put(jnp.arange(3.0) + rank, jax.local_devices()[0])\n"
                   "spread = jax.device_put(jnp.arange(8.0), "
                   "NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))\n"
                   "np.asarray(mine) + np.asarray(spread)")
    text = "\n".join(out.error._render_traceback_())
    assert "%spmd gather spread puts it together" in text, text
    assert "mine lives on" not in text, text


def test_the_sentence_names_every_process_that_holds_none():
    """On 4 processes, a mesh of processes 0-1's devices: processes 2-3 hold none (the rank
    asked answers which processes hold the mesh; the notebook names the others)."""
    from spmd.engine.arrays import mesh_errors
    from spmd.magics.arrays import meshes

    class FourRanks:
        settings = types.SimpleNamespace(n=4)

        def call(self, rank, fn, *args, timeout):
            assert rank == 2 and fn is mesh_errors.out_of_reach
            return [[0, 1], 4, 8]

    said = meshes.mesh_hint(FourRanks(), [((2, 3), None)])
    assert said.startswith("The mesh this fails on is over 4 devices of processes 0-1 only, "
                           "and processes 2-3 hold none of them, so their arrays on that mesh "
                           "hold nothing: make the mesh over all jax.device_count() = 8 "
                           "devices of every process instead"), said


def test_a_jax_whose_device_put_check_moved_fails_the_start_in_one_sentence():
    """In the versions with the fault, a part device_put.py uses that is not there is one
    sentence naming it and jax's version (the rank's start raises it); in a version outside
    them nothing is looked for and jax's check stays jax's."""
    program = textwrap.dedent("""
        import dataclasses, jax
        from jax.experimental import multihost_utils
        from spmd import internals
        from spmd.engine.arrays import device_put

        kept = list(internals.INTERNALS)
        def use(which, **change):
            internals.INTERNALS[:] = [
                dataclasses.replace(i, **change)
                if device_put.USED_IN in i.why and which in i.path else i for i in kept]
        use("_device_put_sharding_impl", path="_device_put_sharding_impl_gone")
        try:
            device_put.install()
        except internals.InternalsChanged as exc:
            print(exc)
        use("", versions="0.1-0.2")
        device_put.install()
        print(getattr(multihost_utils.assert_equal, "_spmd_canonical", False))
        internals.INTERNALS[:] = kept
        device_put.install()
        print(getattr(multihost_utils.assert_equal, "_spmd_canonical", False))
        """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    said, outside, inside = done.stdout.splitlines()
    assert said.startswith(f"jax {jax_version()} has no jax._src.dispatch."
                           "_device_put_sharding_impl_gone, which jupyter-spmd needs for "
                           "device_put of a float64 numpy value"), said
    assert "(jax 0.6-0.10, the versions with that fault; engine/arrays/device_put.py)" in said, said
    assert said.count("has no") == 1, said
    assert (outside, inside) == ("False", "True")


def test_the_internals_page_shows_the_program_that_shows_jaxs_fault():
    """docs/reference/internals.md, made from spmd/internals.py: the two lines, and the
    versions, so a user can see the fault is jax's."""
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_ext"
    sys.path.insert(0, str(docs))
    try:
        from spmd_docs import internals as page_of
    finally:
        sys.path.remove(str(docs))
    page = page_of.page()
    assert "### A fault of jax worked around" in page
    assert ("x = np.random.default_rng(0).normal(size=(8,))\n"
            "jax.device_put(x, NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))\n```"
            ) in page
    assert "`jax._src.dispatch._device_put_sharding_impl` (jax 0.6-0.10 only)" in page


def jax_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("jax")
