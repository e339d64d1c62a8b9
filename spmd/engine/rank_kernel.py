"""The rank's kernel: ipyparallel's engine kernel with what a rank adds to it, in one class.

ipyparallel's engine app makes its kernel and its session from the names ``Kernel`` and
``Session`` of ``ipyparallel.engine.app``; ``bootstrap.main`` names the classes here before
the engine starts (a rank forked by the rank server runs main too), so the kernel is this one
from its first message. ipyparallel extends ipykernel's kernel the same way
(``IPythonParallelKernel``: its message types, declared on the class, its
``finish_metadata``), and so does this one. The modules named below keep the logic, and the
rank's state in one object per concern, which the kernel makes and owns; this class says when
it runs.

What a rank adds:

- its shell (``RankShell``): ``!cmd`` without a fork (commands.py), and a cell's value that
  spans processes, shown once (results.py);
- ``input()`` and ``getpass``, answered in the notebook (``prompts``: prompts.py);
- no ``status: busy`` or ``execute_input``, and a counted cell's outputs counted into its
  reply instead of its idle (``quiet``: quiet.py; ``RankSession``, which every message the
  rank sends goes through, does the counting);
- ``print(x)`` of an array over several processes, marked for the notebook
  (``print_marks``: print_marks.py, given to the rank's streams before each cell);
- JupyterLab's debugger, once the notebook asks (``debugging``: debugging.py);
- its replies' metadata, made in one place (``finish_metadata``);
- once the rank has joined (``rank_joined``, called by bootstrap.joined): its control
  requests (where, signal, census, prompt answers: spmd/wire.py; their types in
  ``control_msg_types``, their handlers below), the census's records (``launches``:
  launches.py), the watch on the JAX_* variables (import_env.py), jax's or torch's setup said
  in a line (started.py), breakpoints asked in the notebook (prompts.py). Until then a rank
  answers none of these control requests (``_once_joined``): the notebook reads no answer as
  a rank it cannot reach that way.

Threads: shell requests, ``finish_metadata`` and ``rank_joined`` run on the main thread;
the control requests on the kernel's control thread (they read copies, or hand the answer
over through a queue: launches.py, prompts.py); ``RankSession.send`` on whichever thread sends
(quiet.py says how the counts are shared). Each concern's module says which thread touches
which of its state.
"""

from __future__ import annotations

import functools

from ipykernel.displayhook import ZMQShellDisplayHook
from ipykernel.zmqshell import ZMQInteractiveShell
from ipyparallel.engine.kernel import IPythonParallelKernel
from jupyter_client.session import Session
from traitlets import Type

from spmd import wire
from spmd.engine.arrays import device_put, print_marks, results
from spmd.engine.join import import_env, started
from spmd.engine.life import unattended
from spmd.engine.shell import commands, debugging, prompts, quiet, streams
from spmd.engine.watch import answers, launches


class RankSession(Session):
    """jupyter_client's session, counting what the rank sends (quiet.py). ipyparallel's engine
    signs and sends everything with it: the replies, and on IOPub the streams, displays and
    results of a cell."""

    counts: quiet.QuietCounts | None = None  # (the rank kernel's, given as it is made)

    def send(self, *args, **kwargs):
        msg = super().send(*args, **kwargs)
        counts = self.counts
        if counts is not None:
            counts.sent(msg)
        return msg


class ResultHook(ZMQShellDisplayHook):
    """The shell's displayhook: a cell's result, whose parts results.py makes while it is
    formatted."""

    def compute_format_data(self, result):
        return results.formatting_result(super().compute_format_data, result)


class RankShell(ZMQInteractiveShell):
    """ipykernel's shell, as a rank's."""

    # (the function itself: no frame of its own between the cell and var_expand's depth)
    system = commands.system
    displayhook_class = Type(ResultHook)

    async def run_code(self, code_obj, result=None, *, async_=False):
        # (JupyterLab's debugger traces the cell's code, not the rank's way to it: debugging.py)
        with self.kernel.debugging.traced():
            return await super().run_code(code_obj, result, async_=async_)


# Libraries tell a notebook from a terminal by the shell's class name: rich's Console (and so
# jax.debug.visualize_array_sharding) draws HTML only under "ZMQInteractiveShell", and ANSI
# text otherwise. The rank's shell keeps ipykernel's name, as the shell it extends.
RankShell.__name__ = RankShell.__qualname__ = ZMQInteractiveShell.__name__


def _once_joined(handler):
    """A control request only a joined rank answers: until ``rank_joined``, none is sent, as
    for a type the kernel has no handler for (and logged as ipykernel logs one)."""

    @functools.wraps(handler)
    def answer(self, stream, ident, parent) -> None:
        if not self._joined:
            self.log.error("UNKNOWN CONTROL MESSAGE TYPE: %r", parent["header"]["msg_type"])
            return
        handler(self, stream, ident, parent)

    return answer


