"""On a rank: a cell's value that is one jax.Array (or torch DTensor) over several processes,
shown once.

jax prints such an array as a placeholder (``Array(shape=(16,), dtype=float32)``) because no
process holds all of it. As a cell's result, each rank sends the notebook what it holds of the
part the printed form shows (everything, for an array numpy prints whole; the corners it
prints, ``edgeitems`` along each axis, for a summarized one), under its own MIME type beside
jax's placeholder; the notebook puts the parts together and prints the array as jax prints it
in one process (spmd.magics.arrays.values). No collective runs: it is the same data path as
``%spmd gather``, bounded by what the printed form needs. Arrays each process holds whole, and
fully replicated ones, print as jax prints them.

A torch DTensor is the same, with torch's print options, and printed in the notebook by torch
(where torch is not installed there, each rank's DTensor is shown as torch prints it).
"""

from __future__ import annotations

import base64
import itertools
import sys
import threading

from spmd import wire
from spmd.engine.arrays.shards import shown_token

# numpy's print options that decide the printed form (the notebook prints with the rank's)
_OPTIONS = ("edgeitems", "threshold", "linewidth", "precision", "suppress", "floatmode",
            "sign", "nanstr", "infstr", "legacy")


def show_global_arrays(shell) -> None:
    """Show process-spanning jax.Arrays and torch DTensors once (their library imported now,
    or by a later cell): formatters of the shell's, which give parts for a cell's result only
    (``formatting_result``)."""
    formatter = shell.display_formatter.mimebundle_formatter
    jax = sys.modules.get("jax")
    if jax is not None:
        formatter.for_type(jax.Array, _bundle)
    else:  # (by the concrete class's name, looked up once a value of it is shown)
        formatter.for_type_by_name("jaxlib._jax", "ArrayImpl", _bundle)
    formatter.for_type_by_name("torch.distributed.tensor", "DTensor", _torch_bundle)


def formatting_result(compute, result):
    """``compute(result)``: the shell's displayhook formatting a cell's result (the rank's
    shell, engine/rank_kernel.py). Only then are the parts made in the bundle; a display() of one
    is marked as a print is, its parts sent with the cell's reply (``_displayed``)."""
    _showing.result = True
    try:
        return compute(result)
    finally:
        _showing.result = False


def _layout_words(sharding) -> str:
    """The sharding in a few words: ``mesh x=4, y=2, P('x', 'y')`` (else jax's repr)."""
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return repr(sharding)
    from spmd.engine.arrays.shards import _spec_text

    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"mesh {axes}, {_spec_text(spec)}"


def _corner_ranges(n: int, edge: int, summarize: bool) -> list[tuple[int, int, int]]:
    """(start, stop, where it goes in the compact axis) of what numpy prints of an axis of n."""
    if not summarize or n <= 2 * edge:
        return [(0, n, 0)]
    return [(0, edge, 0), (n - edge, n, edge + 1)]  # (a gap at ``edge``: numpy's "...")


# What one rank may send for a printed form (numpy's threshold raised to show everything
# must not send a whole array through the notebook's channel): above it, jax's placeholder.
MAX_BYTES = 1 << 20


# Whether the shell's displayhook is formatting a cell's result now (main thread: the cell's).
_showing = threading.local()


def _bundle(x, include=None, exclude=None) -> dict | None:
    try:
        if not getattr(_showing, "result", False):
            return _displayed(x)
        return _parts(x)
    except Exception:  # (an array of a kind this does not know: jax's own repr, not an error)
        return None


# display(x): its text/plain marked, its parts sent with the cell's reply, as a print of it,
# so a display of one array as often as a cell likes sends its corners once (set by
# engine/arrays/print_marks.py when it installs: its PrintMarks.display_text, bound to the rank
# kernel's; None: jax's own placeholder).
marked_display = None


def _displayed(x) -> dict | None:
    text = marked_display(x) if marked_display is not None else None
    return {"text/plain": text} if text is not None else None


