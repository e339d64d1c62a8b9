"""On a rank: ``jax.device_put`` of a float64 numpy value (the same on every process) onto a
sharding over every process's devices, as one process does it.

jax checks that such a value is the same on every process (``_device_put_sharding_impl`` in
jax/_src/dispatch.py calls ``multihost_utils.assert_equal``). The check gathers the value
from every process, which turns float64 into float32 when x64 is off, and compares that with
the float64 input: any number float32 cannot hold exactly "differs", and every rank raises

    AssertionError: <class 'numpy.ndarray'> passed to device_put is not the same on each
    process. ... Expected: [ 0.12573022 -0.13210486  0.64042264 ...]; got: [ 0.12573022
    -0.13210486  0.64042265 ...].

(the float32 copy of every process, and this process's float64 value). One process never
runs the check; it converts the value to float32 and puts it on the devices. The two lines
that show it is jax's (two processes of ``jax.distributed``, no jupyter-spmd)::

    x = np.random.default_rng(0).normal(size=(8,))
    jax.device_put(x, NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))

Here the check compares what device_put puts on the devices: each numpy or Python value
converted to jax's dtype for it first (``jax.dtypes.canonicalize_dtype``), so a value the same
on every process after that conversion passes, as in one process, and one that differs still
raises jax's error. Only device_put's check is changed (by its caller's code object); a call
of ``assert_equal`` from a program is jax's own.

The jax versions with the fault and the parts of jax used here are listed in
spmd/internals.py (its ``versions`` and ``fault``; docs/reference/internals.md shows the
program above). It is installed when the rank joins, where jax is a backend (then jax is
imported and jax.distributed initialized by the start; without jax as a backend a rank is one
process of jax, which never runs the check). In those versions a part that moved fails the
start in one sentence, as a required part does, instead of leaving the fault in place without
a word.

Threads: ``install`` runs once on the rank's main thread; the wrapper runs on whichever thread
calls device_put.
"""

from __future__ import annotations

import functools
import sys

USED_IN = "engine/arrays/device_put.py"  # (how spmd/internals.py's entries name this module)


def install() -> None:
    """Wrap the ``assert_equal`` device_put calls (where jax is imported, in the versions
    with the fault; once). Raises InternalsChanged where a part it uses moved."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    from spmd import internals

    parts = [item for item in internals.INTERNALS if USED_IN in item.why]
    if not all(internals.applies(item) for item in parts):
        return  # (a jax without the fault: its check is right)
    problems = internals.missing("rank", used_in=USED_IN)
    if problems:
        raise internals.InternalsChanged(" ".join(problems))
    from jax._src import dispatch
    from jax.experimental import multihost_utils

    check = multihost_utils.assert_equal
    if getattr(check, "_spmd_canonical", False):
        return
    device_put_check = getattr(dispatch._device_put_sharding_impl, "__code__", None)
    if device_put_check is None:  # (wrapped in a jax to come: its caller is not this code)
        raise internals.InternalsChanged(
            f"jax {jax.__version__}'s jax._src.dispatch._device_put_sharding_impl is not a "
            f"plain function, which jupyter-spmd needs for {parts[0].why}: install a version "
            "where it is (see pyproject.toml).")

    @functools.wraps(check)
    def assert_equal(in_tree, fail_message: str = ""):
        if sys._getframe(1).f_code is device_put_check and not jax.config.jax_enable_x64:
            in_tree = jax.tree.map(_as_put, in_tree)
        return check(in_tree, fail_message)

    assert_equal._spmd_canonical = True
    multihost_utils.assert_equal = assert_equal


def _as_put(value):
    """A numpy or Python value as device_put puts it on the devices: in jax's dtype for it
    (float64 as float32 with x64 off); anything else as it is."""
    import jax
    import numpy as np

    if isinstance(value, (np.ndarray, np.generic, bool, int, float, complex)):
        array = np.asarray(value)
        if array.dtype.kind in "biufc":
            return array.astype(jax.dtypes.canonicalize_dtype(array.dtype), copy=False)
    return value
