"""``%spmd``, ``%%spmd`` and ``%%local``: the notebook's handle on the SPMD cluster.

The commands live by what they do: the cluster's life in lifecycle.py, looking at the ranks in
inspection.py, option parsing in arguments.py, the steps of a cell in cell.py; this module
dispatches them (from its one table of commands) and runs cells through those steps.
"""

from __future__ import annotations

import ast
import collections

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class

from spmd.cluster.records import CellResult
from spmd.cluster.session import Ran, Session
from spmd.engine.watch.launches import KEPT_CELLS
from spmd.magics.arrays import printed
from spmd.magics.cells.automode import AutoMode
from spmd.magics.cells.cell import (
    cell_failure,
    cell_value,
    check_ranks,
    hint_placeholders,
    how_it_failed,
    interrupted_by_us,
    ranks_data,
    refusal,
    refuse_exit,
    run_on_ranks,
    show_before,
    show_cell,
    show_ranks_data,
    warn_if_launches_differ,
)
from spmd.magics.cells.panel import Panel
from spmd.magics.cells.render import LiveView, RankResults, group_errors, group_results, write
from spmd.magics.commands.exporting import Exporting
from spmd.magics.commands.inspection import Inspection
from spmd.magics.commands.lifecycle import Lifecycle
from spmd.magics.commands.say import NOT_RUNNING, say
from spmd.magics.commands.sharing import Sharing
from spmd.magics.start.arguments import _cell_parser, _words
from spmd.magics.start.background import BackgroundStart


