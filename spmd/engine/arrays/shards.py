"""On a rank: what this process holds of a distributed array, as plain data.

jax.Arrays here; torch tensors and DTensors in ``spmd.engine.arrays.torch_shards``, in the same
form. The notebook calls these through ipyparallel's ``apply`` (signed messages; numpy buffers
travel without copies). Nothing here runs a collective: ``%spmd gather`` and
``%spmd sharding`` must work when the ranks are out of step, so each process only reports its
own addressable shards, and the notebook puts the pieces together.

A layout is a dict of plain values (no jax objects), so the notebook, which never imports
jax's backends, can draw it:

    shape, dtype, nbytes, sharding (its repr), mesh ({axis: size} or None), spec (or None),
    devices ({device id: process index} for every device the array lives on),
    blocks [(device id, process index, starts, stops, replica id)], process (this rank)
"""

from __future__ import annotations

import sys
from typing import Any

from spmd.engine.arrays import torch_shards
from spmd.engine.join import placement


class NotAnArray(TypeError):
    """The expression's value is not a jax.Array or a torch tensor."""


class TooLarge(ValueError):
    """The value is bigger than the notebook agreed to receive."""


def _evaluate(expr: str) -> Any:
    from IPython import get_ipython

    return eval(expr, get_ipython().user_ns)  # the user's own namespace on this rank


def _is_jax_array(value: Any) -> bool:
    jax = sys.modules.get("jax")  # a jax.Array exists only where jax was imported
    return jax is not None and isinstance(value, jax.Array)


def _array(value: Any, expr: str):
    if not (_is_jax_array(value) or torch_shards.is_tensor(value)):
        name = type(value).__name__
        article = "an" if name[:1].lower() in "aeiou" else "a"
        raise NotAnArray(f"{expr} is {article} {name}, not a jax.Array or a torch tensor")
    return value


def _rank() -> int:
    return placement.this_rank()


def any_layout(x, everywhere: bool = False) -> dict:
    """The layout of a jax.Array or a torch tensor (see the module's docstring)."""
    if torch_shards.is_tensor(x):
        return torch_shards.layout(x, _rank(), everywhere)
    return layout(x, everywhere)


def _bounds(index: tuple, shape: tuple) -> tuple[list[int], list[int]]:
    starts, stops = [], []
    for sl, size in zip(index, shape):
        start, stop, _ = sl.indices(size)
        starts.append(start)
        stops.append(stop)
    return starts, stops


def layout(x, everywhere: bool = False) -> dict:
    """The layout of jax.Array ``x``: this process's shards, or (``everywhere``) every
    device's, as jax computes them from the sharding without asking anyone."""
    import jax

    sharding = x.sharding
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    blocks = []
    if everywhere:
        seen: dict[tuple, int] = {}
        for device, index in sorted(
            sharding.devices_indices_map(x.shape).items(), key=lambda kv: kv[0].id
        ):
            starts, stops = _bounds(index, x.shape)
            key = (tuple(starts), tuple(stops))
            replica = seen[key] = seen.get(key, -1) + 1
            blocks.append((device.id, device.process_index, starts, stops, replica))
    else:
        for shard in x.addressable_shards:
            starts, stops = _bounds(shard.index, x.shape)
            blocks.append(
                (shard.device.id, shard.device.process_index, starts, stops, shard.replica_id)
            )
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "nbytes": int(x.size) * x.dtype.itemsize,
        "sharding": repr(sharding),
        "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
        "spec": None if spec is None else _spec_text(spec),
        "devices": {d.id: d.process_index for d in sharding.device_set},
        "platform": next(iter(sharding.device_set)).platform,
        "blocks": blocks,
        "process": jax.process_index(),
    }


def _spec_text(spec) -> str:
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("None")
        elif isinstance(entry, tuple):
            parts.append("(" + ", ".join(repr(e) for e in entry) + ")")
        else:
            parts.append(repr(entry))
    return f"P({', '.join(parts)})"


def describe(expr: str) -> dict:
    """This process's layout of the jax.Array or torch tensor that ``expr`` names."""
    return any_layout(_array(_evaluate(expr), expr))


