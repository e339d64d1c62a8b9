"""The SPMD kernel: IPython's kernel with every cell running on N ranks.

A small subclass of ipykernel's ``IPythonKernel`` (as ipyparallel's engine is): the extension
does the work, exactly as ``%load_ext spmd`` + ``%spmd start`` would. What the kernel adds:

- it starts the kernelspec's cluster as soon as it is up, in the background;
- Tab completion and Shift-Tab inspection answer from rank 0's namespace, where the cells'
  names live, and from the notebook's own (``%%local`` names) when rank 0 knows nothing, is
  busy, or cannot answer within ``answer_seconds``;
- JupyterLab's debugger debugs the ranks, not this process (debugger.py);
- it offers no subshells: the ranks run one cell at a time, in order;
- shutting the kernel down stops the cluster.

Interrupt needs nothing: Jupyter sends the kernel SIGINT, which ends the cell's wait with the
same report as with the magic.

Threads are ipykernel's: cells (``do_execute``) on the main thread, debug requests and
shutdown on the control thread; what they share is the magics' and the debugger's to guard.
"""

from __future__ import annotations

from ipykernel.ipkernel import IPythonKernel
from IPython.core.error import UsageError
from traitlets import Enum, Float, Integer, Unicode

from spmd import __version__
from spmd.cluster.session import Settings
from spmd.engine.shell import introspect
from spmd.kernel import agents, dap
from spmd.kernel.debugger import RankDebugger
from spmd.kernel.sidebar import COMMANDS as SIDEBAR_COMMANDS
from spmd.kernel.sidebar import RanksSidebar
from spmd.magics.start.arguments import start_settings
from spmd.options import BACKENDS, TORCH_BACKENDS, start_args


