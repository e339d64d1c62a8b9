"""Looking at the ranks from the notebook: ``%spmd status``, ``panel``, ``where``, ``log``,
``debug``, ``census`` and ``interrupt``."""

from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.display import display

from spmd.magics.cells import census_report
from spmd.magics.cells.panel import Panel, panel_bundle
from spmd.magics.cells.report import stack_section
from spmd.magics.commands.say import say
from spmd.magics.start.arguments import _cell_parser, _log_parser
from spmd.magics.start.status import status_table
from spmd.words import rank_words


class Inspection:
    """SpmdMagics' inspection commands (a mixin: the state is SpmdMagics', see magics.py)."""

    def _cmd_status(self, args: list[str]) -> None:
        if args not in ([], ["all"]):
            raise UsageError("%spmd status takes no argument but all: %spmd status all lists "
                             "every rank (without it, more than 16 ranks are grouped).")
        session = self._require_session(allow_stopped=True)
        say(status_table(session, self.auto.on, every_rank=bool(args)))

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

    def _cmd_census(self, args: list[str]) -> None:
        session = self._require_session()
        if len(args) > 1 or (args and not args[0].isdigit()):
            raise UsageError("%spmd census takes at most one cell number: %spmd census 12 "
                             "lists the launches of In [12] (none: the last cell's).")
        kept = self.census_cells
        if not kept:
            say("No cell has run on the ranks yet: there is no launch to list.")
            return
        number = int(args[0]) if args else max(kept)
        if number not in kept:
            which = (f"In [{min(kept)}]" if len(kept) == 1 else
                     f"the last {len(kept)} that ran on them, In [{min(kept)}] to In "
                     f"[{max(kept)}]")
            raise UsageError(f"%spmd census {number}: In [{number}] is not one of the cells "
                             f"whose launches the ranks keep ({which}).")
        engine_ids = {r.rank: r.engine_id for r in session.ranks}
        try:
            records = session.census(engine_ids, kept[number], timeout=5.0)
        except KeyboardInterrupt:
            say(f"Interrupted: %spmd census stopped waiting for the ranks' launches of In "
                f"[{number}]; run it again to list them.")
            return
        if not records:
            say(f"No rank answered with In [{number}]'s launches: a restart since ends "
                "what they kept, and a rank busy in C code does not answer.")
            return
        if not any(rec["count"] for rec in records.values()):
            say(f"In [{number}] launched no cross-process program on any rank.")
            return
        lines = census_report.listing(records)
        said = census_report.explain(records, waiting=False)
        lines += ["", *said[1]] if said else ["", "Every rank launched the same."]
        say(f"In [{number}]:\n" + "\n".join(lines))

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
        session.collect_late()  # (what threads printed since the last cell: into the logs)
        # A flood's every line is in the log: by default only as many as a cell keeps.
        tail = opts.tail or session.settings.max_output
        text, lines = session.logs.read(opts.rank, tail)
        if not lines:
            say(f"Rank {opts.rank} has printed nothing since the cluster started.")
            return
        path = session.logs.path(opts.rank)
        if tail is not None and lines > tail:
            say(
                f"[rank {opts.rank}] the last {tail:,} of {lines:,} lines; all of them are in "
                f"{path} (%spmd log {opts.rank} --tail {lines} shows them here):"
            )
        else:
            say(f"[rank {opts.rank}] {lines:,} lines ({path}):")
        sys.stdout.write(text)

    def _cmd_debug(self, args: list[str]):
        """Post-mortem pdb on a rank's last exception (the lowest rank that failed in the last
        cell, by default), like IPython's %debug: nothing runs again."""
        session = self._require_session()
        if len(args) > 1 or (args and not (args[0].isascii() and args[0].isdigit())):
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
        run = session.gen.unfinished  # (a cell the notebook gave up on, some ranks still in it)
        display(panel_bundle(Panel(session).rows(run), live=True if run else None), raw=True)


# On the rank: pdb on its last exception (IPython keeps it in sys.last_traceback), or why not.
_POST_MORTEM = """\
import sys as _spmd_sys
if getattr(_spmd_sys, "last_traceback", None) is None:
    print("This rank has raised no exception yet: nothing to debug.")
else:
    get_ipython().run_line_magic("debug", "")
del _spmd_sys
"""
