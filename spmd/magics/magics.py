"""``%spmd``, ``%%spmd`` and ``%%local``: the notebook's handle on the SPMD cluster."""

from __future__ import annotations

import argparse
import ast
import functools
import math
import os
import re
import shlex
import sys
import time

import numpy as np
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.display import display
from traitlets.config import Config

from spmd import options
from spmd.cluster import remote
from spmd.cluster.lockstep import rank_set, rank_words
from spmd.cluster.session import STANDBY_LAUNCHERS, OutOfStep, Session, Settings, StartError
from spmd.cluster.watchdog import stack_section
from spmd.magics import arrays, widgets
from spmd.magics.automode import AutoMode
from spmd.magics.background import BackgroundStart
from spmd.magics.panel import Panel, panel_bundle
from spmd.magics.progress import StartProgress
from spmd.magics.prompts import Prompter
from spmd.magics.render import (
    LiveView,
    RankErrors,
    RankResults,
    group_errors,
    group_results,
    show_group,
    show_outputs,
)
from spmd.magics.status import status_table, summary
from spmd.options import count

NOT_RUNNING = "No SPMD cluster is running: start one with %spmd start -n 4."


def say(text: str, file=None) -> None:
    """One line (or lines) to the cell, in one write: ``print`` writes the text and its
    newline apart, and ipykernel may send them as two outputs (a lone "\\n" in the saved
    notebook) when its flush timer fires in between."""
    (file or sys.stdout).write(f"{text}\n")


def _words(what: str, text: str) -> list[str]:
    """Shell words, as the options are written; a quote left open is a UsageError."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # shlex says "No closing quotation"
        raise UsageError(
            f"{what.strip()}: {str(exc).lower()}: close the quote, or leave the quotes out."
        ) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a timeout is a number of seconds above 0, not {text!r}")
    return value


def _grace(text: str) -> float:
    """Seconds, or 'off' (0 and 'off' turn the divergence watchdog off)."""
    if text.lower() in ("off", "none", "0"):
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--grace takes seconds (like 2) or off, not {text!r}")
    return value


def _ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"--ranks takes rank numbers like 0,2, not {text!r}")
    return ranks


class _Parser(MagicArgumentParser):
    """argparse that raises UsageError with one sentence that says what to do."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}. See %spmd? for the options.")


@functools.cache
def _start_parser() -> _Parser:
    p = _Parser(prog="%spmd start", add_help=False)
    p.add_argument("-n", "--processes", type=count("-n", "-n 4"), required=True)
    p.add_argument("-d", "--devices-per-process", type=count("--devices-per-process", "-d 2"))
    p.add_argument("--backend", type=options.backend, default="jax")
    p.add_argument("--torch-backend", choices=options.TORCH_BACKENDS, default=None)
    p.add_argument("--init-method", type=options.init_method, default=None)
    p.add_argument("--timeout", type=_seconds, default=None)
    p.add_argument("--grace", type=_grace, default=Settings.grace)
    p.add_argument("--start-timeout", type=_seconds, default=Settings.start_timeout)
    p.add_argument("--hosts", default="")
    p.add_argument("--launcher", choices=remote.LAUNCHERS, default=None)
    p.add_argument("--launcher-arg", type=_key_value, action="append", default=[])
    p.add_argument("--python", default="")
    p.add_argument("--gpus-per-process", type=_gpus, default=None)
    p.add_argument("--no-curve", action="store_true")
    p.add_argument("--standby", choices=("on", "off"), default=None)
    p.add_argument("--compilation-cache", default=None)
    p.add_argument("--max-output", type=_max_output, default=Settings.max_output)
    p.add_argument("--panel", action="store_true")
    p.add_argument("--tabs", action="store_true")
    p.add_argument("--breakpoint", choices=BREAKPOINTS, default="lowest")
    return p


# breakpoint() on the ranks: only the lowest rank that reaches one stops, or every rank
BREAKPOINTS = ("lowest", "all")


def _max_output(text: str) -> int | None:
    """Lines per rank and cell, or 'all'."""
    if text.lower() == "all":
        return None
    return count("--max-output", "--max-output 1000 (or all)")(text)


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"--launcher-arg takes KEY=VALUE, like partition=gpu, not {text!r}"
        )
    return key.strip(), value


