"""On a rank: JupyterLab's debugger, run as ipykernel's own kernel runs it.

An ipyparallel engine is an IPythonKernel: it has kernelbase's ``debug_request`` handler on
its control channel and ipykernel's ``Debugger``, which answers ``dumpCell``, ``debugInfo``
and ``inspectVariables`` itself and relays the rest to debugpy. What its app leaves out is the
debugpy side: no DAP socket, no stopped-event poller, and start-up hides debugpy
(bootstrap.main), so the kernel made no Debugger at all. ``listen`` adds them, once:

- debugpy listens in this process (with its adapter, a child process), started on the main
  thread, where ipykernel starts it too (with a silent cell sent to its own shell: an engine's
  shell socket faces the controller, so the notebook runs ``listen`` on every rank instead);
- the DAP socket (a zmq STREAM socket, as ipykernel's) lives on the control thread, where
  ``debug_request`` runs, so a rank paused at a breakpoint still answers;
- cells are compiled under the notebook's cell folder (JupyterLab's ``tmpFilePrefix``), not
  under ``ipykernel_<this pid>``: the path JupyterLab computes for a cell then names that cell
  on every rank, and a breakpoint set in the notebook is a breakpoint on each rank.
- debugpy runs its adapter in this process (``in_process_debug_adapter``): no adapter process
  per rank to start (a second Python, about 1 s on a busy host) or to leave behind;
- when JupyterLab turns the debugger off (``disconnect``) the rank lets go of everything it
  took (``close``): the listening socket closes, tracing stops, and the cells' files it
  wrote into the cell folder are removed, with the folder once empty; turning the debugger on
  again listens anew (``listen``). A rank that ends removes its cells' files too
  (``remove_cells``, at its exit).

The Debugger is the rank kernel's: ipykernel's own attributes (``debug_with``), and ours, one
``Debugging`` (``RankKernel.debugging``), which says whether it is there and attached.
``listen`` is what the notebook calls on every rank (pickled by reference); it finds the
kernel as a cell does.

Threads: ``listen`` runs on the main thread, and sets ``Debugging.debugger`` there; the
Debugger, its socket and its queues are the control thread's from then on. ``close`` runs on
the control thread, after the Debugger's own ``disconnect``, and ``listen`` on the main thread
only between cells once the notebook has its reply: they never run at once. ``listening`` is
theirs; ``untrace`` (the main thread's tracing, ended at its next cell) is set by ``close``
and read on the main thread; ``trace`` is the main thread's alone. ``attached`` is read by ``breakpoint()`` on the thread that calls
it (the main thread, where cells run).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import importlib
import os
import socket
import stat
import sys
import threading


def own_folder(folder: str) -> str:
    """``folder``, made private if it is not there; refused where it is another user's (or a
    link): its name is public (``/tmp/ipykernel_<pid>``), so another user of this host could
    make it first, and read or change the cells the debugger shows."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    found = os.lstat(folder)
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode) \
            or found.st_uid != os.getuid():
        raise PermissionError(
            f"{folder}, where the ranks keep the cells the debugger shows, is a link or "
            f"another user's (uid {found.st_uid}): remove it, or restart the kernel, whose "
            "folder is named after its pid")
    return folder


