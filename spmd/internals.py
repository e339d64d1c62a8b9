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
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    project: str  # the distribution whose version is named when it is missing
    module: str
    path: str  # attribute path inside the module ("Client._send")
    side: str  # "notebook" or "rank": which process uses it
    why: str
    # False: without it a feature steps aside and says so where it is used (jit_cache.py),
    # and the start goes on.
    required: bool = True


INTERNALS = [
    # ipyparallel, in the notebook
    Internal("ipyparallel", "ipyparallel", "Client._dispatch_iopub.__wrapped__", "notebook",
             "outputs that come after their cell ended (client.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._engines", "notebook",
             "an engine's identity, to send a cell to a rank (lockstep/run.py)"),
    *[Internal("ipyparallel", "ipyparallel", f"Client.{name}", "notebook",
               "the socket to the controller's cell fan-out (channel/cell_routes.py)")
      for name in ("_setup_streams", "_context", "_config", "_closed", "curve_serverkey",
                   "curve_publickey", "curve_secretkey", "_unregister_engine")],
    *[Internal("ipyparallel", "ipyparallel.controller.app", f"IPController.{name}", "notebook",
               "the controller's cell fan-out (controller/fanout.py)")
      for name in ("init_hub", "save_connection_dict", "client_json_file", "connect",
                   "client_url", "enable_curve", "curve_secretkey", "client_transport",
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
    Internal("ipyparallel", "ipyparallel", "Client._build_targets", "notebook",
             "control-channel requests to ranks (control.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._send", "notebook",
             "control-channel requests to ranks (control.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._control_stream", "notebook",
             "control-channel requests to ranks (control.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._query_socket", "notebook",
             "the controller's list of engines, for one whose announcement was missed "
             "(client.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._update_engines", "notebook",
             "the controller's list of engines, for one whose announcement was missed "
             "(client.py)"),
    Internal("ipyparallel", "ipyparallel", "Client._io_loop", "notebook",
             "the IO thread that owns the client's engine tables (client.py)"),
    *[Internal("ipyparallel", "ipyparallel.controller.hub", f"Hub.{name}", "notebook",
               "the controller keeps of each request only its id (controller/hub.py)")
      for name in ("save_queue_request", "save_queue_result", "monitor_iopub_message",
                   "by_ident", "pending", "queues", "completed", "all_completed")],
    Internal("ipyparallel", "ipyparallel", "Client._extract_metadata", "notebook",
             "a reply's engine, for its request's late outputs (client.py)"),
    Internal("ipyparallel", "ipyparallel.client.client", "unpack_message", "notebook",
             "the decorator of Client._dispatch_iopub (client.py)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._in_thread", "notebook",
             "the cluster's calls on its own event-loop thread (startup.py, session.py)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._thread_loop", "notebook",
             "the event loop that starts and stops the cluster (launch.py, session.py)"),
    Internal("ipyparallel", "ipyparallel", "Cluster._async_thread", "notebook",
             "the thread of the cluster's event loop, whose loop the stop closes (session.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "LocalEngineLauncher._wait",
             "notebook", "a rank's exit code, seen in the middle of a cell (launch.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher",
             "LocalProcessLauncher._start_waiting", "notebook",
             "the wait for a rank forked by the rank server (forks.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "SSHEngineLauncher._wait",
             "notebook", "a rank's exit code over ssh (ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher", "_ssh_outputs", "notebook",
             "reading what a host's wait printed (ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.shellcmd", "ShellCommandSend._check_output",
             "notebook", "a host's error in the start's sentence (ssh.py)"),
    Internal("ipyparallel", "ipyparallel.cluster.launcher",
             "SlurmEngineSetLauncher._insert_options_in_script", "notebook",
             "any sbatch option in the batch script (remote.py)"),
    Internal("ipyparallel", "ipyparallel.controller.app", "IPController.save_connection_dict",
             "notebook", "connection files written whole, and refused unencrypted "
             "(controller.py)"),
    Internal("ipyparallel", "ipyparallel.controller.app", "IPController.enable_curve",
             "notebook", "CurveZMQ where ranks are on other machines (controller.py)"),
    # ipyparallel, ipykernel and IPython, on every rank
    *[Internal("ipyparallel", "ipyparallel.engine.app", name, "rank",
               "the engine's kernel and session are the rank's own, set by name before the "
               "engine starts (engine/bootstrap.py, engine/kernel.py)")
      for name in ("Kernel", "Session")],
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.control_handlers", "rank",
             "stacks, signals, census records and prompt answers on the control channel "
             "(engine/kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.raw_input", "rank",
             "input() answered in the notebook (engine/kernel.py, engine/prompts.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.getpass", "rank",
             "getpass answered in the notebook (engine/kernel.py, engine/prompts.py)"),
    Internal("ipython", "IPython.core.interactiveshell", "InteractiveShell.system", "rank",
             "!cmd without a fork in a threaded process (engine/kernel.py, engine/commands.py)"),
    Internal("ipyparallel", "ipyparallel.engine.kernel", "IPythonParallelKernel.finish_metadata",
             "rank", "a cell's census digest, JAX_* changes and output count in its reply's "
             "metadata (engine/kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_status", "rank",
             "no status: busy from a rank, which no one reads (engine/kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_execute_input", "rank",
             "no execute_input from a rank, which no one reads (engine/kernel.py)"),
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel.execute_request", "rank",
             "a counted cell's outputs, counted into its reply (engine/kernel.py)"),
    *[Internal("ipykernel", "ipykernel.iostream", f"OutStream.{name}", "rank",
               "an empty stream's flush skips its IOPub thread round trip (engine/streams.py)")
      for name in ("_flush", "_subprocess_flush_pending")],
    # ipykernel and debugpy, on a rank that JupyterLab's debugger debugs (checked when it
    # starts there: start-up hides debugpy)
    *[Internal(project, module, path, "rank", "JupyterLab's debugger on the ranks "
               "(engine/debugging.py)", required=False) for project, module, path in (
        ("ipykernel", "ipykernel.debugger", "Debugger"),
        ("ipykernel", "ipykernel.debugger", "_is_debugpy_available"),
        ("ipykernel", "ipykernel.debugger", "DebugpyClient.get_host_port"),
        ("ipykernel", "ipykernel.compiler", "get_tmp_directory"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.dispatch_debugpy"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.poll_stopped_queue"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel._kernel_modules"),
        ("ipykernel", "ipykernel.ipkernel", "IPythonKernel.debugpy_stream"),
        ("ipykernel", "ipykernel.kernelbase", "Kernel._publish_debug_event"),
        ("ipykernel", "ipykernel.kernelbase", "Kernel.control_thread"),
        ("debugpy", "debugpy.server.api", "_settrace"),
    )],
    # ipykernel, in the SPMD kernel
    Internal("ipykernel", "ipykernel.kernelbase", "Kernel._publish_debug_event", "notebook",
             "the ranks' debug events, shown to JupyterLab (kernel/debugger.py)"),
    # jax, on every rank
    Internal("jax", "jax._src.array", "ArrayImpl", "rank",
             "which jitted calls span processes, for the census (engine/census.py)",
             required=False),
    Internal("jax", "jax._src.compiler", "_cache_write", "rank",
             "every rank writes its own compilation-cache entries (engine/jit_cache.py)",
             required=False),
]


class InternalsChanged(RuntimeError):
    """A project's private part that jupyter-spmd uses is not there; the text says which."""


def _version(project: str) -> str:
    try:
        return importlib.metadata.version(project)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def missing(side: str, required_only: bool = False) -> list[str]:
    """One sentence for each internal of ``side`` that is not where it should be."""
    found = []
    for item in INTERNALS:
        if item.side != side or (required_only and not item.required):
            continue
        try:
            value = importlib.import_module(item.module)
            for part in item.path.split("."):
                value = getattr(value, part) if not isinstance(value, type) else _attr(value, part)
        except (ImportError, AttributeError):
            found.append(
                f"{item.project} {_version(item.project)} has no {item.module}.{item.path}, "
                f"which jupyter-spmd needs for {item.why}: install a version that does "
                "(see pyproject.toml)."
            )
    return found


def _attr(cls: type, name: str):
    """A class attribute, a traitlet of that name, or an attribute its instances set on
    themselves (``self._mux_stream = ...`` in the class's code)."""
    if name in getattr(cls, "class_traits", lambda: {})():
        return cls.class_traits()[name]
    if hasattr(cls, name):
        return getattr(cls, name)
    assigned = re.compile(rf"self\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)")
    for klass in cls.__mro__:
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
