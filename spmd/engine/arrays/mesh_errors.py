"""On a rank: whether its last error met a mesh of other processes' devices only.

JAX's tutorials make meshes of the first devices (``jax.make_mesh((2,), ('i',))`` takes the
first 2 of all the devices). On several processes those are some processes' devices only; on
the others an array on that mesh holds nothing, and some of jax's operations fail there with a
bare assertion (iterating it: ``assert self.is_fully_replicated or self.is_fully_addressable``).
The notebook asks a failing rank (magics/arrays/meshes.py ``mesh_hint``) whether its error, raised
in jax, holds such a mesh, sharding or array in jax's own frames, to say so above jax's error
(not in a cell's frame, which holds every name of the notebook).

Threads: ``out_of_reach`` runs on the rank's main thread (an apply request between cells) and
only reads the traceback IPython kept.
"""

from __future__ import annotations

import os
import sys


def out_of_reach() -> list | None:
    """In this rank's last error, the first mesh, sharding or jax.Array (innermost frame
    first) on the devices of some processes only, this one not among them: [those processes,
    its devices, every device in the job]; None where there is none."""
    jax = sys.modules.get("jax")
    tb = getattr(sys, "last_traceback", None)
    if jax is None or tb is None:
        return None
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    # (only an error jax raised, and only jax's own frames: a cell's frame holds every name
    # of the notebook, a mesh among them whatever failed)
    frames = [f for f in frames if _JAX in os.path.abspath(f.f_code.co_filename)]
    if not frames or frames[-1] is not tb_last(sys.last_traceback):
        return None
    here, count = jax.process_index(), jax.process_count()
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            devices = _devices_of(jax, value)
            if not devices:
                continue
            holders = sorted({device.process_index for device in devices})
            if here not in holders and len(holders) < count:
                return [holders, len(devices), jax.device_count()]
    return None


_JAX = os.sep + "jax" + os.sep


def tb_last(tb):
    """The innermost frame of a traceback: where the error was raised."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def _devices_of(jax, value) -> list:
    """The devices of a mesh, a sharding or an array ([] for anything else, or a tracer)."""
    try:
        if isinstance(value, jax.sharding.Mesh):
            return list(value.devices.flat)
        if isinstance(value, jax.sharding.Sharding):
            return list(value.device_set)
        if isinstance(value, jax.Array):
            return list(value.sharding.device_set)
    except Exception:  # (a tracer, an array being deleted: nothing to tell)
        pass
    return []
