"""The engine side: what every rank's process runs.

``python -m spmd.engine`` is the command ipyparallel launches for each engine. Each
engine knows its rank from the moment it starts (the launcher sets ``$SPMD_RANK`` and asks the
controller for the same engine id), so it imports jax and joins the distributed job on a
thread at once: the ~1 s import and the ~1 s ``jax.distributed.initialize`` overlap the
engine's own start-up and its registration with the controller, instead of following them.

``joined()`` is then called on every engine from the notebook (pickled by reference) to wait
for that thread and report this process's facts.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from spmd.engine import commands
from spmd.engine.orphans import watch_parent
from spmd.engine.stacks import listen_for_where

BACKEND_ENV = "SPMD_BACKEND"
CPU_DEVICES_ENV = "SPMD_CPU_DEVICES"
RANK_ENV = "SPMD_RANK"
NUM_PROCESSES_ENV = "SPMD_NUM_PROCESSES"
COORDINATOR_ENV = "SPMD_COORDINATOR"
INIT_TIMEOUT_ENV = "SPMD_INIT_TIMEOUT"

# The keyword arguments this rank passed to jax.distributed.initialize (``spmd.initialize_args``).
INITIALIZE_ARGS: dict[str, Any] = {}

# When this process reached each step of its start (time.time()), for the benchmarks.
TIMELINE: dict[str, float] = {"process_start": time.time()}


class BackendMissing(RuntimeError):
    """The engine's Python cannot import the requested backend."""


class _Join:
    """Imports the backend and joins the distributed job, on a thread, once."""

    def __init__(self) -> None:
        env = os.environ
        self.backend = env.get(BACKEND_ENV, "none")
        self.rank = int(env.get(RANK_ENV, "0"))
        self.num_processes = int(env.get(NUM_PROCESSES_ENV, "1"))
        self.coordinator = env.get(COORDINATOR_ENV, "")
        self.timeout = int(env.get(INIT_TIMEOUT_ENV, "300"))
        self.cpu_devices = int(env.get(CPU_DEVICES_ENV) or 0)
        self.error: BaseException | None = None
        self.facts: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="spmd-join", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            self.facts = self._join()
        except BaseException as exc:  # reported by joined(), in the notebook
            self.error = exc
        TIMELINE["joined"] = time.time()

    def _join(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "backend": self.backend,
            "local_devices": 0,
            "global_devices": 0,
        }
        if self.backend == "jax":
            jax = _import("jax")
            TIMELINE["imported"] = time.time()
            if self.cpu_devices:
                # Must happen before any jax operation creates the backends.
                jax.config.update("jax_num_cpu_devices", self.cpu_devices)
            INITIALIZE_ARGS.update(
                coordinator_address=self.coordinator,
                num_processes=self.num_processes,
                process_id=self.rank,
                # Listen on the coordinator's own address only, never on all interfaces.
                coordinator_bind_address=self.coordinator,
                initialization_timeout=self.timeout,
            )
            jax.distributed.initialize(**INITIALIZE_ARGS)
            facts["local_devices"] = jax.local_device_count()
            facts["global_devices"] = jax.device_count()
            facts["platform"] = jax.devices()[0].platform
        elif self.backend == "torch":
            dist = _import("torch.distributed")
            TIMELINE["imported"] = time.time()
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{self.coordinator}",
                rank=self.rank,
                world_size=self.num_processes,
            )
            facts["local_devices"] = 1
            facts["global_devices"] = self.num_processes
        return facts


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendMissing(
            f"{name.split('.')[0]} cannot be imported in the engines' Python "
            f"({sys.executable}: {exc})"
        ) from None


_join = _Join()


def _exit_now(signum: int, frame: Any) -> None:
    # XLA installs its own SIGTERM handler (a preemption notice) that ignores the signal, so
    # a polite stop would wait for the kill timeout. A rank has nothing to save.
    os._exit(128 + signum)


def joined() -> dict:
    """Wait until this rank has joined the distributed job; return this process's facts."""
    _join.wait()
    if _join.error is not None:
        raise _join.error
    if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
        del sys.modules["debugpy"]  # hidden by main() during start-up only
    # Signal handlers can only be set from the main thread, which is where this runs.
    signal.signal(signal.SIGTERM, _exit_now)
    from IPython import get_ipython

    commands.install(get_ipython())
    # faulthandler names threads by this id; the notebook picks the main thread's stack.
    main_thread = threading.main_thread().ident
    return dict(_join.facts, main_thread=main_thread, timeline=dict(TIMELINE))


def main() -> None:
    # ipykernel does not capture C-level output under pytest; a rank is not pytest, and
    # must behave the same in the tests as in a notebook.
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    # ipykernel imports debugpy at start-up, and debugpy scans sys.modules while it loads.
    # With jax being imported on the join thread at the same moment, the scan can fail
    # ("dictionary changed size during iteration") and take the engine down (seen about
    # once in 75 starts). ipyparallel connects no debugger to an engine, so debugpy stays
    # hidden until the rank has joined (``joined`` lets cells import it again).
    sys.modules.setdefault("debugpy", None)
    _join.start()
    listen_for_where()
    watch_parent()
    from ipyparallel.engine.app import main as engine_main

    engine_main()
