"""On a rank: ``jax.device_put`` of a float64 numpy value (the same on every process) onto a
sharding over every process's devices, as one process does it.

jax checks that such a value is the same on every process (``_device_put_sharding_impl`` in
jax/_src/dispatch.py calls ``multihost_utils.assert_equal``). The check gathers the value
from every process, which turns float64 into float32 when x64 is off, and compares that with
the float64 input: any number float32 cannot hold exactly "differs", and every rank raises

    AssertionError: <class 'numpy.ndarray'> passed to device_put is not the same on each
    process. ... Expected: [ 0.12573022 ...]; got: [ 0.12573022 ...].

with the same numbers on both sides. One process never runs the check; it converts the value
to float32 and puts it on the devices. The two lines that show it is jax's (two processes of
``jax.distributed``, no jupyter-spmd)::

    x = np.random.default_rng(0).normal(size=(8,))
    jax.device_put(x, NamedSharding(jax.make_mesh((jax.device_count(),), ('x',)), P('x')))

Here the check compares what device_put puts on the devices: each numpy or Python value
converted to jax's dtype for it first (``jax.dtypes.canonicalize_dtype``), so a value the same
on every process after that conversion passes, as in one process, and one that differs still
raises jax's error. Only device_put's check is changed (by its caller's code object); a call
of ``assert_equal`` from a program is jax's own. jax 0.6 to 0.10 (the versions pyproject.toml
allows; seen in 0.10.2); spmd/internals.py lists the parts it uses, checked when a rank
starts.

Threads: ``install`` runs once on the rank's main thread; the wrapper runs on whichever thread
calls device_put.
"""

from __future__ import annotations

import functools
import sys

# The jax minors whose device_put check has the fault: from FIRST, up to FIXED_IN (None: no
# release allowed by pyproject.toml fixes it yet).
FIRST = (0, 6)
FIXED_IN: tuple[int, int] | None = None


def install() -> None:
    """Wrap the ``assert_equal`` device_put calls (where jax is imported; once)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    try:
        from jax._src import dispatch
        from jax.experimental import multihost_utils
    except ImportError:  # (moved: the check stays jax's; spmd/internals.py says so)
        return
    check = multihost_utils.assert_equal
    if getattr(check, "_spmd_canonical", False) or not _applies(jax.__version__):
        return
    caller = getattr(dispatch, "_device_put_sharding_impl", None)
    if caller is None:
        return
    device_put_check = caller.__code__

    @functools.wraps(check)
    def assert_equal(in_tree, fail_message: str = ""):
        if sys._getframe(1).f_code is device_put_check and not jax.config.jax_enable_x64:
            in_tree = jax.tree.map(_as_put, in_tree)
        return check(in_tree, fail_message)

    assert_equal._spmd_canonical = True
    multihost_utils.assert_equal = assert_equal


def _applies(version: str) -> bool:
    try:
        minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return minor >= FIRST and (FIXED_IN is None or minor < FIXED_IN)


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
