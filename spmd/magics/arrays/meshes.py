"""The sentence above a cell's error where it failed on ranks that hold none of a mesh's
devices.

JAX's tutorials make meshes of the first devices (``jax.make_mesh((2,), ('i',))`` takes the
first 2 of all the devices), which on several processes are some processes' devices only; on
the others an array on that mesh holds nothing, and jax fails there with a bare assertion
(``assert self.is_fully_replicated or self.is_fully_addressable``). One failing rank is asked
(engine/arrays/mesh_errors.py ``out_of_reach``) whether jax's own frames of its error hold such a mesh,
sharding or array; the sentence says which processes hold the mesh, which hold none, and what
to make instead, above jax's own error (cell.py's ``cell_failure`` puts it among the hints).

Threads: ``mesh_hint`` runs on the notebook's main thread, as the cell's report is made.
"""

from __future__ import annotations

from spmd.cluster.session import Session
from spmd.engine.arrays import mesh_errors
from spmd.words import process_words


def mesh_hint(session: Session, errors: list) -> str:
    """One sentence for a cell that failed where a rank holds none of the devices of the mesh
    its error met ('' where the failing rank's error, raised in jax, met no such mesh).

    ``errors``: the cell's errors as RankErrors takes them, [(ranks, error), ...]."""
    failed = sorted(rank for ranks, _ in errors for rank in ranks)
    if not failed:
        return ""
    try:
        found = session.call(failed[0], mesh_errors.out_of_reach, timeout=5.0)
    except Exception:  # only a hint: without it, jax's error alone
        return ""
    if not found:
        return ""
    holders, devices, total = found
    none = [rank for rank in range(session.settings.n) if rank not in holders]
    one = len(none) == 1
    return (f"The mesh this fails on is over {devices} devices of {process_words(holders)} only, "
            f"and {process_words(none)} {'holds' if one else 'hold'} none of them, so "
            f"{'its' if one else 'their'} arrays on that mesh hold nothing: make the mesh over "
            f"all jax.device_count() = {total} devices of every process instead, as "
            f"jax.make_mesh(({total},), ...) or "
            "jax.sharding.Mesh(np.array(jax.devices()).reshape(...), ...) does.")
