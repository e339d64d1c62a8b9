"""A cell's value that is one jax.Array (or torch DTensor) over several processes, shown once
in the notebook.

Each rank sends what it holds of the part jax's printed form shows (spmd.engine.arrays.results);
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

from spmd.cluster.session import RankCell
from spmd.wire import GLOBAL_ARRAY_MIME
from spmd.words import process_words


def payloads(cells: dict[int, RankCell]) -> dict[int, dict]:
    """Each rank's part of a process-spanning jax.Array that is the cell's result ({} when
    the result is not one such array on every rank, or not the same array)."""
    found = {}
    for rank, cell in cells.items():
        for out in cell.outputs:
            if out.kind == "result" and GLOBAL_ARRAY_MIME in out.data:
                found[rank] = out.data[GLOBAL_ARRAY_MIME]
    if len(found) != len(cells) or not found:
        return {}
    identity = {(tuple(p["shape"]), p["dtype"], p["sharding"]) for p in found.values()}
    return found if len(identity) == 1 else {}


def held_by_some(cells: dict[int, RankCell]):
    """(the ranks, one of their results, a part) where the cell's result is one jax.Array on
    the devices of some processes only, each of which prints it whole (a mesh of
    ``jax.devices()[:2]``; one replicated over processes 0-1): they print it as jax does, the
    same text, and every other rank sent its part of it, which is nothing; else None."""
    parts, plain = {}, {}
    for rank, cell in cells.items():
        for out in cell.outputs:
            if out.kind == "result":
                (parts if GLOBAL_ARRAY_MIME in out.data else plain)[rank] = out
    if not parts or not plain or len(parts) + len(plain) != len(cells):
        return None  # (one rank, or --ranks 0: its own value, as it is)
    holders = sorted(plain)
    sent = [out.data[GLOBAL_ARRAY_MIME] for out in parts.values()]
    if any(p.get("holders") != holders or p["pieces"] or p.get("library") for p in sent):
        return None
    if len({(tuple(p["shape"]), p["dtype"], p["sharding"]) for p in sent}) != 1 or len(
            {out.data.get("text/plain") for out in plain.values()}) != 1:
        return None
    return holders, plain[holders[0]], sent[0]


def about_held(holders: list[int], part: dict) -> str:
    """One line: the array lives on some processes' devices only."""
    who = process_words(holders)
    return (f"(one array on the {part['devices']} devices of {who} only: "
            f"{part.get('layout') or part['sharding']})")


class Incomplete(ValueError):
    """The ranks' parts do not cover what the printed form shows (some ranks did not run the
    cell, or held nothing of it): the cell keeps jax's placeholders."""


class Overlap(Incomplete):
    """Two ranks sent the same block: their parts are not of one array."""


def text(parts: list[dict]) -> str:
    """The array as jax prints it in one process (a DTensor: as torch prints the whole
    tensor), from the ranks' parts. Raises Incomplete."""
    first = parts[0]
    if first.get("library") == "torch":
        return _torch_text(parts)
    compact = compact_of(parts)
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


def compact_of(parts: list[dict]) -> np.ndarray:
    """What numpy prints of the array, laid out small (a gap where it writes "..."), from the
    ranks' parts. Raises Incomplete."""
    dtype = numpy_dtype(parts[0]["dtype"])
    compact = np.zeros(parts[0]["compact"], dtype=dtype)
    _fill(parts, compact, lambda raw: np.frombuffer(raw, dtype=dtype))
    return compact


def _fill(parts: list[dict], compact, decode: Callable) -> None:
    """Lay the ranks' pieces into ``compact`` (numpy or torch), where numpy's and torch's
    printed form shows them. Raises Incomplete where they leave a hole."""
    first = parts[0]
    filled = np.zeros(first["compact"], dtype=bool)
    for part in parts:
        for piece in part["pieces"]:
            data = decode(base64.b64decode(piece["data"]))
            where = tuple(slice(a, a + n) for a, n in zip(piece["at"], piece["shape"]))
            if filled[where].any():  # (one block from two ranks: not one array's parts)
                raise Overlap("the ranks' parts overlap")
            compact[where] = data.reshape(piece["shape"])
            filled[where] = True
    gaps = [(n - 1) // 2 if first["summarized"] and n != full else None
            for n, full in zip(first["compact"], first["shape"])]
    for axis, gap in enumerate(gaps):  # ("..." stands there: nothing to fill)
        if gap is not None:
            index = [slice(None)] * len(gaps)
            index[axis] = gap
            filled[tuple(index)] = True
    if not filled.all():
        raise Incomplete("the ranks' parts do not cover the printed form")