@magics_class
class SpmdMagics(Lifecycle, Inspection, Sharing, Exporting, Magics):
    """The notebook surface. One Session per IPython shell."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.session: Session | None = None
        self.auto = AutoMode(shell)
        self.auto.install()
        # The SPMD kernel: auto mode cannot be turned off, and its cluster starts at launch.
        self.always_on = False
        self.pending: BackgroundStart | None = None
        self.starting: Session | None = None  # a %spmd start under way on the main thread
        self._shutting_down = False  # set by shutdown (any thread): no start begins after it
        # The kernel's cluster has not been used yet: %spmd start may replace it.
        self._fresh = False
        self.panel = False  # the live panel for every cell (%spmd start --panel)
        self.sidebar = None  # the SPMD kernel's Ranks sidebar (kernel/sidebar.py), if any
        # the per-rank data of the last cells (cells/cell.py), newest last: the main
        # thread appends, kernel/agents.py copies it on the control thread
        self.cells_data: collections.deque = collections.deque(maxlen=KEPT_CELLS)
        self.tabs = False  # outputs that differ per rank as tabs (%spmd start --tabs)
        self.breakpoints = "lowest"  # which ranks stop at breakpoint() (--breakpoint)
        self.failed_ranks: list[int] = []  # ranks that raised in the last cell (%spmd debug)
        # The cell as the front end sent it, set by the SPMD kernel while JupyterLab's
        # debugger is on: the ranks compile that text, which JupyterLab names by its hash.
        self.raw_cell: str | None = None
        # In [n] -> {rank: the request that ran it}: the cells whose launches the ranks keep
        # (%spmd census N)
        self.census_cells: dict[int, dict[int, str]] = {}

    # -- %spmd / %%spmd -------------------------------------------------------------------

    @line_cell_magic
    def spmd(self, line: str, cell: str | None = None):
        """Drive N processes of one SPMD program from this notebook.

        Line magic::

            %spmd start -n 4 [-d K] [--backend jax|torch|jax,torch|none] [--timeout S]
                        [--grace S] [--torch-backend gloo|nccl|mpi]
                        [--init-method tcp|env|file|file:///PATH] [--check-collectives]
                        [--hosts H1,H2 | H1:2,H2:6] [--launcher local|ssh|mpi|slurm]
                        [--launcher-arg KEY=VALUE ...] [--python PATH]
                        [--gpus-per-process K] [--no-curve] [--start-timeout S]
                        [--compilation-cache DIR] [--preload M1,M2]
                        [--rank-server on|off] [--linger DURATION]
                        [--max-output N|all] [--panel] [--tabs] [--breakpoint lowest|all]
            %spmd stop | restart | status [all] | interrupt | where | on | off
            %spmd attach [ID]            take back a cluster whose notebook process died
            %spmd panel [on|off]         the ranks' rows; on: a live panel in every cell
            %spmd log RANK [--tail N]    every line a rank printed
            %spmd debug [RANK]           pdb on a rank's last exception (post-mortem)
            %spmd census [N]             each rank's cross-process launches in the last cell
                                         (or In [N]), grouped by rank
            %spmd sharding EXPR          one picture: which process and device holds what
            %spmd gather EXPR [-o NAME] [--max-bytes N]   the global value, as numpy
            %spmd push NAME [NAME ...]   notebook variables to every rank
            %spmd export PATH.py [--launcher local|ssh|mpi|slurm|torchrun] [--cells ok|all]
                         [--raw-output]  the cells the ranks ran, as a script and its launch
                                         (--raw-output: the job's lines without their ranks)

        ``start`` launches N engine processes on 127.0.0.1, joins them into one distributed
        job (``jax.distributed.initialize``) and turns auto mode on: from then on every cell
        runs on every rank, in lockstep. ``-d K`` gives each process K CPU devices.
        ``--hosts`` starts them over ssh on other hosts (filled in order), ``--launcher mpi``
        through mpiexec, ``--launcher slurm`` as one sbatch job (``--launcher-arg time=10``
        becomes ``#SBATCH --time=10``), or, from inside a Slurm allocation, as an srun step
        of it (``-n``: its task count). Each rank gets an equal share of its host's GPUs.
        On this machine and on each ssh host, one rank server imports IPython, ipyparallel,
        zmq and the backend once and forks the ranks (``--preload flax,optax`` adds modules to
        what it imports; ``--rank-server off`` starts a Python per rank, each with its own
        string-hash salt, as a job's processes); ``%spmd restart`` has it fork new ones in
        well under a second.
        jax's compilation cache is shared by the ranks and kept across restarts.
        ``--backend torch`` runs ``torch.distributed.init_process_group`` instead (gloo by
        default; every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
        ``--check-collectives`` turns on torch's own check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``):
        a collective whose op or sizes differ between ranks raises on every rank.
        ``--linger`` (default 10m; 0: never): how long the ranks outlive this notebook's
        process when it dies, for ``%spmd attach`` in a new one (``python -m spmd list``).

        Cell magic (runs one cell on the cluster, also when auto mode is off)::

            %%spmd [--ranks 0,2] [--timeout S] [--grace S] [--max-output N|all] [--panel]
                   [--tabs] [--breakpoint lowest|all]
            print(jax.process_index())

        A rank keeps at most ``--max-output`` lines (default 1000) of a cell in the notebook:
        its first and last lines; ``%spmd log RANK`` has them all. ``input()``, ``getpass``
        and pdb on a rank prompt here, labelled by rank, one rank at a time in rank order;
        at ``breakpoint()`` one rank stops, the first to reach it (the lowest, of those that
        reach it together; ``--breakpoint all``: every rank), and the others go on to wait in
        their next collective.

        When ranks still busy ``--grace`` seconds (default 2, ``off`` to disable) after
        another rank finished launched a cross-process program it never did (they diverged),
        or stay 3 s more inside one call of jax or torch (an eager operation on a global
        array the others skipped), or after ``--timeout`` seconds, or when you interrupt the
        kernel, the cell fails with a report: which ranks raised, where the others were
        blocked, and the likely cause. A rank that is only slower (in its own Python code, or
        compiling) is waited for, named in the live view. ``%spmd where`` shows the stack of
        every busy rank.

        ``%%local`` runs one cell in the notebook only.
        """
        if cell is not None:
            return self._run_cell(line, cell)
        command, _, rest = line.strip().partition(" ")
        if not command:
            raise UsageError("Say what to do: %spmd start -n 4, or stop, restart, status, on, off.")
        handler = _COMMANDS.get(command)
        if handler is None:
            raise UsageError(f"%spmd has no command {command!r}: use {_command_names()}.")
        # Python expressions keep their quotes and spaces; other commands take shell words.
        return handler(
            self,
            rest.strip() if command in _EXPRESSION_COMMANDS else _words(f"%spmd {line}", rest),
        )

    @cell_magic
    def local(self, line: str, cell: str):
        """Run this cell in the notebook's own process only, also in auto mode.

        Example::

            %%local
            results = []   # a notebook variable, not on the ranks
        """
        if self.session is not None:  # (an export says it was left out)
            count = self.shell.displayhook.prompt_count
            self.session.ran.append(Ran(cell, count, where="notebook"))
        with self.auto.paused():
            code = self.shell.transform_cell(cell)
        tree = ast.parse(code)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        ns = self.shell.user_ns
        exec(compile(tree, "<local cell>", "exec"), ns)
        if last is not None:
            return eval(compile(ast.Expression(last.value), "<local cell>", "eval"), ns)
        return None

    # -- commands -------------------------------------------------------------------------

    def _cmd_on(self, args: list[str]) -> None:
        self._no_args("on", args)
        self.auto.on = True
        say("Auto mode on: every cell runs on all ranks (%%local for the notebook only).")

    def _cmd_off(self, args: list[str]) -> None:
        self._no_args("off", args)
        if self.always_on:
            raise UsageError(
                "In the SPMD kernel every cell runs on the ranks: use %%local for a cell in the "
                "notebook only."
            )
        self.auto.on = False
        say("Auto mode off: cells run in the notebook (%%spmd for the ranks).")

    def _no_args(self, command: str, args: list[str]) -> None:
        if args:
            raise UsageError(f"%spmd {command} takes no arguments, got {' '.join(args)!r}.")

    def _require_session(
        self, allow_stopped: bool = False, refused: str = "The cluster is stopped"
    ) -> Session:
        if self.pending is not None:
            self._take_pending()
        self._fresh = False
        s = self.session
        if s is None:
            raise UsageError(NOT_RUNNING)
        if s.running:
            s.notice_deaths()
        if not (s.running or allow_stopped):
            if s.death is not None:
                raise UsageError(refusal(s, f"{refused}: {s.out_of_step}"))
            raise UsageError(
                f"The cluster is stopped: %spmd restart starts {s.settings.n} processes again."
            )
        return s

    # -- cells ----------------------------------------------------------------------------

    def _run_cell(self, line: str, cell: str) -> RankResults | None:
        words = _words(f"%%spmd {line}", line) if line.strip() else []
        return self._run(_cell_parser().parse_args(words), cell)

    def _run(self, opts, cell: str, debugging: bool = False) -> RankResults | None:
        """One cell on the ranks, in the steps of cell.py: before it, the run, the
        bookkeeping, what is shown, then its value or its failure."""
        # the kernel's start line, shown again after a live view
        started = self._take_pending() if self.pending is not None else ""
        session = self._require_session(refused="Cell not run")
        panel = Panel(session) if (self.panel or opts.panel) else None
        sidebar = self.sidebar
        live = LiveView(where=session.stacks, panel=panel, sidebar=sidebar and (
            lambda run: sidebar.tick(session, run)))
        show_before(live, session, started)
        n = session.settings.n
        check_ranks(opts.ranks, n, live, debugging)
        if not cell.strip():
            return None
        refuse_exit(cell)
        ran = run_on_ranks(session, self._as_sent(cell), opts, live,
                           opts.breakpoint or self.breakpoints)
        # (print(x) of arrays over several processes: their placeholders come marked)
        # (or a rank's reply says placeholders were left out, marks and all: it says so)
        not_rebuilt = printed.rebuild(ran) if _marked(ran) or any(ran.printed.values()) else ""
        count = self.shell.displayhook.prompt_count
        self._keep_requests(count, ran)
        errors = group_errors(ran.cells, ignore=interrupted_by_us(ran.stall))
        results = group_results(ran.cells)
        # (recorded first: the cell ran on the ranks, whatever showing it may raise)
        self._record(session, cell, count, opts.ranks, debugging, ran, errors, results)
        data = ranks_data(ran, count)  # (each rank's outputs as data, for programs)
        self.cells_data.append(data)
        show_cell(session, ran, live, panel, tabs=self.tabs or opts.tabs,
                  then=bool(errors or results or ran.stall is not None))
        show_ranks_data(data)
        if not_rebuilt:
            write("stderr", not_rebuilt + "\n")
        warn_if_launches_differ(session, ran, raised=bool(errors))
        if not debugging:
            self.failed_ranks = sorted(r for ranks_, _ in errors for r in ranks_)
        if not (debugging or ran.stall is not None or not_rebuilt):
            hint_placeholders(session, cell, ran)
        if errors or ran.stall is not None:
            raise cell_failure(session, cell, ran, errors, results)
        return cell_value(session, ran, results, n, f"Out[{count}]")

    def _as_sent(self, cell: str) -> str:
        """The cell as the front end sent it, where the SPMD kernel kept it (JupyterLab's
        debugger names a cell by its text's hash); else as IPython hands it over."""
        raw = self.raw_cell
        return raw if raw is not None and cell in (raw, raw + "\n") else cell

    def _keep_requests(self, count: int, ran: CellResult) -> None:
        """The cell's requests, for %spmd census N (the ranks keep the last KEPT_CELLS)."""
        self.census_cells[count] = dict(ran.requests)
        while len(self.census_cells) > KEPT_CELLS:
            del self.census_cells[min(self.census_cells)]

    def _record(self, session: Session, cell: str, count: int, ranks: list[int] | None,
                debugging: bool, ran: CellResult, errors: list, results: list) -> None:
        """The cell in the session's list of what ran (for %spmd export)."""
        n = session.settings.n
        session.ran.append(Ran(
            cell if not debugging else f"%spmd debug {ranks[0]}",
            count,
            tuple(ranks) if ranks is not None and len(ranks) < n else None,
            "debug" if debugging else "ranks",
            failed=how_it_failed(ran.stall, errors),
            showed_value=bool(results),
        ))


def _marked(ran: CellResult) -> bool:
    """Whether a rank printed an array over several processes in the cell (its placeholder
    marked, engine/arrays/print_marks.py; the marks hold NULs, which printed.rebuild looks for
    too): only then is there something to put together."""
    return any("\x00" in (o.text if o.kind in ("stdout", "stderr")
                           else (o.data or {}).get("text/plain", ""))
               for c in ran.cells.values() for o in c.outputs)


_EXPRESSION_COMMANDS = ("sharding", "gather")

# What each %spmd command runs: (self, its words, or the expression as written).
_COMMANDS = {
    "start": Lifecycle._cmd_start,
    "stop": Lifecycle._cmd_stop,
    "restart": Lifecycle._cmd_restart,
    "attach": Lifecycle._cmd_attach,
    "status": Inspection._cmd_status,
    "panel": Inspection._cmd_panel,
    "log": Inspection._cmd_log,
    "debug": Inspection._cmd_debug,
    "interrupt": Inspection._cmd_interrupt,
    "where": Inspection._cmd_where,
    "census": Inspection._cmd_census,
    "sharding": Sharing._cmd_sharding,
    "gather": Sharing._cmd_gather,
    "push": Sharing._cmd_push,
    "export": Exporting._cmd_export,
    "on": SpmdMagics._cmd_on,
    "off": SpmdMagics._cmd_off,
}


def _command_names() -> str:
    """'start, stop, ..., on or off': the commands of the table, for a refusal."""
    names = list(_COMMANDS)
    return f"{', '.join(names[:-1])} or {names[-1]}"


_magics: dict[int, SpmdMagics] = {}


def register(shell) -> SpmdMagics:
    magics = _magics.get(id(shell))
    if magics is None:
        magics = _magics[id(shell)] = SpmdMagics(shell)
        shell.register_magics(magics)
    return magics


def unregister(shell) -> None:
    magics = _magics.pop(id(shell), None)
    if magics is not None:
        magics.shutdown()
        if magics.session is not None:
            magics.session.logs.remove()
        magics.auto.uninstall()