def listen(cells_folder: str) -> dict:
    """Start debugpy in this rank and give its kernel a Debugger (once; later calls only say
    so). ``cells_folder``: the notebook's ``tmpFilePrefix`` without its last separator."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    return kernel.debugging.listen(kernel, cells_folder)


class Debugging:
    """JupyterLab's debugger on this rank: ipykernel's Debugger, once ``listen`` made it."""

    def __init__(self) -> None:
        self.debugger = None  # ipykernel's Debugger, once listen ran
        self.listening = False  # debugpy listens here (between listen and close)
        self.untrace = False  # the main thread's tracing is to end before its next cell
        self.trace = None  # debugpy's trace function of the main thread, on in cells only
        self.folder = ""  # the notebook's cell folder, once listen ran

    def attached(self) -> bool:
        """JupyterLab's debugger is attached to this rank (``breakpoint()`` then stops in
        it)."""
        debugger = self.debugger
        return debugger is not None and bool(debugger.is_started)

    @staticmethod
    def stop_here(frame) -> None:
        """``breakpoint()`` while JupyterLab's debugger is attached: stop in it, in ``frame``
        (the cell's), as debugpy.breakpoint() does in its caller's."""
        from debugpy.server import api

        api._settrace(suspend=True, trace_only_current_thread=True,
                      patch_multiprocessing=False, stop_at_frame=frame)

    def listen(self, kernel, cells_folder: str) -> dict:
        """(main thread) Start debugpy here and give ``kernel`` (the rank's) a Debugger,
        once."""
        if self.listening:
            return {"pid": os.getpid(), "new": False}
        if self.debugger is not None:  # (turned off since: listen anew)
            self._listen()
            return {"pid": os.getpid(), "new": True}
        from spmd import internals

        # (torch, jax: not imported)
        problems = internals.missing("rank", used_in="debugging.py")
        if problems:
            raise RuntimeError(" ".join(problems))
        import ipykernel.compiler
        import ipykernel.debugger

        if not ipykernel.debugger._is_debugpy_available:
            # (imported while start-up hid debugpy: its names were never bound)
            ipykernel.debugger = importlib.reload(ipykernel.debugger)
            ipkernel = sys.modules.get("ipykernel.ipkernel")
            if ipkernel is not None and hasattr(ipkernel, "_is_debugpy_available"):
                ipkernel._is_debugpy_available = True  # (ipykernel 6 bound it at import too)
        folder = own_folder(cells_folder.rstrip(os.sep))

        def cells_here() -> str:
            return folder

        # (ipykernel.debugger imported these by name; the compiler looks its own up at each
        # cell)
        ipykernel.compiler.get_tmp_directory = cells_here
        ipykernel.debugger.get_tmp_directory = cells_here

        loop = kernel.control_thread.io_loop
        debugger, stream = _on_control_thread(
            loop, lambda: _make_debugger(kernel, ipykernel.debugger))
        kernel.debug_with(debugger, stream)  # (engine/rank_kernel.py)
        asyncio.run_coroutine_threadsafe(kernel.poll_stopped_queue(), loop.asyncio_loop)
        self.debugger, self.folder = debugger, folder
        import atexit

        from spmd.engine.life import orphans

        atexit.register(self.remove_cells)
        orphans.at_exit_now(self.remove_cells)  # (a stop ends a rank with os._exit)
        self._listen()
        return {"pid": os.getpid(), "new": True}

    def _listen(self) -> None:
        """(main thread) debugpy listens here, with its adapter in this process."""
        import debugpy

        self.untrace, self.trace = False, None  # (debugpy.listen traces this thread anew)
        own_folder(self.folder)  # (removed when the debugger was turned off)
        # debugpy picks its own free port: one found free here first (ipykernel binds and
        # unbinds a socket) could be taken by another rank before debugpy bound it (seen at
        # a restart: "Address already in use")
        client = self.debugger.debugpy_client
        client.debugpy_host, client.debugpy_port = debugpy.listen(
            (client.debugpy_host, 0), in_process_debug_adapter=True)
        _no_delay()
        self.debugger.debugpy_initialized = True  # (Debugger.start then only connects)
        self.listening = True

    def close(self) -> None:
        """(control thread, after the Debugger's own disconnect) Let go of what the debugger
        took: debugpy's listening socket, its tracing, and the cells' files."""
        if not self.listening:
            return
        self.listening = False
        _stop_debugpy()
        self.untrace = True
        self.remove_cells()

    def untrace_main_thread(self) -> None:
        """(main thread, as a request begins) The main thread is traced only while it runs a
        cell's own code (``traced``): debugpy (settrace mode) meets every code object again
        after its breakpoints change, and the rank's path to a cell and back (ipyparallel,
        ipykernel, IPython, this package) is long, so tracing it cost a cell a few hundred
        milliseconds and a paused rank's way back after Continue as much. Once the debugger
        is off, tracing ends for good: the control thread, which closed it, can end only its
        own."""
        if self.untrace:
            self.untrace, self.trace = False, None
            sys.settrace(None)
            return
        found = sys.gettrace()
        if found is not None and self.listening and "pydev" in str(
                getattr(found, "__module__", None) or type(found).__module__):
            self.trace = found
            _set_trace(None)

    @contextlib.contextmanager
    def traced(self):
        """(main thread) Around a cell's code: debugpy's tracing on, while the debugger
        listens; what tracing the cell left (``breakpoint()`` starts it anew) is kept for the
        next cell's code, and the thread is untraced again."""
        trace = self.trace if self.listening and not self.untrace else None
        if trace is None:
            yield
            return
        before = sys.gettrace()  # (a cell inside a cell, %run: the outer one's, kept)
        _set_trace(trace)
        try:
            yield
        finally:
            self.trace = sys.gettrace() or trace
            _set_trace(before)

    def remove_cells(self) -> None:
        """The cells' files in the notebook's cell folder (dumpCell's: every rank of this host
        wrote the same ones), and the folder once empty. The folder is this notebook's alone
        (named after its kernel's pid, made private by ``own_folder``)."""
        if not self.folder:
            return
        for path in glob.glob(os.path.join(glob.escape(self.folder), "*.py")):
            with contextlib.suppress(OSError):  # (another rank of this host removed it)
                os.remove(path)
        with contextlib.suppress(OSError):  # (not empty: files this rank did not write)
            os.rmdir(self.folder)


def _no_delay() -> None:
    """Each of pydevd's messages leaves at once: its listening socket gets TCP_NODELAY, which
    the connection it accepts (ipykernel's, at attach) takes from it on Linux. pydevd writes a
    message's header and its body apart, and without it the body waited for the ACK of the
    header, which the other side delays: some 40 ms per request and per event (measured: a
    ``threads`` request to a rank took 46 ms, a request ipykernel answers itself 2 ms)."""
    import pydevd

    py_db = pydevd.get_global_debugger()
    waiting = py_db._waiting_for_connection_thread if py_db is not None else None
    server = getattr(waiting, "_server_socket", None)
    if server is not None:
        with contextlib.suppress(OSError):
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _set_trace(trace) -> None:
    """``sys.settrace`` as it was before pydevd replaced it with one that warns, in the cell's
    output, that the debugger is in use. (Not pydevd's own SetTrace, which reaches the thread
    from C: that took longer, at every cell, than the tracing it saves.)"""
    import pydevd_tracing

    (pydevd_tracing.TracingFunctionHolder._original_tracing or sys.settrace)(trace)


def _stop_debugpy() -> None:
    """End debugpy's session in this process: its tracing, and its listening socket, which
    pydevd's ``stoptrace`` leaves open (its thread waits in accept(): a shutdown wakes it, and
    told to end first it ends, where it would otherwise listen again at once, for ever, on a
    closed socket); ``debugpy.listen`` may then be called again."""
    import pydevd
    from debugpy.server import api

    py_db = pydevd.get_global_debugger()
    waiting = py_db._waiting_for_connection_thread if py_db is not None else None
    server = (waiting._server_socket
              if isinstance(waiting, pydevd.PyDB._WaitForConnectionThread) else None)
    if waiting is not None:
        waiting._kill_received = True
    pydevd.stoptrace()
    if server is not None:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)
    if waiting is not None:
        waiting.do_kill_pydev_thread()  # (closes the socket)
    api.listen.called = False


def _make_debugger(kernel, module):
    """The Debugger and its DAP socket's stream, made on the control thread, whose loop serves
    them."""
    import zmq
    from zmq.eventloop.zmqstream import ZMQStream

    socket = zmq.Context.instance().socket(zmq.STREAM)
    socket.linger = 1000
    stream = ZMQStream(socket, kernel.control_thread.io_loop)
    stream.on_recv(kernel.dispatch_debugpy, copy=False)
    debugger = module.Debugger(
        kernel.log,
        stream,
        kernel._publish_debug_event,
        None,  # (the shell socket of ipykernel's silent start cell: listen() did that)
        kernel.session,
        kernel._kernel_modules,
        kernel.debug_just_my_code,
        kernel.filter_internal_frames,
    )
    return debugger, stream


def _on_control_thread(loop, fn):
    done = threading.Event()
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # (raised again on the caller's thread)
            box.append((False, exc))
        finally:
            done.set()

    loop.add_callback(run)
    if not done.wait(30):
        raise RuntimeError("this rank's control thread did not answer within 30 s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