def _gpus(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"--gpus-per-process takes a whole number (0 hides the GPUs), not {text!r}"
        )
    return int(text)


def _cache_folder(path: str | None) -> str | None:
    """--compilation-cache: the folder, made if missing; UsageError where it cannot be."""
    if path is None:
        return None
    folder = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"%spmd start: --compilation-cache {path} cannot be used ({exc.strerror}): name a "
            "folder you can write to."
        ) from None
    return folder


def _options_checked(opts, where: remote.Placement) -> remote.Placement:
    """``where``, once the torch and standby options agree with the backend and launcher."""
    if opts.standby == "on" and where.launcher not in STANDBY_LAUNCHERS:
        raise UsageError(
            f"%spmd start: standby engines need the local or ssh launcher ({where.launcher} "
            "starts all ranks as one job): drop --standby on."
        )
    torch_flag = "--torch-backend" if opts.torch_backend else "--init-method"
    if (opts.torch_backend or opts.init_method) and "torch" not in opts.backend:
        raise UsageError(f"%spmd start: {torch_flag} is for --backend torch: add it.")
    if opts.torch_backend == "mpi" and where.launcher != "mpi":
        raise UsageError(
            "%spmd start: --torch-backend mpi needs ranks started by mpiexec: add --launcher mpi."
        )
    method = opts.init_method or ""
    if method == "file" and not where.on_this_machine:
        raise UsageError(
            "%spmd start: --init-method file keeps its file in a folder of this machine, which "
            "the other hosts cannot see: give one on a shared file system, like "
            "--init-method file:///shared/spmd-init."
        )
    folder = os.path.dirname(method[len("file://"):])
    if method.startswith("file:///") and where.on_this_machine and not os.path.isdir(folder):
        raise UsageError(
            f"%spmd start: the folder of --init-method {method} does not exist: create it, or "
            "name a file in a folder that does."
        )
    return where


def _placement(opts) -> remote.Placement:
    """Where the ranks of ``%spmd start`` run, from its options; UsageError if they clash."""
    launcher = opts.launcher or ("ssh" if opts.hosts else "local")
    if launcher == "local" and (opts.hosts or opts.launcher_arg):
        flag = "--hosts" if opts.hosts else "--launcher-arg"
        raise UsageError(
            f"%spmd start: {flag} is for ranks on other hosts: add --launcher ssh, mpi or slurm."
        )
    if launcher == "ssh" and not opts.hosts:
        raise UsageError("%spmd start: --launcher ssh needs --hosts, like --hosts node1,node2.")
    if opts.python and launcher in ("local", "mpi") and not opts.hosts:
        if not (os.path.isfile(opts.python) and os.access(opts.python, os.X_OK)):
            raise UsageError(
                f"%spmd start: --python {opts.python} is not a Python interpreter on this "
                "machine: give the path of one, like /usr/bin/python3."
            )
    try:
        hosts = remote.parse_hosts(opts.hosts, opts.processes) if opts.hosts else ()
        placed = remote.Placement(launcher, hosts, tuple(opts.launcher_arg), opts.python)
        if launcher != "local":  # the launcher's settings exist and take these values
            remote.configure(Config(), placed, [], [], {})
    except (remote.HostsError, ValueError) as exc:
        raise UsageError(f"%spmd start: {exc}.") from None
    return placed


@functools.cache  # built once: %%spmd parses its line on every cell
def _cell_parser() -> _Parser:
    p = _Parser(prog="%%spmd", add_help=False)
    p.add_argument("--ranks", type=_ranks, default=None)
    p.add_argument("--timeout", type=_seconds, default=None)
    p.add_argument("--grace", type=_grace, default=None)
    p.add_argument("--max-output", type=_max_output, default=0)
    p.add_argument("--tabs", action="store_true")
    p.add_argument("--panel", action="store_true")
    p.add_argument("--breakpoint", choices=BREAKPOINTS, default=None)
    return p