def _torch_text(parts: list[dict]) -> str:
    """A DTensor as torch prints the whole tensor in one process: by torch itself."""
    try:
        import torch
        from torch._tensor_str import printoptions
    except ImportError:
        raise Incomplete("torch is not installed where the notebook runs") from None
    first = parts[0]
    dtype = getattr(torch, first["dtype"])
    compact = torch.zeros(first["compact"], dtype=dtype)
    _fill(parts, compact, lambda raw: torch.frombuffer(bytearray(raw), dtype=dtype))
    options = dict(first["options"])
    if first["summarized"]:
        options["threshold"] = 0  # (the gaps stand for what torch leaves out)
    if first["requires_grad"]:
        compact.requires_grad_(True)
    with printoptions(**options):
        shown = repr(compact)
    if first["grad_fn"]:  # (torch's suffix for a tensor a graph made)
        shown = f"{shown[:-1]}, grad_fn=<{first['grad_fn']}>)"
    return shown


def about(part: dict, ranks: int = 0) -> str:
    """One line: what the array is, beside its value (``ranks``: how many ranks sent a part;
    an array on fewer processes' devices than that says which hold it)."""
    if part.get("library") == "torch":  # (a DTensor: one device per process)
        return f"(one DTensor over {part['processes']} processes: {part['layout']})"
    if len(part.get("holders") or ()) < ranks:
        return about_held(part["holders"], part)
    return (f"(one array over {part['processes']} processes, {part['devices']} devices: "
            f"{part.get('layout') or part['sharding']})")


class GlobalValue(NDArrayOperatorsMixin):
    """A cell's ``Out[n]``: prints as jax prints the array; numpy when used as one."""

    def __init__(self, shown: str, shape: tuple, dtype, fetch: Callable[[], np.ndarray],
                 received: int, ranks: list[int]) -> None:
        self._shown, self.shape = shown, tuple(shape)
        self.dtype = numpy_dtype(dtype) if isinstance(dtype, str) else dtype
        self._fetch, self._value, self._ranks = fetch, None, list(ranks)
        self.received = received  # bytes of array data the ranks sent for the printed form

    # (known without fetching: a variable inspector asks for these)
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    @property
    def value(self) -> np.ndarray:
        """The global value, as numpy (fetched from the ranks the first time)."""
        if self._value is None:
            self._value = self._fetch()
        return self._value

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self._shown}, {"spmd": {"ranks": self._ranks}}

    def __repr__(self) -> str:
        return self._shown

    def __array__(self, dtype=None, copy=None):
        return np.array(self.value, dtype=dtype, copy=True if copy else None)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        def plain(x):
            return x.value if isinstance(x, GlobalValue) else x

        if "out" in kwargs:
            kwargs["out"] = tuple(plain(o) for o in kwargs["out"])
        return getattr(ufunc, method)(*(plain(i) for i in inputs), **kwargs)

    def __getitem__(self, key):
        return self.value[key]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(self.value)

    def __iter__(self):
        return iter(self.value)

    def __reduce__(self):  # (pickled as the numpy value it stands for)
        return (np.asarray, (self.value,))

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "value":  # (a failed fetch must not recurse)
            raise AttributeError(name)
        return getattr(self.value, name)


def numpy_dtype(name: str):
    """numpy's dtype of that name (bfloat16 and friends too)."""
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends: numpy knows them once ml_dtypes is imported
        import ml_dtypes  # noqa: F401  (installed with jax)

        return np.dtype(name)
