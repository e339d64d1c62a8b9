"""A cell's value that is one jax.Array over several processes, shown once in the notebook.

Each rank sends what it holds of the part jax's printed form shows (spmd.engine.results);
here the parts become one small array laid out as numpy prints the whole (a gap where numpy
writes "..."), printed the way jax prints an array in one process. The cell's ``Out[n]`` is a
``GlobalValue``: it prints as that text and turns into the global value as numpy
(``%spmd gather``'s answer) the first time it is used as an array (``Out[3].sum()``,
``np.asarray(Out[3])``), fetched then from the ranks' own ``Out``, within ``--max-bytes``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from spmd.cluster.outputs import RankCell
from spmd.engine.results import MIME


def payloads(cells: dict[int, RankCell]) -> dict[int, dict]:
    """Each rank's part of a process-spanning jax.Array that is the cell's result ({} when
    the result is not one such array on every rank, or not the same array)."""
    found = {}
    for rank, cell in cells.items():
        for out in cell.outputs:
            if out.kind == "result" and MIME in out.data:
                found[rank] = out.data[MIME]
    if len(found) != len(cells) or not found:
        return {}
    identity = {(tuple(p["shape"]), p["dtype"], p["sharding"]) for p in found.values()}
    return found if len(identity) == 1 else {}


def text(parts: list[dict]) -> str:
    """The array as jax prints it in one process, from the ranks' parts."""
    first = parts[0]
    dtype = _numpy_dtype(first["dtype"])
    compact = np.zeros(first["compact"], dtype=dtype)
    for part in parts:
        for piece in part["pieces"]:
            data = np.frombuffer(base64.b64decode(piece["data"]), dtype=dtype)
            where = tuple(slice(a, a + n) for a, n in zip(piece["at"], piece["shape"]))
            compact[where] = data.reshape(piece["shape"])
    options = dict(first["options"])
    if first["summarized"]:
        options["threshold"] = 0  # (the gaps stand for what numpy leaves out)
    prefix = "Array("
    dtype_str = f"dtype={first['dtype']}" + (", weak_type=True" if first["weak_type"] else "")
    with np.printoptions(**options):
        s = np.array2string(compact, prefix=prefix, suffix=",", separator=", ",
                            max_line_width=options["linewidth"])
    last_line_len = len(s) - s.rfind("\n") + 1
    sep = " " if last_line_len + len(dtype_str) + 2 <= options["linewidth"] else " " * len(prefix)
    return f"{prefix}{s},{sep}{dtype_str})"


def about(part: dict) -> str:
    """One line: what the array is, beside its value."""
    return (f"(one array over {part['processes']} processes, {part['devices']} devices: "
            f"{part.get('layout') or part['sharding']})")


class GlobalValue(NDArrayOperatorsMixin):
    """A cell's ``Out[n]``: prints as jax prints the array; numpy when used as one."""

    def __init__(self, shown: str, shape: tuple, dtype, fetch: Callable[[], np.ndarray],
                 received: int) -> None:
        self._shown, self.shape = shown, tuple(shape)
        self.dtype = _numpy_dtype(dtype) if isinstance(dtype, str) else dtype
        self._fetch, self._value = fetch, None
        self.received = received  # bytes the ranks sent for the printed form

    @property
    def value(self) -> np.ndarray:
        """The global value, as numpy (fetched from the ranks the first time)."""
        if self._value is None:
            self._value = self._fetch()
        return self._value

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self._shown}

    def __repr__(self) -> str:
        return self._shown

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.value, dtype=dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(i.value if isinstance(i, GlobalValue) else i for i in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, key):
        return self.value[key]

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __iter__(self):
        return iter(self.value)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value, name)


def _numpy_dtype(name: str):
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends: numpy knows them once ml_dtypes is imported
        import ml_dtypes  # noqa: F401  (installed with jax)

        return np.dtype(name)