@functools.cache
def _log_parser() -> _Parser:
    p = _Parser(prog="%spmd log", add_help=False)
    p.add_argument("rank", type=_rank)
    p.add_argument("--tail", type=count("--tail", "--tail 50"), default=None)
    return p


def _rank(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"say which rank by its number, like 1, not {text!r}"
        ) from None


@magics_class
class SpmdMagics(Magics):
    """The notebook surface. One Session per IPython shell."""

    def __init__(self, shell) -> None:
        super().__init__(shell)
        self.session: Session | None = None
        self.auto = AutoMode(shell)
        self.auto.install()
        # The SPMD kernel: auto mode cannot be turned off, and its cluster starts at launch.
        self.always_on = False
        self.pending: BackgroundStart | None = None
        # The kernel's cluster has not been used yet: %spmd start may replace it.
        self._fresh = False
        self.panel = False  # the live panel for every cell (%spmd start --panel)
        self.tabs = False  # outputs that differ per rank as tabs (%spmd start --tabs)
        self.breakpoints = "lowest"  # which ranks stop at breakpoint() (--breakpoint)
        self.failed_ranks: list[int] = []  # ranks that raised in the last cell (%spmd debug)

    def start_in_background(
        self, settings: Settings, started: BackgroundStart | None = None
    ) -> None:
        """Start the kernel's cluster on a thread (or take one ``started`` already); the
        first use of the cluster waits for it."""
        self.always_on = self.auto.on = True
        self.pending = started or BackgroundStart(settings)

    def _take_pending(self) -> str:
        """Wait for the kernel's cluster (one progress line) and make it this notebook's;
        the line shown, if one was."""
        pending = self.pending
        if pending is None:
            return ""
        s = pending.settings
        # (an interrupt while waiting leaves the start pending, for the next cell to take)
        shown = pending.wait(f"Starting the kernel's {s.n} processes ({s.backend})...")
        self.pending = None
        self.session = pending.session
        if pending.error is not None:
            raise UsageError(f"{pending.error} (%spmd restart tries again)")
        self._fresh = True
        return shown

    # -- %spmd / %%spmd -------------------------------------------------------------------

    @line_cell_magic
    def spmd(self, line: str, cell: str | None = None):
        """Drive N processes of one SPMD program from this notebook.

        Line magic::

            %spmd start -n 4 [-d K] [--backend jax|torch|jax,torch|none] [--timeout S]
                        [--grace S] [--torch-backend gloo|nccl|mpi]
                        [--init-method tcp|env|file|file:///PATH] [--hosts H1,H2 | H1:2,H2:6] [--launcher local|ssh|mpi|slurm]
                        [--launcher-arg KEY=VALUE ...] [--python PATH]
                        [--gpus-per-process K] [--no-curve] [--start-timeout S]
                        [--standby on|off] [--compilation-cache DIR]
                        [--max-output N|all] [--panel] [--tabs] [--breakpoint lowest|all]
            %spmd stop | restart | status | interrupt | where | on | off
            %spmd panel [on|off]         the ranks' rows; on: a live panel in every cell
            %spmd log RANK [--tail N]    every line a rank printed
            %spmd debug [RANK]           pdb on a rank's last exception (post-mortem)
            %spmd sharding EXPR          one picture: which process and device holds what
            %spmd gather EXPR [-o NAME] [--max-bytes N]   the global value, as numpy
            %spmd push NAME [NAME ...]   notebook variables to every rank

        ``start`` launches N engine processes on 127.0.0.1, joins them into one distributed
        job (``jax.distributed.initialize``) and turns auto mode on: from then on every cell
        runs on every rank, in lockstep. ``-d K`` gives each process K CPU devices.
        ``--hosts`` starts them over ssh on other hosts (filled in order), ``--launcher mpi``
        through mpiexec, ``--launcher slurm`` as one sbatch job (``--launcher-arg time=10``
        becomes ``#SBATCH --time=10``). Each rank gets an equal share of its host's GPUs.
        A set of standby engines waits behind the ranks (on by default over ssh, and for ranks
        on this machine where memory allows): ``%spmd restart`` promotes them in well under a
        second.
        jax's compilation cache is shared by the ranks and kept across restarts.
        ``--backend torch`` runs ``torch.distributed.init_process_group`` instead (gloo by
        default; every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

        Cell magic (runs one cell on the cluster, also when auto mode is off)::

            %%spmd [--ranks 0,2] [--timeout S] [--grace S] [--max-output N|all] [--panel]
                   [--tabs] [--breakpoint lowest|all]
            print(jax.process_index())

        A rank keeps at most ``--max-output`` lines (default 1000) of a cell in the notebook:
        its first and last lines; ``%spmd log RANK`` has them all. ``input()``, ``getpass``
        and pdb on a rank prompt here, labelled by rank, one rank at a time in rank order;
        at ``breakpoint()`` only the lowest rank that reaches it stops (``--breakpoint all``:
        every rank), and the others go on to wait in their next collective.

        When some ranks are still busy ``--grace`` seconds (default 2, ``off`` to disable)
        after another rank finished, or after ``--timeout`` seconds, or when you interrupt
        the kernel, the cell fails with a report: which ranks raised, where the others were
        blocked, and the likely cause. ``%spmd where`` shows the stack of every busy rank.

        ``%%local`` runs one cell in the notebook only.
        """
        if cell is not None:
            return self._run_cell(line, cell)
        command, _, rest = line.strip().partition(" ")
        if not command:
            raise UsageError("Say what to do: %spmd start -n 4, or stop, restart, status, on, off.")
        handler = getattr(self, f"_cmd_{command}", None)
        if handler is None:
            raise UsageError(
                f"%spmd has no command {command!r}: use start, stop, restart, status, panel, "
                "log, debug, interrupt, where, sharding, gather, push, on or off."
            )
        # Python expressions keep their quotes and spaces; other commands take shell words.
        return handler(
            rest.strip() if command in _EXPRESSION_COMMANDS else _words(f"%spmd {line}", rest)
        )

    @cell_magic
    def local(self, line: str, cell: str):
        """Run this cell in the notebook's own process only, also in auto mode.

        Example::

            %%local
            results = []   # a notebook variable, not on the ranks
        """
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

    def _cmd_start(self, args: list[str]) -> None:
        opts = _start_parser().parse_args(args)
        settings = Settings(
            n=opts.processes,
            cpu_devices=opts.devices_per_process,
            backend=opts.backend,
            torch_backend=opts.torch_backend or Settings.torch_backend,
            init_method=opts.init_method or Settings.init_method,
            cell_timeout=opts.timeout,
            grace=opts.grace or None,
            where=_options_checked(opts, _placement(opts)),
            gpus_per_process=opts.gpus_per_process,
            curve=not opts.no_curve,
            start_timeout=opts.start_timeout,
            standby=None if opts.standby is None else opts.standby == "on",
            cache_dir=_cache_folder(opts.compilation_cache),
            max_output=opts.max_output,
        )
        if self._kernel_cluster_is(settings):
            self._show_as(opts)
            say(summary(self.session))
            return
        if self.session is not None and self.session.running:
            raise UsageError(
                f"A cluster of {self.session.settings.n} processes is already running: "
                "use %spmd stop or %spmd restart first."
            )
        if self.session is not None:
            self.session.stop()  # (after a death, its controller and standbys)
        _warn_if_notebook_joined_jax()
        self._start(settings)
        self._show_as(opts)

    def _show_as(self, opts) -> None:
        """How cells show from now on, as the start that was taken asked."""
        self.panel, self.tabs, self.breakpoints = opts.panel, opts.tabs, opts.breakpoint

    def _kernel_cluster_is(self, settings: Settings) -> bool:
        """Whether the kernel's own, still unused cluster is the one asked for. If it is not,
        it is cancelled or stopped, so that the one asked for starts instead (never two)."""
        if self.pending is not None:
            if self.pending.settings == settings:
                self._take_pending()
            else:
                self.pending.cancel()
                self.pending = None
        if self._fresh and self.session is not None:
            self._fresh = False
            if self.session.running and self.session.settings == settings:
                return True
            self.session.stop()
            self.session = None
        return False

    def _start(self, settings: Settings, cache_dir: str | None = None) -> None:
        if not settings.curve and settings.where.leaves_machine:
            say(
                "Warning: --no-curve: messages to and from the other hosts are signed but "
                "not encrypted.",
                file=sys.stderr,
            )
        session = Session(settings)
        session._cache_dir = cache_dir  # a restart's: compiled cells stay compiled
        progress = StartProgress(settings.n, settings.backend)
        session.progress = progress.update
        progress.started = time.monotonic()  # (the same clock as the summary's seconds)
        try:
            session.start()
        except StartError as exc:
            progress.done(ok=False)
            raise UsageError(str(exc)) from None
        except BaseException:
            progress.done(ok=False)
            raise
        session.progress = None
        progress.done(ok=True)
        self.session = session
        self.auto.on = True
        say(summary(session))

    def _cmd_stop(self, args: list[str]) -> None:
        self._no_args("stop", args)
        session = self._require_session(allow_stopped=bool(self.session and self.session.death))
        self.auto.on = self.always_on
        after = "auto mode is off." if not self.always_on else "%spmd restart starts them again."
        if not session.running:  # stopped already, after a rank died
            session.stop()  # (its standbys and controller, where they were kept)
            say(f"The cluster was already stopped after rank {session.death.rank} died; {after}")
            return
        t0 = time.perf_counter()
        session.stop()
        say(
            f"Stopped {session.settings.n} processes in {time.perf_counter() - t0:.2f} s; {after}"
        )

    def _cmd_restart(self, args: list[str]) -> None:
        self._no_args("restart", args)
        session = self._require_session(allow_stopped=True)
        try:
            promoted = session.cluster is not None and session.restart()
        except StartError as exc:
            raise UsageError(str(exc)) from None
        if promoted:
            self.auto.on = True
            say(summary(session, restarted=True))
            return
        session.stop(keep_cache=True)
        self._start(session.settings, cache_dir=session._cache_dir)

    def _cmd_status(self, args: list[str]) -> None:
        self._no_args("status", args)
        session = self._require_session(allow_stopped=True)
        say(status_table(session, self.auto.on))

    def _cmd_interrupt(self, args: list[str]) -> None:
        self._no_args("interrupt", args)
        sent, still = self._require_session().interrupt()
        if not sent:
            say("No rank is running a cell: there is nothing to interrupt.")
        elif still:
            say(
                f"Sent SIGINT to {rank_words(sent)}; {rank_words(still)} did not respond: "
                "%spmd restart ends them."
            )
        else:
            say(f"Interrupted {rank_words(sent)}; every rank is idle now.")

    def _cmd_where(self, args: list[str]) -> None:
        self._no_args("where", args)
        session = self._require_session()
        busy = session.busy_ranks()
        if not busy:
            n = session.settings.n
            say(
                f"No rank is running a cell: all {n} ranks are idle, so there is no stack to show."
            )
            return
        say("\n".join(stack_section(busy, session.stacks(busy))).lstrip("\n"))

    def _cmd_log(self, args: list[str]) -> None:
        opts = _log_parser().parse_args(args)
        session = self._require_session(allow_stopped=True)
        n = session.settings.n
        if opts.rank >= n:
            raise UsageError(f"%spmd log {opts.rank}: this cluster has ranks 0-{n - 1}.")
        text, lines = session.logs.read(opts.rank, opts.tail)
        if not lines:
            say(f"Rank {opts.rank} has printed nothing since the cluster started.")
            return
        which = f"the last {min(opts.tail, lines):,} of " if opts.tail else ""
        say(f"[rank {opts.rank}] {which}{lines:,} lines ({session.logs.path(opts.rank)}):")
        sys.stdout.write(text)

    def _cmd_debug(self, args: list[str]):
        """Post-mortem pdb on a rank's last exception (the lowest rank that failed in the last
        cell, by default), like IPython's %debug: nothing runs again."""
        session = self._require_session()
        if len(args) > 1 or (args and not args[0].isdigit()):
            raise UsageError("%spmd debug takes one rank number, like %spmd debug 1, or none.")
        n = session.settings.n
        if args:
            rank = int(args[0])
            if rank >= n:
                raise UsageError(f"%spmd debug {rank}: this cluster has ranks 0-{n - 1}.")
        elif self.failed_ranks:
            rank = self.failed_ranks[0]
        else:
            raise UsageError(
                "No rank raised in the last cell: say which rank to debug, like %spmd debug 1."
            )
        opts = _cell_parser().parse_args(["--ranks", str(rank), "--grace", "off"])
        return self._run(opts, _POST_MORTEM, debugging=True)

    def _cmd_panel(self, args: list[str]) -> None:
        if args and args != ["on"] and args != ["off"]:
            raise UsageError("%spmd panel takes on, off or nothing (the ranks' rows now).")
        session = self._require_session(allow_stopped=True)
        if args:
            self.panel = args == ["on"]
            say(
                "The live panel is on: every cell shows its ranks' rows while it runs."
                if self.panel
                else "The live panel is off (%%spmd --panel shows it for one cell)."
            )
            return
        run = session.unfinished  # (a cell the notebook gave up on, some ranks still in it)
        display(panel_bundle(Panel(session).rows(run), live=True if run else None), raw=True)

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

    def _cmd_sharding(self, expr: str) -> None:
        if not expr:
            raise UsageError("Say which array: %spmd sharding x draws the layout of x.")
        session = self._require_session()
        display(arrays.sharding_bundle(session, expr), raw=True)

    def _cmd_gather(self, text: str):
        expr, name, max_bytes = _gather_options(text)
        session = self._require_session()
        value = arrays.gather(session, expr, max_bytes)
        if name is None:
            return value
        self.shell.user_ns[name] = value
        what = (
            f"numpy {value.dtype}{list(value.shape)}"
            if isinstance(value, np.ndarray)
            else (f"a list of {len(value)} values, by rank")
        )
        say(f"{name} = {what}, from {expr} on the ranks.")
        return None

    def _cmd_push(self, names: list[str]) -> None:
        if not names or not all(n.isidentifier() for n in names):
            raise UsageError(
                "Say which notebook variables: %spmd push x y sends x and y to every rank."
            )
        say(arrays.push(self._require_session(), names, self.shell.user_ns))

    def _no_args(self, command: str, args: list[str]) -> None:
        if args:
            raise UsageError(f"%spmd {command} takes no arguments, got {' '.join(args)!r}.")

    def _require_session(
        self, allow_stopped: bool = False, refused: str = "The cluster is stopped"
    ) -> Session:
        self._take_pending()
        self._fresh = False
        s = self.session
        if s is None:
            raise UsageError(NOT_RUNNING)
        if s.running:
            s.notice_deaths()
        if not (s.running or allow_stopped):
            if s.death is not None:
                raise UsageError(_refusal(s, f"{refused}: {s.out_of_step}"))
            raise UsageError(
                f"The cluster is stopped: %spmd restart starts {s.settings.n} processes again."
            )
        return s

    # -- cells ----------------------------------------------------------------------------

    def _run_cell(self, line: str, cell: str) -> RankResults | None:
        return self._run(_cell_parser().parse_args(_words(f"%%spmd {line}", line)), cell)

    def _run(self, opts, cell: str, debugging: bool = False) -> RankResults | None:
        started = self._take_pending()  # the kernel's start line, shown again after a live view
        session = self._require_session(refused="Cell not run")
        panel = Panel(session) if (self.panel or opts.panel) else None
        live = LiveView(where=session.stacks, panel=panel)
        if started:
            live.reprint("stdout", started + "\n")
        n = session.settings.n
        ranks = opts.ranks
        if ranks is not None:
            if ranks[-1] >= n:
                raise UsageError(f"--ranks {rank_set(ranks)}: this cluster has ranks 0-{n - 1}.")
            if len(ranks) < n and not debugging:
                live.note(
                    "stderr",
                    f"Running on ranks {rank_set(ranks)} only: a collective in this cell would "
                    "hang, waiting for the other ranks.\n",
                )
        if not cell.strip():
            return None
        try:
            run = session.run_cell(
                cell,
                ranks=ranks,
                timeout=opts.timeout,
                grace=opts.grace,
                on_output=live.add,
                tick=live.tick,
                max_output=opts.max_output,
                on_prompt=Prompter(live),
                breakpoints=opts.breakpoint or self.breakpoints,
            )
        except OutOfStep as exc:
            raise UsageError(_refusal(session, f"Cell not run: {exc}")) from None
        finally:
            live.close()
        stall = run.stall
        if live.widgets_shown:
            busy = set(stall.busy) if stall is not None else set()
            widgets.refresh_texts(session, run.cells, [r for r in run.cells if r not in busy])
        if panel is not None:
            panel.freeze(run)
        show_outputs(run.cells, tabs=self.tabs or opts.tabs)
        errors = group_errors(run.cells, ignore=_interrupted_by_us(stall))
        if not debugging:
            self.failed_ranks = sorted(r for ranks_, _ in errors for r in ranks_)
        results = group_results(run.cells)
        if not (errors or stall is not None):
            return RankResults.of(results)
        for group in results:  # the cell fails: what did return is shown, not returned
            show_group(*group)
        notes, details, hints = [], [], []
        if stall is not None:
            notes = stall.summary()
            details = stack_section(stall.busy, stall.stacks)
            if stall.deaths:
                details = ["", *stall.deaths[0].describe(headline=False), *details]
        else:
            hints = [h for h in [arrays.gather_hint(session, cell, errors)] if h]
        dead = [d.rank for d in stall.deaths] if stall is not None else []
        raise RankErrors(errors, sorted(run.cells), notes, details, hints, dead)


