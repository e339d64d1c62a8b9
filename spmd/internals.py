"""Every private part of another project that jupyter-spmd calls, replaces or subclasses, in
one place, each with what it is used for.

These are the places a new release of ipyparallel, ipykernel or jax can break without a word.
Each side checks its own when it starts: the notebook before a cluster starts (``check
("notebook")``), every rank when its engine starts (``check("rank")``). One that is missing
fails loudly, in one sentence that names it and the version installed, instead of failing
later as an AttributeError in the middle of a cell. pyproject.toml bounds each project below
the next major version that has not been tried.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import types
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    project: str  # the distribution whose version is named when it is missing
    module: str
    path: str  # attribute path inside the module ("Client._send")
    side: str  # "notebook" or "rank": which process uses it
    why: str
    # False: not looked for by ``check`` (its project may not be imported on that side): the
    # module that uses it looks, and its feature steps aside and says so (jit_cache.py), or
    # the start fails in the same sentence (device_put.py, where jax is a backend).
    required: bool = True
    # The project's minor versions the part is used in, first and last ("0.6-0.10"; "": every
    # one): a workaround of a fault those versions have. Outside them it is neither looked for
    # nor used, and the text of ``why`` says them too.
    versions: str = ""
    # For such a workaround: the lines that show the fault in a plain program of the project
    # alone, shown once on docs/reference/internals.md, so a user can see it is not ours.
    fault: str = ""


# jax's device_put checks that a numpy value put on a sharding over every process is the same
# on each, comparing the float64 value with a copy gathered as float32 (x64 off): the minors
# with that fault, and the program that shows it (engine/arrays/device_put.py works around it).
_PUT_CHECK = "0.6-0.10"
_PUT_CHECK_FAULT = """\
jax's device_put of a float64 numpy value, the same on every process, onto a sharding over
every process's devices fails on every process with x64 off, while one process puts it: the
check gathers the value as float32 and compares it with the float64 input, so "Expected" and
"got" differ in their last digits. Saved as `repro.py` and run as two processes of
`jax.distributed` (4 CPU devices each), without jupyter-spmd:

```python
import sys, jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize("127.0.0.1:23457", num_processes=2, process_id=int(sys.argv[1]))

x = np.random.default_rng(0).normal(size=(8,))
jax.device_put(x, NamedSharding(jax.make_mesh((8,), ('x',)), P('x')))
```

