"""What ``%spmd start`` already did in a rank, said in one line when a cell does it again.

JAX's tutorials begin with ``jax.config.update('jax_num_cpu_devices', 8)``, and its
multi-process guide with ``jax.distributed.initialize(...)``. In a rank both ran at its start:
the devices exist once jax's backend has started, and the job is joined. jax then raises a
long RuntimeError, one per rank. Here the same calls say what the rank already has: a second
initialize, or a device count that matches, gets one line and the cell carries on; a count
that does not gets one sentence (AlreadyStarted, shown without a traceback) with the
``%spmd start`` that gives what was asked.

torch's twin is the first line of nearly every script written for torchrun,
``dist.init_process_group("gloo")``; torch raises "trying to initialize the default process
group twice" on every rank, and the cells after it fail in turn. Here a call whose backend,
world size and rank match the group's (or leave them out) gets one line, the same on every
rank, and returns None as torch's does; one that asks for another gets one sentence. After
``dist.destroy_process_group()`` the call is torch's own, which joins again through the
variables torchrun sets (``RANK``, ``MASTER_PORT``..., set at start: torch_group.py), rank 0's
kept store found again on that port (torch's rendezvous asks for ``multi_tenant``); only the
store is given a name of its own for each new group (``rejoin`` says why).

``install`` runs once the rank has joined (the rank's kernel, engine/rank_kernel.py), on its main
thread, before any cell; the wrappers run on the cell's thread, the main thread, the only one
that reads or sets what the torch wrapper keeps (who made the group there is).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from urllib.parse import parse_qs, urlparse


def install() -> None:
    """Wrap jax.config.update and jax.distributed.initialize (where jax was imported), and
    torch.distributed.init_process_group (where the start joined torch's group)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        _install_jax(jax)
    dist = sys.modules.get("torch.distributed")
    # (torch imported but not joined, as a rank server's --preload does: nothing to say)
    if dist is not None and dist.is_available() and dist.is_initialized():
        _install_torch(dist)


def _install_jax(jax) -> None:
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


def _install_torch(dist) -> None:
    init = dist.init_process_group
    bind = inspect.signature(init).bind  # (torch's own names, whichever way a cell passes them)
    made_by = "%spmd start"  # (who made the group there is: a cell, after a destroy)
    joins = 0  # (the groups cells made in this process: the same count on every rank)

    # (wraps: torch's signature and help, which a notebook shows; users reach it as
    # dist.init_process_group, or import the name from torch.distributed after the start)
    @functools.wraps(init)
    def checked_init_process_group(*args, **kwargs):
        nonlocal made_by, joins
        __tracebackhide__ = True  # (IPython's tracebacks on the rank leave this frame out)
        asked = bind(*args, **kwargs).arguments  # (a name torch does not take: TypeError)
        if not dist.is_initialized():  # (destroyed by a cell: torch's own, as under torchrun)
            out = init(**rejoin(dist, asked, joins + 1))
            made_by, joins = "a cell", joins + 1
            return out
        have, n = str(dist.get_backend()), dist.get_world_size()
        refused = group_asked(asked, have, n, dist.get_rank(), made_by)
        if refused:
            raise _usage(refused)
        print(f"torch.distributed is already initialized: {made_by} joined the {n} "
              f"processes in one group, backend {have}: carrying on.")
        return None  # (what torch's returns)

    dist.init_process_group = checked_init_process_group


def rejoin(dist, asked: dict, joins: int) -> dict:
    """init_process_group's arguments for a cell's ``joins``-th group: ``asked``, with the
    store the rendezvous gives (rank 0's kept one, for env:// and tcp://) under a name of its
    own. torch names a default group "0" again after a destroy, and the kept store still holds
    the old group's keys under that name: a rank that reads one before its peer writes it anew
    connects to a port that is gone ("Gloo connectFullMesh failed ... Connection refused")."""
    if str(asked.get("backend") or "").lower() == "mpi":  # (MPI's own rendezvous: no store)
        return asked
    asked = dict(asked)
    store = asked.get("store")
    if store is None:  # (as torch's init does it, the URL's variables and defaults alike)
        timeout = asked.get("timeout") or dist.default_pg_timeout
        method = asked.pop("init_method", None) or "env://"
        if method == "env://":  # (rank 0's store on the master address only, as at start)
            from spmd.engine.join import torch_group

            torch_group.keep_store(timeout.total_seconds())
        store, asked["rank"], asked["world_size"] = next(dist.rendezvous(
            method, asked.get("rank", -1),
            asked.get("world_size", -1), timeout=timeout))
        store.set_timeout(timeout)
    asked["store"] = dist.PrefixStore(f"spmd-joined-by-a-cell-{joins}", store)
    return asked


def group_asked(asked: dict, have: str, n: int, rank: int, made_by: str = "%spmd start") -> str:
    """What to say to ``init_process_group(**asked)`` in rank ``rank`` of a group of ``n``
    with backend ``have``: '' where it asks for that group (or leaves it to torch)."""
    query = parse_qs(urlparse(str(asked.get("init_method") or "")).query)
    # (tcp://host:port?rank=1&world_size=2 says them in the address)
    n_asked = _number(asked.get("world_size"), query.get("world_size"))
    rank_asked = _number(asked.get("rank"), query.get("rank"))
    backend = str(asked.get("backend") or "undefined").lower()
    # ("cpu:gloo,cuda:nccl" names one for each device: the group's must be among them)
    named = {part.rpartition(":")[2].strip() for part in backend.split(",")}
    other_backend = backend != "undefined" and have.lower() not in named
    other_size = n_asked not in (None, n)
    said = f"torch.distributed is already initialized: {made_by}"
    if other_backend or other_size:
        wanted = ", ".join(([f"{n_asked} processes"] if other_size else [])
                           + ([f"backend {backend}"] if other_backend else []))
        line = start_line(n_asked if other_size else n,
                          named.pop() if other_backend and len(named) == 1 else have)
        return (f"{said} joined the {n} processes in one group, backend {have} (this asks "
                f"for {wanted}): %spmd stop, then {line} gives it.")
    if rank_asked not in (None, rank):
        return (f"{said} made this process rank {rank} of {n} (this asks for rank "
                f"{rank_asked}): leave rank out (torch reads the RANK variable), or pass "
                "rank=dist.get_rank().")
    return ""


def start_line(n: int, torch_backend: str) -> str:
    """The ``%spmd start`` of this rank's cluster with ``n`` processes and ``torch_backend``
    (the options a rank knows of; the notebook's --hosts and the like are not among them),
    in the words of options.start_args (which a rank does not import)."""
    from spmd.engine.join.placement import BACKEND_ENV, CPU_DEVICES_ENV, TORCH_INIT_ENV

    backend = os.environ.get(BACKEND_ENV, "torch")
    args = ["-n", str(n), "--backend", backend]
    if int(os.environ.get(CPU_DEVICES_ENV) or 0):
        args += ["-d", os.environ[CPU_DEVICES_ENV]]
    args += ["--torch-backend", torch_backend]
    if os.environ.get(TORCH_INIT_ENV) == "env":
        args += ["--init-method", "env"]
    return " ".join(["%spmd start", *args])


def _number(given, in_address) -> int | None:
    """A rank or world size asked for (None: not given, torch's -1 included)."""
    value = given if given not in (None, -1) else (in_address or [None])[0]
    return None if value in (None, -1, "-1") else int(value)


class AlreadyStarted(RuntimeError):
    """What a cell asked of jax or torch, which the rank's start already made otherwise;
    shown as its one sentence (IPython shows an exception by ``_render_traceback_`` where it
    has one)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def _usage(text: str) -> Exception:
    return AlreadyStarted(text)