class SpmdKernel(IPythonKernel):
    implementation = "spmd"
    implementation_version = __version__
    banner = "Python 3 (SPMD): every cell runs on all ranks; %%local runs one in this process."

    processes = Integer(4, help="Ranks (engine processes) to start.").tag(config=True)
    devices_per_process = Integer(0, help="CPU devices per process (0: jax's default, one).").tag(
        config=True
    )
    backend = Enum(BACKENDS, "jax", help="What every rank initializes.").tag(config=True)
    torch_backend = Enum(TORCH_BACKENDS, "gloo", help="torch.distributed's backend.").tag(
        config=True
    )
    cluster = Unicode(
        "",
        help="Where and how the ranks run: %spmd start's cluster options (--hosts, "
        "--launcher, --launcher-arg, --python, --gpus-per-process, --start-timeout, "
        "--check-collectives, --linger), as one string.",
    ).tag(config=True)
    answer_seconds = Float(
        2.0,
        help="How long completion and inspection wait for rank 0 before the notebook answers "
        "(at once when rank 0 is busy or no cluster runs).",
    ).tag(config=True)

    # The cluster's start that ``spmd.kernel.app`` began before ipykernel was imported.
    early_start = None

    def start(self) -> None:
        super().start()
        from spmd.magics.magics import register

        self.shell.extension_manager.load_extension("spmd")
        self.spmd = register(self.shell)  # the magics the extension registered
        early, type(self).early_start = type(self).early_start, None
        try:
            settings = start_settings(start_args(self.processes, self.devices_per_process,
                                                 self.backend, self.torch_backend,
                                                 self.cluster))[1]
        except UsageError as exc:  # (the first cell says why; %spmd start still works)
            settings, refused = Settings(n=self.processes, backend=self.backend), str(exc)
        else:
            refused = ""
        if early is not None and not early.attaching and (refused or early.settings != settings):
            early.cancel()  # a config file said otherwise
            early = None
        self.spmd.start_in_background(settings, started=early, refused=refused)
        from ipykernel.compiler import get_tmp_directory

        self.rank_debugger = RankDebugger(self, self.spmd, get_tmp_directory())
        self.spmd.sidebar = RanksSidebar(self, self.spmd)

    # -- what it offers ----------------------------------------------------------------------

    @property
    def kernel_info(self):
        info = dict(super().kernel_info)
        # The debugger is the ranks' (debugger.py); subshells are not offered: a cell sent to
        # one would run on the ranks beside the main shell's, out of their order.
        info["supported_features"] = ["debugger"] if _has_debugpy() else []
        return info

    async def create_subshell_request(self, socket, ident, parent) -> None:
        content = {"status": "error", "ename": "SubshellsNotOffered",
                   "evalue": "The SPMD kernel runs one cell at a time on the ranks, in order: "
                             "it offers no subshells.", "traceback": []}
        self.session.send(socket, "create_subshell_reply", content, parent, ident)

    async def do_debug_request(self, msg):
        sidebar = getattr(self.spmd, "sidebar", None) if hasattr(self, "spmd") else None
        if sidebar is not None and msg.get("command") in agents.COMMANDS:
            # (a program's questions, the MCP server's: answered while a cell runs)
            return dap.reply(msg, agents.answer(self, msg["command"], msg.get("arguments") or {}))
        if sidebar is not None and msg.get("command") in SIDEBAR_COMMANDS:
            # (the Ranks sidebar's clicks: answered on this control thread while a cell runs)
            return dap.reply(msg, {"result": sidebar.answer(msg["command"],
                                                            msg.get("arguments") or {})})
        debugger = getattr(self, "rank_debugger", None)
        if debugger is None:
            return dap.reply(msg, None, message="The kernel is still starting: turn "
                                       "the debugger on again in a moment.")
        return await debugger.process(msg)

    # Whether a cell (any: a %%local one, a start) runs now: the main thread sets it, the
    # control thread's answers to programs read it (agents.py).
    executing = False

    async def do_execute(self, code, silent, *args, **kwargs):
        debugger = getattr(self, "rank_debugger", None)
        if debugger is not None and debugger.started and not silent:
            await debugger.before_cell()
            # (JupyterLab names a cell by a hash of its text as typed: the ranks compile that
            # text, not IPython's cleaned-up copy, while the debugger is on)
            self.spmd.raw_cell = code
        self.executing = True
        try:
            return await super().do_execute(code, silent, *args, **kwargs)
        finally:
            self.executing = False
            self.spmd.raw_cell = None
            if debugger is not None:
                debugger.after_cell()
            if self.spmd.sidebar is not None:  # (a start, stop or restart changed the ranks)
                self.spmd.sidebar.cell_ended()

    # -- answered by rank 0 ----------------------------------------------------------------

    def _ask_rank0(self, fn, *args) -> dict | None:
        """``fn(*args)`` on rank 0, or None when it cannot answer within ``answer_seconds``."""
        magics = getattr(self, "spmd", None)
        if magics is None:
            return None
        session = magics.session
        if magics.pending is not None:  # the kernel's own start, not yet taken by a cell
            session = magics.pending.session if magics.pending.done else None
        if session is None or not session.running or session.busy_ranks() or session.out_of_step:
            return None
        try:
            return session.call(0, fn, *args, timeout=self.answer_seconds)
        except Exception:  # a front end's hint must never fail: the notebook answers instead
            return None

    def do_complete(self, code, cursor_pos):
        if cursor_pos is None:
            cursor_pos = len(code)
        answer = self._ask_rank0(introspect.complete, code, cursor_pos)
        if answer is not None and answer.get("matches"):
            return answer
        # rank 0 cannot answer, or has no such name: perhaps a %%local cell defined it here
        return super().do_complete(code, cursor_pos)

    def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        answer = self._ask_rank0(
            introspect.inspect, code, cursor_pos, detail_level, tuple(omit_sections)
        )
        if answer is not None and answer.get("found"):
            return answer
        return super().do_inspect(code, cursor_pos, detail_level, omit_sections)

    def do_is_complete(self, code):
        # IPython's answer for the code as typed: auto mode would make every cell one
        # complete magic call, and Enter in a console would never ask for a next line.
        with self.spmd.auto.paused():
            return super().do_is_complete(code)

    # -- the end ---------------------------------------------------------------------------

    def do_shutdown(self, restart):
        # (on ipykernel's control thread, while a cell may run on the main thread: the
        # cell's wait ends, and the stop runs once the main thread has let go of the cluster)
        magics = getattr(self, "spmd", None)
        if magics is not None:
            magics.shutdown()
        return super().do_shutdown(restart)


def _has_debugpy() -> bool:
    import importlib.util

    return importlib.util.find_spec("debugpy") is not None
