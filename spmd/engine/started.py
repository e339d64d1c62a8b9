"""What ``%spmd start`` already did in a rank, said in one line when a cell does it again.

JAX's tutorials begin with ``jax.config.update('jax_num_cpu_devices', 8)``, and its
multi-process guide with ``jax.distributed.initialize(...)``. In a rank both ran at its start:
the devices exist once jax's backend has started, and the job is joined. jax then raises a
long RuntimeError, one per rank. Here the same calls say what the rank already has: a second
initialize, or a device count that matches, gets one line and the cell carries on; a count
that does not gets one sentence (AlreadyStarted, shown without a traceback) with the
``%spmd start`` that gives what was asked. ``install`` runs once the rank has joined
(the rank's kernel, engine/kernel.py), on its main thread; the wrappers run on the cell's thread, the main
thread.
"""

from __future__ import annotations

import functools
import sys


def install() -> None:
    """Wrap jax.config.update and jax.distributed.initialize (where jax was imported)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    update, initialize = jax.config.update, jax.distributed.initialize

    @functools.wraps(update)  # (its signature and help are jax's: a notebook reads them)
    def checked_update(*args, **kwargs):
        name = args[0] if args else kwargs.get("name")
        value = args[1] if len(args) > 1 else kwargs.get("val")
        if name != "jax_num_cpu_devices" or jax.devices()[0].platform != "cpu":
            return update(*args, **kwargs)
        local, total, n = jax.local_device_count(), jax.device_count(), jax.process_count()
        if int(value) in (local, total):
            print(f"jax_num_cpu_devices: each of the {n} processes already has its {local} "
                  f"CPU devices, {total} in all: carrying on.")
            return None
        raise _usage(devices_asked(int(value), local, total, n))

    @functools.wraps(initialize)
    def checked_initialize(*args, **kwargs):
        if not jax.distributed.is_initialized():
            return initialize(*args, **kwargs)
        # (whatever it was given: the job is joined, and cannot be joined again)
        print(f"jax.distributed is already initialized: %spmd start joined this process, "
              f"{jax.process_index()} of {jax.process_count()}: carrying on.")
        return None

    jax.config.update = checked_update
    jax.distributed.initialize = checked_initialize


def devices_asked(value: int, local: int, total: int, n: int) -> str:
    """What to say to ``jax_num_cpu_devices = value`` in a rank with ``local`` devices."""
    if value % n == 0:
        way = f"%spmd start -n {n} -d {value // n} gives {value} in all"
    else:
        way = f"%spmd start -n {n} -d {value} gives each process {value}"
    return (f"Each process already has its {local} CPU devices ({total} in all), made when "
            f"the cluster started: {way}.")


class AlreadyStarted(RuntimeError):
    """What a cell asked of jax, which the rank's start already made otherwise; shown as its
    one sentence (IPython shows an exception by ``_render_traceback_`` where it has one)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def _usage(text: str) -> Exception:
    return AlreadyStarted(text)
