"""The engine side: what every rank's process runs.

``python -m spmd.engine`` is the command ipyparallel launches for each engine. Each
engine knows its rank from the moment it starts (the launcher sets ``$SPMD_RANK`` and asks the
controller for the same engine id), so it imports jax and joins the distributed job on a
thread at once: the ~1 s import and the ~1 s ``jax.distributed.initialize`` overlap the
engine's own start-up and its registration with the controller, instead of following them.

``joined()`` is then called on every engine from the notebook (pickled by reference) to wait
for that thread and report this process's facts, and to tell the rank's kernel (rank_kernel.py,
which ipyparallel's engine makes from the start, ``main``) that the rank has joined.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from importlib.metadata import version
from typing import Any

from spmd import internals
from spmd.engine.join import jit_cache, placement, torch_group
from spmd.engine.join.address import address_toward, coordinator_addresses, wait_listening
from spmd.engine.life import unattended
from spmd.engine.life.orphans import exit_now, watch_parent
from spmd.engine.watch.stacks import listen_for_where

BACKEND_ENV = placement.BACKEND_ENV
CPU_DEVICES_ENV = placement.CPU_DEVICES_ENV
RANK_ENV = placement.RANK_ENV
NUM_PROCESSES_ENV = "SPMD_NUM_PROCESSES"
COORDINATOR_ENV = "SPMD_COORDINATOR"  # jax's coordinator, host:port
TORCH_MASTER_ENV = "SPMD_TORCH_MASTER"  # torch's MASTER_ADDR:MASTER_PORT
TORCH_BACKEND_ENV = "SPMD_TORCH_BACKEND"  # gloo, nccl or mpi
TORCH_INIT_ENV = placement.TORCH_INIT_ENV
INIT_TIMEOUT_ENV = "SPMD_INIT_TIMEOUT"
# Engine ids of a later engine set start here (the controller lives across restarts, and
# an id is never given twice); the rank still comes from SPMD_RANK.
ENGINE_ID_OFFSET_ENV = "SPMD_ENGINE_ID_OFFSET"
# jax's persistent compilation cache, shared by the ranks and kept across restarts.
CACHE_DIR_ENV = "SPMD_COMPILATION_CACHE"

# The keyword arguments this rank passed to jax.distributed.initialize (``spmd.initialize_args``).
INITIALIZE_ARGS: dict[str, Any] = {}

# When this process reached each step of its start (time.time()), for the benchmarks.
TIMELINE: dict[str, float] = {"process_start": time.time()}


class BackendMissing(RuntimeError):
    """The engine's Python cannot import the requested backend."""


class StillJoining(RuntimeError):
    """The rank's join did not end in the start's time; its text says where it was."""