def fetch(expr: str, max_bytes: int) -> list:
    """What this process holds of ``expr``'s value, for ``%spmd gather``.

    A jax.Array or torch tensor: ``[info, data, data, ...]``: its layout and, in
    ``info["pieces"]``, where each following numpy array goes (the shards this process holds
    first copies of, replica 0). The arrays are top-level items so that ipyparallel sends
    them as raw buffers, not inside a pickle. Anything else: ``[{"kind": "value", "value":
    value}]``.
    """
    value = _evaluate(expr)
    if not (_is_jax_array(value) or torch_shards.is_tensor(value)):
        size = getattr(value, "nbytes", 0)
        if size > max_bytes:
            raise TooLarge(f"{expr} is {size:,} bytes on this rank, over --max-bytes {max_bytes:,}")
        return [{"kind": "value", "value": value}]
    info = any_layout(value)
    if info["nbytes"] > max_bytes:
        raise TooLarge(f"{expr} is {info['nbytes']:,} bytes in all, over --max-bytes {max_bytes:,}")
    if torch_shards.is_tensor(value):
        pieces, data = torch_shards.pieces(value, expr, info)
    else:
        import numpy as np

        shards = [s for s in value.addressable_shards if s.replica_id == 0]
        pieces = [_bounds(s.index, value.shape) for s in shards]
        data = [np.asarray(s.data) for s in shards]
    return [{"kind": "array", "layout": info, "pieces": pieces}, *data]


def shown_token(x) -> list[int]:
    """Which object ``x`` is, across restarts: its id in this process. (A restarted rank is a
    new process, forked from the same heap image as the one before: an id alone, with its
    cell count from 1 again, could name another array.)"""
    import os

    return [os.getpid(), id(x)]


def fetch_shown(label: str, shown: dict[int, tuple[int, int]], max_bytes: int) -> list:
    """``fetch`` of the value a cell showed (``label``, the notebook's ``Out[n]``), from this
    rank's own ``Out``: ``shown`` says under which number each rank keeps it, and which
    object it was (a restarted rank numbers its cells from 1 again)."""
    from IPython import get_ipython

    out = get_ipython().user_ns.get("Out", {})
    count, token = shown.get(_rank(), (None, None))
    if count not in out or shown_token(out[count]) != list(token or ()):
        raise KeyError(f"{label} is no longer on this rank (it was restarted since)")
    return fetch(f"Out[{count}]", max_bytes)


def spanning(names: list[str]) -> list[list]:
    """Which of ``names`` are jax.Arrays that this process cannot print or turn into numpy on
    its own (asked of a rank that could not), each as [name, the processes whose devices hold it, whether those print it whole
    (a mesh of some processes' devices: on one process's, or copied on each)]."""
    import jax
    from IPython import get_ipython

    ns = get_ipython().user_ns
    found = []
    for name in names:
        x = ns.get(name)
        if not _is_jax_array(x) or not x.committed:  # (uncommitted: this process's own)
            continue
        if x.is_fully_addressable or (x.is_fully_replicated
                                      and x.sharding.has_addressable_devices):
            continue  # (this process prints it: not the one the others could not)
        holders = sorted({device.process_index for device in x.sharding.device_set})
        whole = len(holders) == 1 or x.sharding.is_fully_replicated
        if len(holders) < jax.process_count() or not whole:
            found.append([name, holders, whole and len(holders) < jax.process_count()])
    return found


def receive(name: str, value: Any) -> None:
    """``%spmd push``: put ``value`` in this rank's namespace under ``name``."""
    from IPython import get_ipython

    get_ipython().user_ns[name] = value


def show(x, title: str = "") -> None:
    """Display one picture of ``x``'s layout over every process and device.

    Call it in a cell on the ranks: every process computes the same picture from the
    sharding alone (no communication), so the notebook shows it once.
    """
    from IPython.display import display

    from spmd.picture import bundle

    name = title or ("DTensor" if torch_shards.is_dtensor(x) else type(x).__name__)
    display(bundle(any_layout(_array(x, name), everywhere=True), name), raw=True)