def _parts(x) -> dict | None:
    import jax
    import numpy as np
    from IPython import get_ipython

    if x.is_fully_addressable or x.size == 0 or (
            x.is_fully_replicated and x.sharding.has_addressable_devices):
        return None  # (jax prints these itself; a process that holds none of a replicated
        # array sends its part, which is nothing: the notebook shows its holders' text)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return None  # (PRNG keys and the like: no numpy form)
    options = {k: v for k, v in np.get_printoptions().items() if k in _OPTIONS}
    if not np.isfinite(options["threshold"]):  # (JSON has no inf)
        options["threshold"] = sys.maxsize
    summarize = x.size > options["threshold"]
    edge = max(1, options["edgeitems"])
    axes = [_corner_ranges(n, edge, summarize) for n in x.shape]
    compact = [2 * edge + 1 if len(r) == 2 else n for r, n in zip(axes, x.shape)]
    if int(np.prod(compact)) * x.dtype.itemsize > MAX_BYTES:
        return None
    pieces = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts = [s.indices(n)[0] for s, n in zip(shard.index, x.shape)]
        stops = [s.indices(n)[1] for s, n in zip(shard.index, x.shape)]
        for parts in itertools.product(*axes):
            lo = [max(a, s) for (a, _, _), s in zip(parts, starts)]
            hi = [min(b, e) for (_, b, _), e in zip(parts, stops)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            local = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))
            data = np.ascontiguousarray(np.asarray(shard.data[local]))
            at = [c + a - p for (p, _, c), a in zip(parts, lo)]
            pieces.append({"at": at, "shape": list(data.shape),
                           "data": base64.b64encode(data.tobytes()).decode()})
    return {wire.GLOBAL_ARRAY_MIME: {
        "shape": list(x.shape),
        "dtype": x.dtype.name,
        "weak_type": bool(getattr(getattr(x, "aval", None), "weak_type", False)),
        "sharding": repr(x.sharding),
        "layout": _layout_words(x.sharding),
        "processes": len({d.process_index for d in x.sharding.device_set}),
        "holders": sorted({d.process_index for d in x.sharding.device_set}),
        "devices": len(x.sharding.device_set),
        "compact": compact,
        "summarized": summarize,
        "options": options,
        "pieces": pieces,
        "count": get_ipython().displayhook.prompt_count,  # (this rank's Out[count])
        "token": shown_token(x),  # (and that it is still this array: shards.fetch_shown)
    }}


# torch's print options that decide its printed form (torch._tensor_str.PRINT_OPTS)
_TORCH_OPTIONS = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")


def _torch_bundle(x, include=None, exclude=None) -> dict | None:
    try:
        if not getattr(_showing, "result", False):
            return _displayed(x)
        return _torch_parts(x)
    except Exception:  # (a DTensor of a kind this does not know: torch's own repr)
        return None


def _torch_parts(x) -> dict | None:
    """What this rank holds of the part torch's printed form of DTensor ``x`` shows, as the
    whole tensor would print in one process (``tensor([...])``)."""
    import torch
    import torch.distributed as dist
    from torch._tensor_str import PRINT_OPTS

    from spmd.engine.arrays import torch_shards

    if any(p.is_partial() for p in x.placements) or x.numel() == 0:
        return None  # (Partial: each rank holds a part of a sum; no block to show)
    options = {k: getattr(PRINT_OPTS, k) for k in _TORCH_OPTIONS}
    summarize = x.numel() > options["threshold"]
    edge = max(1, options["edgeitems"])
    axes = [_corner_ranges(n, edge, summarize) for n in x.shape]
    compact = [2 * edge + 1 if len(r) == 2 else n for r, n in zip(axes, x.shape)]
    if int(torch.Size(compact).numel()) * x.element_size() > MAX_BYTES:
        return None
    info = torch_shards.layout(x, dist.get_rank())
    local = x.to_local().detach()
    pieces = []
    for _, _, starts, stops, replica in info["blocks"]:
        if replica != 0:
            continue
        for parts in itertools.product(*axes):
            lo = [max(a, s) for (a, _, _), s in zip(parts, starts)]
            hi = [min(b, e) for (_, b, _), e in zip(parts, stops)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            data = local[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))]
            data = data.cpu().contiguous().reshape(-1).view(torch.uint8)
            at = [c + a - p for (p, _, c), a in zip(parts, lo)]
            pieces.append({"at": at, "shape": [b - a for a, b in zip(lo, hi)],
                           "data": base64.b64encode(data.numpy().tobytes()).decode()})
    from IPython import get_ipython

    grad_fn = type(x.grad_fn).__name__ if x.grad_fn is not None else None
    return {wire.GLOBAL_ARRAY_MIME: {
        "library": "torch",
        "shape": list(x.shape),
        "dtype": torch_shards._dtype(x),
        "requires_grad": bool(x.requires_grad and grad_fn is None),
        "grad_fn": grad_fn,
        "sharding": info["sharding"],
        "layout": f"mesh {', '.join(f'{k}={v}' for k, v in info['mesh'].items())}, "
                  f"{info['spec']}",
        "processes": len(info["devices"]),
        "devices": len(info["devices"]),
        "compact": compact,
        "summarized": summarize,
        "options": options,
        "pieces": pieces,
        "count": get_ipython().displayhook.prompt_count,
        "token": shown_token(x),
    }}