`python repro.py 0 & python repro.py 1` raises on both: `AssertionError: <class
'numpy.ndarray'> passed to device_put is not the same on each process`. On the ranks the
check compares what device_put puts on the devices (each numpy or Python value in jax's dtype
for it), so such a cell does what one process does, and a value that differs still raises
jax's error. In the versions with the fault, a jax without the parts above fails the start of
a cluster whose ranks use jax, in one sentence."""

INTERNALS = [
    # ipyparallel, in the notebook
    Internal("ipyparallel", "ipyparallel", "Client._dispatch_iopub.__wrapped__", "notebook",
             "outputs that come after their cell ended (client.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._engines", "notebook",
             "an engine's identity, to reach one engine: a cell, a control request "
             "(channel/client.py)"),
    *[Internal("ipyparallel", "ipyparallel", f"Client.{name}", "notebook",
               "the socket to the controller's cell fan-out (channel/client.py)")
      for name in ("_setup_streams", "_context", "_config", "_closed", "curve_serverkey",
                   "curve_publickey", "curve_secretkey", "_unregister_engine")],
    *[Internal("ipyparallel", "ipyparallel.controller.app", f"IPController.{name}", "notebook",
               "the controller's cell fan-out (controller/fanout.py)")
      for name in ("init_hub", "client_json_file", "connect",
                   "client_url", "curve_secretkey", "client_transport",
                   "client_ip", "context", "loop", "session")],
    *[Internal("ipyparallel", "ipyparallel.controller.hub", f"Hub.{name}", "notebook",
               "the hub reads its monitor's waiting messages in one go (controller/hub.py)")
      for name in ("monitor", "dispatch_monitor_traffic")],
    *[Internal("ipyparallel", "ipyparallel.controller.heartmonitor", f"HeartMonitor.{name}",
               "notebook", "a rank registered at its first heartbeat (controller/hearts.py)")
      for name in ("handle_pong", "start", "responses", "hearts", "handle_new_hearts",
                   "ping_stream", "lifetime", "loop")],
    Internal("ipyparallel", "ipyparallel.controller.app", "start_heartmonitor", "notebook",
             "the heart monitor's process starts with hearts.py installed (controller/hearts.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._futures", "notebook",
             "whether an output's request (%px, apply) is still running (client.py)"),
    *[Internal("ipyparallel", "ipyparallel", f"Client.{name}", "notebook",
               "control-channel requests to ranks (channel/client.py)")
      for name in ("_send", "_control_stream")],
    *[Internal("ipyparallel", "ipyparallel", f"Client.{name}", "notebook",
               "the controller's list of engines, for one whose announcement was missed "
               "(channel/client.py)") for name in ("_query_stream", "_update_engines")],
    Internal("ipyparallel", "ipyparallel", "Client._io_loop", "notebook",
             "the IO thread that owns the client's engine tables (channel/client.py, "
             "channel/client.py)"),
    *[Internal("ipyparallel", "ipyparallel.controller.hub", f"Hub.{name}", "notebook",
               "the controller keeps of each request only its id (controller/hub.py)")
      for name in ("save_queue_request", "save_queue_result", "monitor_iopub_message",
                   "by_ident", "pending", "queues", "completed", "all_completed")],
    Internal("ipyparallel", "ipyparallel", "Client._extract_metadata", "notebook",
             "a reply's engine, for its request's late outputs (client.py)"),
    Internal("ipyparallel", "ipyparallel.client.client", "unpack_message", "notebook",
             "the decorator of Client._dispatch_iopub (client.py)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._in_thread", "notebook",
             "the cluster's calls on its own event-loop thread (the start, a restart, the "
             "stop: cluster/)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._thread_loop", "notebook",
             "the event loop that starts and stops the cluster, closed by the stop "
             "(cluster/stopping.py)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._async_thread", "notebook",
             "the thread of the cluster's event loop, whose loop the stop closes "
             "(cluster/stopping.py)"),
    *[Internal("ipyparallel", "ipyparallel.cluster.launcher", f"LocalEngineLauncher.{name}",
               "notebook", "a rank's exit code, seen in the middle of a cell (launch.py, "
               "forks.py)") for name in ("_wait", "_stop_waiting", "_popen_process")],
    *[Internal("ipyparallel", "ipyparallel.cluster.launcher", f"{launcher}._notice_engine_stopped",
               "notebook", "a rank's launcher kept once it stopped, for the death report "
               "(launch.py, ssh.py)")
      for launcher in ("LocalEngineSetLauncher", "SSHEngineSetLauncher")],
    Internal("ipyparallel", "ipyparallel.cluster.launcher",
             "LocalProcessLauncher._start_waiting", "notebook",
             "the wait for a rank forked by the rank server (forks.py)"),
    *[Internal("ipyparallel", "ipyparallel.cluster.launcher", f"SSHEngineLauncher.{name}",
               "notebook", "a rank's exit code over ssh (ssh.py, forks.py)")
      for name in ("_wait", "_start_waiting", "_stop_waiting")],
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "SSHEngineLauncher._output",
             "notebook", "what a rank over ssh wrote, fetched only for a death report "
             "(ssh.py, forks.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "SSHEngineLauncher._ssh_sender",
             "notebook", "every ssh command of a rank through its host's master connection "
             "(ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "_ssh_outputs", "notebook",
             "reading what a host's wait printed (ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.shellcmd", "ShellCommandSend._check_output",
             "notebook", "a host's error in the start's sentence (ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher",
             "SlurmEngineSetLauncher._insert_options_in_script", "notebook",
             "any sbatch option in the batch script (remote.py)"),
    Internal("ipyparallel", "ipyparallel.controller.app", "IPController.save_connection_dict",
             "notebook", "connection files written whole, and refused unencrypted "
             "(controller/start.py, with the fan-out's port: controller/fanout.py)"),
    Internal("ipyparallel", "ipyparallel.controller.app", "IPController.enable_curve",
             "notebook", "CurveZMQ where ranks are on other machines (controller/start.py, "
             "and the fan-out's socket, controller/fanout.py)"),
    Internal("ipyparallel", "ipyparallel.controller.app",
             "IPController.get_default_logging_config", "notebook",
             "the hub's logger at the level it writes (controller/hub.py)"),
    # ipyparallel, ipykernel and IPython, on every rank
    *[Internal("ipyparallel", "ipyparallel.engine.app", name, "rank",
               "the engine's kernel and session are the rank's own, set by name before the "
               "engine starts (engine/bootstrap.py, engine/rank_kernel.py)")
      for name in ("Kernel", "Session")],
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.control_msg_types", "rank",
             "stacks, signals, census records and prompt answers on the control channel, "
             "each answered by the kernel's method of its type's name (engine/rank_kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.raw_input", "rank",
             "input() answered in the notebook (engine/rank_kernel.py, engine/shell/prompts.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.getpass", "rank",
             "getpass answered in the notebook (engine/rank_kernel.py, engine/shell/prompts.py)"),
    Internal("ipython", "IPython.core.interactiveshell", "InteractiveShell.system", "rank",
             "!cmd without a fork in a threaded process (engine/rank_kernel.py, "
             "engine/shell/commands.py)"),
    Internal("ipyparallel", "ipyparallel.engine.kernel", "IPythonParallelKernel.finish_metadata",
             "rank", "a cell's census digest, JAX_* changes and output count in its reply's "
             "metadata (engine/rank_kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_status", "rank",
             "no status: busy from a rank, which no one reads (engine/rank_kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_execute_input", "rank",
             "no execute_input from a rank, which no one reads (engine/rank_kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.execute_request", "rank",
             "a counted cell's outputs, counted into its reply (engine/rank_kernel.py)"),
    *[Internal("ipykernel", "ipykernel.iostream", f"OutStream.{name}", "rank",
               "an empty stream's flush skips its IOPub thread round trip (engine/shell/streams.py)")
      for name in ("_flush", "_subprocess_flush_pending")],
    # ipykernel and debugpy, on a rank that JupyterLab's debugger debugs (checked when it
    # starts there: start-up hides debugpy)
    *[Internal(project, module, path, "rank", "JupyterLab's debugger on the ranks "
               "(engine/shell/debugging.py)", required=False) for project, module, path in (
        ("ipykernel", "ipykernel.debugger", "Debugger"),
        ("ipykernel", "ipykernel.debugger", "_is_debugpy_available"),
        ("ipykernel", "ipykernel.debugger", "Debugger.debugpy_client"),
        ("ipykernel", "ipykernel.debugger", "Debugger.debugpy_initialized"),
        ("ipykernel", "ipykernel.debugger", "DebugpyClient.debugpy_host"),
        ("ipykernel", "ipykernel.debugger", "DebugpyClient.debugpy_port"),
        ("ipykernel", "ipykernel.compiler", "get_tmp_directory"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.dispatch_debugpy"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.poll_stopped_queue"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel._kernel_modules"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.debugpy_stream"),
        ("ipykernel", "ipykernel.kernelbase", "Kernel._publish_debug_event"),
        ("ipykernel", "ipykernel.kernelbase", "Kernel.control_thread"),
        ("debugpy", "debugpy.server.api", "_settrace"),
        # (turning the debugger off closes debugpy's listening socket; on again listens anew)
        ("debugpy", "debugpy.server.api", "listen.called"),
        ("debugpy", "pydevd", "get_global_debugger"),
        ("debugpy", "pydevd", "stoptrace"),
        ("debugpy", "pydevd", "PyDB._waiting_for_connection_thread"),
        ("debugpy", "pydevd", "PyDB._WaitForConnectionThread._server_socket"),
        ("debugpy", "pydevd", "PyDB._WaitForConnectionThread._kill_received"),
        ("debugpy", "pydevd", "PyDB._WaitForConnectionThread.do_kill_pydev_thread"),
        # (the main thread traced in a cell's code only, untraced between cells)
        ("debugpy", "pydevd_tracing", "TracingFunctionHolder._original_tracing"),
    )],
    # ipykernel, in the SPMD kernel
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_debug_event", "notebook",
             "the ranks' debug events, shown to JupyterLab (kernel/shown.py)"),
    # jax, in the notebook (read where jax is imported already: never imported to look)
    Internal("jax", "jax._src.xla_bridge", "_backends", "notebook",
             "a warning that the notebook itself started jax's backends (magics/commands/lifecycle.py)",
             required=False),
    # jax, on every rank
    Internal("jax", "jax._src.array", "ArrayImpl", "rank",
             "which jitted calls span processes, for the census (engine/watch/launches.py)",
             required=False),
    *[Internal("jax", "jax._src.array", f"ArrayImpl.{name}", "rank",
               "print(x) of an array over several processes, shown as one process prints it "
               "(engine/arrays/print_marks.py)", required=False)
      for name in ("__repr__", "__str__", "__format__")],
    Internal("jax", "jax._src.compiler", "_cache_write", "rank",
             "every rank writes its own compilation-cache entries (engine/join/jit_cache.py)",
             required=False),
    Internal("jax", "jax._src.xla_bridge", "_backends", "rank",
             "whether jax made its backend before the rank's GPUs were chosen, in the start's "
             "timeline (engine/bootstrap.py)", required=False),
    Internal("jax", "jax._src.pjit", "_fun", "rank",
             "where a jitted function was defined, for the census (engine/watch/launches.py)",
             required=False),
    *[Internal("jax", module, path, "rank",
               "device_put of a float64 numpy value the same on every process, which jax's "
               f"check calls different with x64 off (jax {_PUT_CHECK}, the versions with that "
               "fault; engine/arrays/device_put.py)",
               required=False, versions=_PUT_CHECK, fault=_PUT_CHECK_FAULT)
      for module, path in (("jax._src.dispatch", "_device_put_sharding_impl"),
                           ("jax.experimental.multihost_utils", "assert_equal"))],
    # torch, on a rank that shows a DTensor's shards
    Internal("torch", "torch.distributed.tensor._utils",
             "_compute_local_shape_and_global_offset", "rank",
             "which block of a DTensor each rank holds (engine/arrays/torch_shards.py)",
             required=False),
]


class InternalsChanged(RuntimeError):
    """A project's private part that jupyter-spmd uses is not there; the text says which."""