def _interrupted_by_us(stall) -> set[int]:
    """Ranks whose KeyboardInterrupt came from the watchdog's own SIGINT: not their error."""
    return set() if stall is None else set(stall.busy)


def _refusal(session: Session, text: str) -> str:
    """A refusal, with the dead rank's report when a death is the reason."""
    if session.death is not None:
        text += "\n" + "\n".join(session.death.describe())
    return text


_EXPRESSION_COMMANDS = ("sharding", "gather")

# On the rank: pdb on its last exception (IPython keeps it in sys.last_traceback), or why not.
_POST_MORTEM = """\
import sys as _spmd_sys
if getattr(_spmd_sys, "last_traceback", None) is None:
    print("This rank has raised no exception yet: nothing to debug.")
else:
    get_ipython().run_line_magic("debug", "")
del _spmd_sys
"""


def _gather_options(text: str) -> tuple[str, str | None, int]:
    """'x[0] -o first --max-bytes 1e6' -> ('x[0]', 'first', 1000000)."""
    name = None
    max_bytes = arrays.DEFAULT_MAX_BYTES
    if re.search(r"(?:^|\s)-o\s*$", text):
        raise UsageError("-o takes a variable name, like %spmd gather x -o full.")
    if re.search(r"(?:^|\s)--max-bytes\s*$", text):
        raise UsageError("--max-bytes takes a number of bytes, like --max-bytes 1e9.")
    m = re.search(r"(?:^|\s)-o\s+(\S+)", text)
    if m:
        name = m.group(1)
        if not name.isidentifier():
            raise UsageError(f"-o takes a variable name, like -o full, not {name!r}.")
        text = text[: m.start()] + text[m.end() :]
    m = re.search(r"(?:^|\s)--max-bytes\s+(\S+)", text)
    if m:
        try:
            max_bytes = int(float(m.group(1)))
        except (ValueError, OverflowError):  # 'lots', or 1e400 (inf)
            max_bytes = 0
        if max_bytes < 1:
            raise UsageError(f"--max-bytes takes a number of bytes, like 1e9, not {m.group(1)!r}.")
        text = text[: m.start()] + text[m.end() :]
    expr = text.strip()
    if not expr:
        raise UsageError("Say which value: %spmd gather x [-o NAME] [--max-bytes N].")
    return expr, name, max_bytes


def _warn_if_notebook_joined_jax() -> None:
    """The notebook must not be a member of the job: a failing rank would abort it."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        say(
            "Warning: jax has initialized its backends in this notebook process. The notebook "
            "does not join the job (only the ranks do), so run jax code on the ranks.",
            file=sys.stderr,
        )


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
        if magics.session is not None:
            magics.session.stop()
        magics.auto.uninstall()