class _Join:
    """Imports the backend and joins the distributed job, on a thread, once."""

    def __init__(self) -> None:
        env = os.environ
        # "jax", "torch", "jax,torch" or "none"
        self.backends = [b for b in env.get(BACKEND_ENV, "none").split(",") if b != "none"]
        self.rank, self.local_rank, self.local_size = placement.place(env)
        self.num_processes = int(env.get(NUM_PROCESSES_ENV, "1"))
        per_process = env.get(placement.GPUS_PER_PROCESS_ENV)
        self.gpus_per_process = None if per_process in (None, "") else int(per_process)
        # Given at launch where the notebook knows rank 0's address (local ranks); else
        # rank 0 proposes them once it runs, and the notebook hands them to every rank.
        self.coordinators = {
            backend: env[var]
            for backend, var in (("jax", COORDINATOR_ENV), ("torch", TORCH_MASTER_ENV))
            if env.get(var)
        }
        self.torch_backend = env.get(TORCH_BACKEND_ENV, "gloo")
        self.torch_init = env.get(TORCH_INIT_ENV, "tcp")
        self._coordinator_given = threading.Event()
        if self.coordinators:
            self._coordinator_given.set()
        self.timeout = int(env.get(INIT_TIMEOUT_ENV, "300"))
        self.cache_dir = env.get(CACHE_DIR_ENV, "")
        self.cpu_devices = int(env.get(CPU_DEVICES_ENV) or 0)
        self.error: BaseException | None = None
        self.facts: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="spmd-join", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until the join ended; StillJoining, with where it is, after ``timeout`` seconds."""
        if self._thread.ident is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            import traceback

            frame = sys._current_frames().get(self._thread.ident)
            frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(
                "<frozen")] if frame else []  # (importlib's own frames say nothing)
            where = "".join(traceback.format_list(frames[-6:])) or "(gone)\n"
            raise StillJoining(f"still joining after {timeout:.0f} s, at:\n{where.rstrip()}")

    def give_coordinators(self, addresses: dict[str, str]) -> None:
        if not self._coordinator_given.is_set():
            self.coordinators = dict(addresses)
            self._coordinator_given.set()

    def _share_gpus(self, host: str) -> list[str] | None:
        """Pick this rank's GPUs and show only those to jax and torch (before they start)."""
        gpus = placement.share_gpus(
            self.local_rank,
            self.local_size,
            placement.host_gpus(),
            self.gpus_per_process,
            host,
        )
        if gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        # (when, and whether a backend had started by then: it reads them once, at its start;
        # a rank forked by the rank server has jax or torch imported, but not started)
        TIMELINE["gpus"] = time.time()
        TIMELINE["backend_before_gpus"] = float(_backend_started())
        # torch's name for a rank's place on its host (its device index, with GPUs)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        return gpus

    def _run(self) -> None:
        try:
            self.facts = self._join()
        except BaseException as exc:  # reported by joined(), in the notebook
            self.error = exc
        TIMELINE["joined"] = time.time()

    def _join(self) -> dict[str, Any]:
        host = socket.gethostname()
        facts: dict[str, Any] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": host,
            "backend": ",".join(self.backends) or "none",
            "local_devices": 0,
            "global_devices": 0,
            "gpus": self._share_gpus(host),
        }
        self._import_backends()
        if self.backends and not self._coordinator_given.wait(self.timeout):
            raise TimeoutError(f"no coordinator address came within {self.timeout} s")
        TIMELINE["coordinators"] = time.time()
        if "jax" in self.backends:
            facts.update(self._join_jax())
        if "torch" in self.backends:
            joined = torch_group.join(
                rank=self.rank,
                world_size=self.num_processes,
                local_rank=self.local_rank,
                local_size=self.local_size,
                master=self.coordinators["torch"],
                backend=self.torch_backend,
                init_method=self.torch_init,
                gpus_given=facts["gpus"] is not None,
                host=host,
                timeout=self.timeout,
            )
            if "jax" in facts["backend"]:  # jax's devices fill the rank table; torch adds its own
                joined = {k: v for k, v in joined.items() if k.startswith("torch")}
            facts.update(joined)
        return facts

    def _import_backends(self) -> None:
        """Import the backends and apply the settings that must precede their first use."""
        if "jax" in self.backends:
            jax = _import("jax")
            if self.cpu_devices:
                # Must happen before any jax operation creates the backends.
                jax.config.update("jax_num_cpu_devices", self.cpu_devices)
            if self.cache_dir:
                jit_cache.enable(self.cache_dir)
        if "torch" in self.backends:
            _import("torch.distributed")
        TIMELINE["imported"] = time.time()

    def _join_jax(self) -> dict[str, Any]:
        import jax

        coordinator = self.coordinators["jax"]
        if self.rank != 0:
            # Until rank 0's coordinator listens: a rank that connects earlier is refused and
            # retries after gRPC's back-off (about a second, seen in 1 of 2 restarts), which
            # would be most of a restart.
            wait_listening(coordinator, self.timeout)
        INITIALIZE_ARGS.update(
            coordinator_address=coordinator,
            num_processes=self.num_processes,
            process_id=self.rank,
            # Listen on the coordinator's own address only, never on all interfaces.
            coordinator_bind_address=coordinator,
            initialization_timeout=self.timeout,
        )
        jax.distributed.initialize(**INITIALIZE_ARGS)
        return {
            "local_devices": jax.local_device_count(),
            "global_devices": jax.device_count(),
            "platform": jax.devices()[0].platform,
        }


