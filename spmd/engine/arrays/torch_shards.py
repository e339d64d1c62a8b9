"""On a rank: the layout of a torch tensor, in the plain-data form of ``spmd.engine.arrays.shards``.

A DTensor (``torch.distributed.tensor``) is one global tensor spread over a DeviceMesh of
ranks, like a jax.Array over devices: each rank of the mesh is one "device" here, with the
rank's number as its id. Which block each mesh coordinate holds comes from torch's own
``_compute_local_shape_and_global_offset`` (what ``visualize_sharding`` draws with), so no rank
asks another. A plain tensor is each rank's own: one block, on that rank.
"""

from __future__ import annotations

import itertools
import sys


class PartialValues(ValueError):
    """A DTensor with a Partial placement: its local tensors are parts of a sum, not blocks."""


def is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    return torch is not None and isinstance(value, torch.Tensor)


def is_dtensor(value) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def layout(x, rank: int, everywhere: bool = False) -> dict:
    """The layout of tensor ``x`` held by ``rank``: its own block, or (``everywhere``, for a
    DTensor) every mesh rank's, computed from the placements alone."""
    if not is_dtensor(x):
        shape = list(x.shape)
        return {
            "shape": shape,
            "dtype": _dtype(x),
            "nbytes": x.numel() * x.element_size(),
            "sharding": "torch.Tensor",
            "mesh": None,
            "spec": None,
            "devices": {rank: rank},
            "platform": x.device.type,
            "blocks": [(rank, rank, [0] * len(shape), shape, 0)],
            "process": rank,
        }
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh = x.device_mesh
    ranks = mesh.mesh  # the global rank at each coordinate
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    shape = list(x.shape)
    mine = mesh.get_coordinate()
    blocks, seen = [], {}
    # Every coordinate, also where only this rank's block is wanted: replica ids count in
    # mesh order, the same on every rank.
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh.shape, list(coordinate), x.placements
        )
        starts = [int(o) for o in offset]
        stops = [a + int(n) for a, n in zip(starts, local)]
        key = (tuple(starts), tuple(stops))
        replica = seen[key] = seen.get(key, -1) + 1  # (in mesh order, as on every rank)
        if everywhere or (mine is not None and list(coordinate) == list(mine)):
            owner = int(ranks[coordinate])
            blocks.append((owner, owner, starts, stops, replica))
    return {
        "shape": shape,
        "dtype": _dtype(x),
        "nbytes": x.numel() * x.element_size(),
        "sharding": f"DTensor on {mesh!r}, placements {tuple(x.placements)!r}",
        "mesh": {str(name): int(size) for name, size in zip(names, mesh.shape)},
        "spec": "(" + ", ".join(repr(p) for p in x.placements) + ")",
        "devices": {int(r): int(r) for r in ranks.flatten().tolist()},
        "platform": mesh.device_type,
        "blocks": blocks,
        "process": rank,
    }


def pieces(x, expr: str, info: dict) -> tuple[list, list]:
    """The blocks this rank sends for ``%spmd gather`` (first copies only), and their data
    as numpy arrays."""
    if is_dtensor(x):
        partial = [p for p in x.placements if p.is_partial()]
        if partial:
            raise PartialValues(
                f"{expr} is {partial[0]!r} on its mesh (each rank holds a part of a sum, not a "
                f"block): gather {expr}.full_tensor() or {expr}.redistribute(...) instead"
            )
        local = x.to_local()
    else:
        local = x
    mine = [(b[2], b[3]) for b in info["blocks"] if b[4] == 0]
    return mine, [_numpy(local)] if mine else []


def _numpy(tensor):
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:  # bfloat16 and friends: the notebook casts back to the layout's dtype
        return tensor.float().numpy()