class RankKernel(IPythonParallelKernel):
    """ipyparallel's engine kernel, as a rank's."""

    shell_class = Type(RankShell)
    # The control requests a rank adds (spmd/wire.py): ipykernel finds each one's handler by
    # its name (the method of that name below), and answers them on its control thread.
    spmd_control_msg_types = [wire.WHERE_REQUEST, wire.SIGNAL_REQUEST, wire.CENSUS_REQUEST,
                              wire.PROMPT_ANSWER]
    control_msg_types = IPythonParallelKernel.control_msg_types + spmd_control_msg_types

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        quiet.quiet_log(self.log)
        # The rank's state, one object per concern (each module says which thread touches it)
        self.quiet = quiet.QuietCounts()  # (a counted cell's IOPub messages, its idle left out)
        self.session.counts = self.quiet  # (what the session sends is counted there)
        self.launches = launches.Launches()  # (each cell's cross-process launches: the census)
        self.print_marks = print_marks.PrintMarks()  # (print(x) of a global array, marked)
        self.debugging = debugging.Debugging()  # (JupyterLab's debugger, once asked for)
        self.prompts = prompts.Prompts(self.debugging)  # (input(), getpass, breakpoints)
        self._env: import_env.ImportEnv | None = None  # (the watch, once joined)
        self._main_thread: int | None = None  # (where cells run: its stack is the rank's)
        self._joined = False  # (the control requests above are answered from then on)

    # ipykernel puts these in builtins.input and getpass.getpass for every cell (the prompts'
    # own bound methods: no frame of the kernel's in the prompt's traceback)
    @property
    def raw_input(self):
        return self.prompts.raw_input

    @property
    def getpass(self):
        return self.prompts.getpass

    def rank_joined(self, backends: list[str], main_thread: int) -> None:
        """The rank has joined its job (bootstrap.joined, on the main thread): what needs the
        backends imported, and the requests only a joined rank answers."""
        shell = self.shell
        results.show_global_arrays(shell)  # (a cell's value that spans processes, shown once)
        started.install()  # (a cell that sets up jax or torch again: told what it has)
        self.launches.record_cells(shell, self._request_id)  # (each cell's launches)
        self._env = import_env.watch(shell)  # (a cell that sets JAX_*: kept for the restart)
        if "jax" in backends:
            self.launches.install_jax()
            device_put.install()  # (a float64 value the same on every rank: as one process)
            self.print_marks.install()  # (print(x) of an array over several processes, once)
        if "torch" in backends:
            self.launches.install_torch()
        # faulthandler names threads by this id; the notebook picks the main thread's stack.
        self._main_thread = main_thread
        self._joined = True  # (its control requests: answered from now on)
        self.prompts.route_breakpoints()  # (pdb, answered in the notebook)

    def _request_id(self) -> str:
        """The id of the shell request running now ('' between requests)."""
        return (self.get_parent("shell") or {}).get("header", {}).get("msg_id", "")

    # -- a reply's metadata ----------------------------------------------------------------

    def finish_metadata(self, parent, metadata, reply_content):
        """ipyparallel's (the status, and the engine on an error), then the rank's, in this
        order: the census's digest of a cell (its record ends here), the JAX_* variables
        changed since the last reply, and last the count of the request's IOPub messages, taken
        when nothing more is sent before the reply."""
        metadata = super().finish_metadata(parent, metadata, reply_content)
        self.launches.digest_into(parent, metadata)
        if self._env is not None:
            self._env.into(metadata)
        self.print_marks.table.into(metadata)  # (the arrays the cell printed: their parts)
        self.quiet.count_into(parent, metadata)
        unattended.cell_ended(parent["content"].get("code", ""), reply_content)
        return metadata

    # -- IOPub: what no one reads is not sent (quiet.py) ------------------------------------

    def _publish_status(self, status, channel, parent=None):
        if status == "busy":
            return
        if status == "idle" and self.quiet.idles_to_leave_out() and self.quiet.leave_out_idle(
                parent or self.get_parent(channel)):
            return
        super()._publish_status(status, channel, parent)

    def _publish_execute_input(self, code, parent, execution_count):
        return None

    async def execute_request(self, stream, ident, parent):
        # (jax imported by a cell of a --backend none rank: installed once, cheap after)
        self.print_marks.install()
        self.debugging.untrace_main_thread()  # (traced in the cell's code only: debugging.py)
        streams.mark_with(self.print_marks)  # (the rank's streams, made after the kernel)
        unattended.cell_began()  # (a cell that runs when a notebook attaches: unattended.py)
        request = self.quiet.start_counting(parent)
        try:
            result = super().execute_request(stream, ident, parent)
            if hasattr(result, "__await__"):
                await result
        finally:  # (a request that sent no reply: its idle goes, and nothing is left)
            self.quiet.stop_counting(request)

    # -- control requests, once joined (spmd/wire.py; named by their types) -----------------

    @_once_joined
    def spmd_where_request(self, stream, ident, parent) -> None:
        content = {"status": "ok", "frames": answers.stack_of(self._main_thread)}
        self.session.send(stream, wire.WHERE_REPLY, content, parent, ident)

    @_once_joined
    def spmd_signal_request(self, stream, ident, parent) -> None:
        signum = int(parent["content"]["signum"])
        self.session.send(stream, wire.SIGNAL_REPLY, {"status": "ok"}, parent, ident)
        answers.signal_self(stream, signum)

    @_once_joined
    def spmd_census_request(self, stream, ident, parent) -> None:
        census = self.launches.of(parent["content"].get("request"))
        self.session.send(stream, wire.CENSUS_REPLY, {"status": "ok", "census": census},
                          parent, ident)

    @_once_joined
    def spmd_prompt_answer(self, stream, ident, parent) -> None:
        taken = self.prompts.answer(parent["content"])
        self.session.send(stream, wire.PROMPT_ANSWER_REPLY, {"status": "ok", "taken": taken},
                          parent, ident)

    # -- JupyterLab's debugger (debugging.py) -----------------------------------------------

    def debug_with(self, debugger, stream) -> None:
        """ipykernel's Debugger and its DAP socket's stream, made by debugging.listen (main
        thread): ipykernel's own kernel makes them at its start, which an engine's leaves out."""
        self.debugpy_stream = stream
        self.debugger = debugger

    async def do_debug_request(self, msg):
        reply = await super().do_debug_request(msg)
        if msg.get("command") == "disconnect":  # (JupyterLab turned the debugger off)
            self.debugging.close()
        return reply