def _backend_started() -> bool:
    """Whether jax has made a backend or torch has set up CUDA in this process."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return True
    cuda = sys.modules.get("torch.cuda")
    return cuda is not None and cuda.is_initialized()


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


def forked() -> None:
    """In a rank forked by the rank server (server.py), whose environment was set after this
    module was imported: read it again (rank, backend, coordinators), and start the clock."""
    global _join
    _join = _Join()
    INITIALIZE_ARGS.clear()
    TIMELINE.clear()
    TIMELINE["process_start"] = time.time()
    TIMELINE["forked"] = 1.0


def _exit_now(signum: int, frame: Any) -> None:
    # XLA installs its own SIGTERM handler (a preemption notice) that ignores the signal, so
    # a polite stop would wait for the kill timeout. A rank has nothing to save; what its
    # cells started (subprocesses, DataLoader workers) would outlive it, reparented to init.
    exit_now(signum)


def propose_coordinators(toward: str) -> dict[str, str]:
    """Rank 0: for each backend it starts, an address on the interface that reaches
    ``toward`` (the notebook's machine), which the other hosts reach too; ports free now."""
    return coordinator_addresses(address_toward(toward), _join.backends)


# What joined() returned, for a second request (the notebook sends one again to a rank whose
# answer is late: its first may have been lost on the way).
_JOINED: dict[str, Any] = {}


def joined(coordinators: dict[str, str] | None = None) -> dict:
    """Wait until this rank has joined the distributed job; return this process's facts.

    ``coordinators``: rank 0's addresses by backend, where they were not known at launch
    (remote ranks)."""
    if _JOINED:
        return _JOINED
    if coordinators:
        _join.give_coordinators(coordinators)
    # (a join that hangs says where, a little before the start gives up on this rank)
    _join.wait(max(1.0, float(os.environ.get(INIT_TIMEOUT_ENV) or 120) - 3))
    if _join.error is not None:
        raise _join.error
    internals.check("rank")  # (what the rank's kernel replaces is there, or one sentence)
    if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
        del sys.modules["debugpy"]  # hidden by main() during start-up only
    # Signal handlers can only be set from the main thread, which is where this runs.
    signal.signal(signal.SIGTERM, _exit_now)
    from IPython import get_ipython

    from spmd.engine.rank_kernel import RankKernel, RankShell

    kernel = get_ipython().kernel
    if not isinstance(kernel, RankKernel) or not isinstance(kernel.shell, RankShell):
        raise internals.InternalsChanged(
            f"ipyparallel {version('ipyparallel')} made its engine's kernel "
            f"({type(kernel).__name__}) without ipyparallel.engine.app.Kernel, which "
            "jupyter-spmd sets to its rank's kernel: install a version that does (see "
            "pyproject.toml).")
    # faulthandler names threads by this id; the notebook picks the main thread's stack.
    main_thread = threading.main_thread().ident
    kernel.rank_joined(_join.backends, main_thread)
    _JOINED.update(_join.facts, main_thread=main_thread, timeline=dict(TIMELINE))
    return _JOINED


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
    # The engine asks the controller for id = rank, so that sorted ids and ranks agree, as
    # they do for MPI ranks; mpiexec and srun only tell the rank through the environment.
    if not any(arg.startswith("--IPEngine.id=") for arg in sys.argv):
        offset = int(os.environ.get(ENGINE_ID_OFFSET_ENV) or 0)
        sys.argv.append(f"--IPEngine.id={offset + _join.rank}")
    # A rank that fails before joined() must end at once at stop too (set again in joined,
    # after jax, whose import may install its own handler).
    signal.signal(signal.SIGTERM, _exit_now)
    _join.start()
    listen_for_where()
    linger = watch_parent()
    if linger is not None:
        linger.on_gone.append(unattended.notebook_gone)
        linger.on_back.append(unattended.notebook_back)
    # (imported here, after the join's thread started: its import of jax and ipyparallel's
    # import overlap)
    from ipyparallel.engine import app as engine_app

    from spmd.engine.rank_kernel import RankKernel, RankSession

    # ipyparallel's engine makes its kernel and its session from these names: the rank's
    # own, from the first message on. (Where a release renamed them, they are left alone and
    # joined() says so: spmd/internals.py lists them.)
    if hasattr(engine_app, "Kernel") and hasattr(engine_app, "Session"):
        engine_app.Kernel, engine_app.Session = RankKernel, RankSession
    engine_app.main()