def _version(project: str) -> str:
    try:
        return importlib.metadata.version(project)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing(side: str, required_only: bool = False, used_in: str = "") -> list[str]:
    """One sentence for each internal of ``side`` that is not where it should be (only those
    whose ``why`` names ``used_in``, where given: the others' modules are not imported)."""
    found = []
    for item in INTERNALS:
        if item.side != side or (required_only and not item.required) \
                or used_in not in item.why or not applies(item):
            continue
        try:
            value = importlib.import_module(item.module)
            for part in item.path.split("."):
                value = _attr(value, part) if isinstance(value, (type, types.ModuleType)) \
                    else getattr(value, part)
        except (ImportError, AttributeError):
            found.append(
                f"{item.project} {_version(item.project)} has no {item.module}.{item.path}, "
                f"which jupyter-spmd needs for {item.why}: install a version that does "
                "(see pyproject.toml)."
            )
    return found


def applies(item: Internal) -> bool:
    """Whether the installed version of ``item``'s project is one it is used in (its
    ``versions``; a version that cannot be read: not one)."""
    if not item.versions:
        return True
    first, last = (_minor(end) for end in item.versions.split("-"))
    installed = _minor(_version(item.project))
    return installed is not None and first <= installed <= last


def _minor(version: str) -> tuple[int, int] | None:
    """(0, 10) for "0.10.2" (None where it does not start with two numbers)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def _attr(owner: type | types.ModuleType, name: str):
    """An attribute of a module or a class; for a class also a traitlet of that name, or an
    attribute its instances set on themselves (``self._mux_stream = ...`` in the class's
    code); for a module also one its code sets on the objects it makes (jax's pjit.py:
    ``cpp_pjitted_f._fun = fun``, on a function object of C++)."""
    if name in getattr(owner, "class_traits", lambda: {})():
        return owner.class_traits()[name]
    if hasattr(owner, name):
        return getattr(owner, name)
    who = r"self" if isinstance(owner, type) else r"\w+"
    assigned = re.compile(rf"\b{who}\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)")
    for klass in owner.__mro__ if isinstance(owner, type) else [owner]:
        try:
            source = inspect.getsource(klass)
        except TypeError:  # a built-in class (object): nothing it sets
            continue
        except OSError:  # no source to read (a frozen or packed install):
            return name  # not known to be missing
        if assigned.search(source):
            return name
    raise AttributeError(name)


@functools.cache
def check(side: str) -> None:
    """Raise InternalsChanged (its text: every missing one) if ``side``'s internals moved."""
    problems = missing(side, required_only=True)
    if problems:
        raise InternalsChanged(" ".join(problems))
