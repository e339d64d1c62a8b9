"""reference/magics: every ``%spmd`` command and option, from the magics' own code.

The commands are the table the magic dispatches from (``spmd.magics.magics._COMMANDS``, the
list an unknown command is answered with); each option's name, choices and default come from
the command's argparse parser (``spmd/magics/start/arguments.py``, ``export/script.py``). What the parsers
do not carry, a sentence for each command and option, is written here, and checked against
them both ways (tables.Drift): a command or option added to the code without its sentence
fails the docs build, and so does a sentence left behind by one removed.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass, field

from spmd_docs.tables import Drift, Said, option_rows, options, usage


@dataclass(frozen=True)
class Command:
    """One ``%spmd`` command: its sentence, and its usage where no parser gives one."""

    text: str
    usage: str = ""  # '' where the command's parser writes it
    options: dict[str, Said] = field(default_factory=dict)


def _start_options() -> dict[str, Said]:
    from spmd.cluster import linger
    from spmd.cluster.session import Settings
    from spmd.options import BACKENDS

    return {
        "--processes": Said(
            "N", "How many ranks (engine processes) to start. Required, but inside a Slurm "
            "allocation with `--launcher slurm`, where it is the allocation's task count."),
        "--devices-per-process": Said(
            "K", "CPU devices each rank has (jax's `jax_num_cpu_devices`); without it, jax's "
            "default."),
        "--backend": Said(
            "|".join(BACKENDS), "What every rank initializes: jax "
            "(`jax.distributed.initialize`), torch (`torch.distributed.init_process_group`), "
            "both (each on its own port), or nothing."),
        "--torch-backend": Said(
            "", "torch.distributed's backend, for `--backend torch` (`mpi` needs "
            "`--launcher mpi`).", default=f"`{Settings.torch_backend}`"),
        "--init-method": Said(
            "tcp|env|file|file:///PATH", "How torch's ranks find each other: `tcp` (rank 0's "
            "address and a free port), `env` (`MASTER_ADDR` and `MASTER_PORT` in each rank's "
            "environment, as torchrun sets them), `file` (a file in the cluster's folder, on "
            "this machine) or `file:///PATH` (a file on a file system every host shares).",
            default=f"`{Settings.init_method}`"),
        "--check-collectives": Said(
            "", "torch's own check of each collective (`TORCH_DISTRIBUTED_DEBUG=DETAIL`): a "
            "collective whose op or sizes differ between ranks raises on every rank. For "
            "`--backend torch`; it costs several times a collective's time."),
        "--timeout": Said(
            "S", "Seconds a cell may run; then it fails with the report of where each rank "
            "was. Default: no limit."),
        "--grace": Said(
            "S|off", "Seconds after one rank finished a cell before the watchdog looks at the "
            "ranks still running it, and then between its looks: one that launched a "
            "cross-process program the finished ranks never did has diverged, and the cell "
            "fails with the report of which ranks raised and where the others wait, as does "
            "one that stays 3 s more inside one call of jax or torch; one only slower (in its "
            "own Python code, or compiling) is waited for. `off` (or 0) turns this watchdog "
            "off."),
        "--start-timeout": Said("S", "Seconds the ranks may take to start and join."),
        "--hosts": Said(
            "H1,H2|H1:2,H2:6", "The hosts the ranks run on, filled in order (`H1:2`: two ranks "
            "on H1). Alone, the ranks start over ssh."),
        "--launcher": Said(
            "", "How the ranks start: `local` (this machine), `ssh` (on `--hosts`), `mpi` "
            "(MPICH's mpiexec) or `slurm` (one sbatch job; inside an allocation, an srun step "
            "of it). Default: local, or ssh with `--hosts`."),
        "--launcher-arg": Said(
            "KEY=VALUE", "A setting of the launcher, repeatable: with slurm, `time=10` "
            "becomes `#SBATCH --time=10`."),
        "--python": Said(
            "PATH", "The ranks' Python (on the hosts, or here for local and mpi). Default: "
            "the notebook's."),
        "--gpus-per-process": Said(
            "K", "GPUs each rank gets (`CUDA_VISIBLE_DEVICES`); 0 hides them. Default: an "
            "equal share of each host's GPUs."),
        "--no-curve": Said(
            "", "No CurveZMQ encryption where ranks run on other machines (a warning says so; "
            "messages stay signed)."),
        "--compilation-cache": Said(
            "DIR", "jax's persistent compilation cache in this folder (made if missing, and "
            "kept). Default: a folder of the cluster's own, kept across restarts and emptied "
            "at stop."),
        "--preload": Said(
            "M1,M2", "Modules the rank server imports once for every rank, besides the engine "
            "and the backend (ranks on this machine or over ssh, with the rank server on)."),
        "--rank-server": Said(
            "", "`on`: one rank server per host imports once and forks the ranks, so a restart "
            "takes under a second; `off`: a Python per rank, each with its own string-hash "
            "salt, as a job's processes."),
        "--max-output": Said(
            "N|all", "Lines of one rank a cell keeps in the notebook (its first and last); "
            "`%spmd log RANK` has them all."),
        "--panel": Said("", "The live panel in every cell: the ranks' rows while it runs."),
        "--tabs": Said("", "Outputs that differ per rank as tabs, one per group of ranks "
                           "alike."),
        "--breakpoint": Said(
            "", "Which ranks stop at `breakpoint()`: `lowest`, the first to reach one (of "
            "those that reach it within 50 ms, the lowest), or `all`."),
        "--linger": Said(
            "DURATION", "How long the ranks outlive a notebook process that died without "
            "stopping them, for `%spmd attach` (`10m`, `30s`, `1h`; `0`: none). mpiexec's and "
            "srun's ranks end with their notebook.",
            default=f"`{linger.words(linger.DEFAULT_LINGER)}`"),
    }


def _cell_options() -> dict[str, Said]:
    this_cell = "For this cell; default: the start's."
    return {
        "--ranks": Said("0,2", "Run the cell on these ranks only."),
        "--timeout": Said("S", f"Seconds the cell may run. {this_cell}"),
        "--grace": Said("S|off", f"The watchdog's grace, in seconds. {this_cell}"),
        "--max-output": Said("N|all", f"Lines of one rank kept in the notebook. {this_cell}"),
        "--tabs": Said("", f"Outputs that differ per rank as tabs. {this_cell}"),
        "--panel": Said("", f"The live panel. {this_cell}"),
        "--breakpoint": Said("", f"Which ranks stop at `breakpoint()`. {this_cell}"),
    }


def commands() -> dict[str, Command]:
    """A sentence (and a usage, where no parser writes one) for every ``%spmd`` command."""
    from spmd.engine.watch.launches import KEPT_CELLS
    from spmd.magics.arrays.transfers import DEFAULT_MAX_BYTES

    return {
        "start": Command(
            "Starts N ranks, joins them into one distributed job and turns auto mode on: "
            "from then on every cell runs on every rank, in lockstep.",
            options=_start_options()),
        "stop": Command(
            "Ends every rank, the controller and the processes cells started on the ranks; "
            "auto mode goes off (in the SPMD kernel, cells are refused until `%spmd restart`).",
            usage="%spmd stop"),
        "restart": Command(
            "Starts the ranks again with the same settings: the rank server forks new ones, "
            "in under a second, and jax's compilation cache is kept.",
            usage="%spmd restart"),
        "attach": Command(
            "Takes back a cluster that outlived its notebook's process (`--linger`): the same "
            "ranks with what they hold, auto mode on. Without an id, the cluster this "
            "notebook left, else the only one lingering; `python -m spmd list` shows them.",
            usage="%spmd attach [ID]"),
        "status": Command(
            "A row per rank: host, pid, state, devices, the last cell's time; beyond 16 ranks "
            "a row per group of ranks alike (`all`: a row per rank).",
            usage="%spmd status [all]"),
        "panel": Command(
            "The ranks' rows now; `on`: a live panel in every cell, `off`: none.",
            usage="%spmd panel [on|off]"),
        "log": Command(
            "Every line a rank printed since the start (a cell keeps `--max-output` lines of "
            "each rank in the notebook).",
            options={
                "rank": Said("RANK", "The rank's number."),
                "--tail": Said("N", "The last N lines. Default: as many as a cell keeps."),
            }),
        "debug": Command(
            "Post-mortem pdb on a rank's last exception, like IPython's `%debug` (by default "
            "the lowest rank that failed in the last cell); nothing runs again. Its prompt is "
            "in the notebook, labelled by rank.",
            usage="%spmd debug [RANK]"),
        "interrupt": Command(
            "SIGINT to every rank still running a cell; says which ranks did not respond "
            "(`%spmd restart` ends them).",
            usage="%spmd interrupt"),
        "where": Command("The Python stack of every rank still running a cell.",
                         usage="%spmd where"),
        "census": Command(
            "Each group of ranks' cross-process launches (jitted calls over several "
            "processes, torch collectives) in the last cell, or in `In [N]`, and where the "
            f"groups part. The ranks keep the last {KEPT_CELLS} cells' launches.",
            usage="%spmd census [N]"),
        "sharding": Command(
            "One picture of a jax.Array or torch DTensor over the whole cluster: which "
            "process and device holds each block.",
            usage="%spmd sharding EXPR"),
        "gather": Command(
            "The global value of a jax.Array or DTensor as numpy in the notebook; anything "
            "else (a plain value, a torch tensor, an array each process made on its own) as "
            f"a list by rank. `-o NAME` stores it in a notebook variable instead of showing "
            f"it; `--max-bytes N` (default {DEFAULT_MAX_BYTES // 2**20} MB) refuses more.",
            usage="%spmd gather EXPR [-o NAME] [--max-bytes N]"),
        "push": Command("Sends notebook variables to every rank.",
                        usage="%spmd push NAME [NAME ...]"),
        "export": Command(
            "Writes the cells the ranks ran, in the order they ran them since the start or "
            "the last restart, as a plain-Python script with the start-up `%spmd start` did "
            "in every rank, and beside it the launch that runs it as a job.",
            options={
                "path": Said("PATH.py", "The script to write; the launch goes beside it "
                                        "(`PATH.sh`, or `PATH.sbatch` for slurm)."),
                "--launcher": Said("", "Which launcher the job uses. Default: the cluster's."),
                "--cells": Said("", "`ok`: a cell that failed on any rank is left out, with "
                                    "a comment that says so; `all`: kept."),
                "--raw-output": Said("", "The job's lines as the processes wrote them, "
                                         "without the `[rank N] ` in front."),
            }),
        "on": Command("Auto mode on: every cell runs on all ranks (`%%local` for one in the "
                      "notebook).", usage="%spmd on"),
        "off": Command("Auto mode off: cells run in the notebook, `%%spmd` runs one on the "
                       "ranks. Refused in the SPMD kernel, where every cell runs on the ranks.",
                       usage="%spmd off"),
    }


def _parsers() -> dict[str, object]:
    """The argparse parser of each command that has one."""
    from spmd.magics.export import script as export
    from spmd.magics.start.arguments import _log_parser, _start_parser

    return {"start": _start_parser(), "log": _log_parser(), "export": export._parser()}


def command_names() -> list[str]:
    """The commands, as the magic dispatches them (and lists them to a typo)."""
    from spmd.magics.magics import _COMMANDS

    return list(_COMMANDS)


def page() -> str:
    """The page's MyST text; Drift where the sentences and the code disagree."""
    from spmd.magics.magics import SpmdMagics
    from spmd.magics.start.arguments import _cell_parser

    said = commands()
    names = command_names()
    missing = [n for n in names if n not in said]
    stale = [n for n in said if n not in names]
    if missing or stale:
        raise Drift(
            "docs/_ext/spmd_docs/magics.py and spmd.magics.magics._COMMANDS disagree: "
            + "; ".join(filter(None, [
                missing and f"{', '.join(missing)} has no sentence here (add one)",
                stale and f"{', '.join(stale)} is no command any more (remove it)",
            ])) + ".")
    parsers = _parsers()
    out = [
        "# `%spmd` magics",
        "",
        "Every command and option of the magics, generated when this site is built from the "
        "magics' own code: the commands from the table `%spmd` dispatches from, each "
        "option's name, values and default from the command's parser. `%load_ext spmd` "
        "loads them into any IPython kernel; in the SPMD kernel they are there already.",
        "",
    ]
    for command in names:
        entry = said[command]
        out += [f"(spmd-{command})=", f"## `%spmd {command}`", "", entry.text, ""]
        parser = parsers.get(command)
        if parser is not None:
            where = f"docs/_ext/spmd_docs/magics.py (the {command!r} command's options)"
            rows = option_rows(parser, entry.options, where)
            required = ("--processes", "path", "rank")
            out += ["```text", usage(f"%spmd {command}", parser, entry.options, required),
                    "```", "", options(rows),
                    ""]
        else:
            out += ["```text", entry.usage, "```", ""]
    cell = _cell_parser()
    out += [
        "(spmd-cell)=",
        "## `%%spmd`",
        "",
        "Runs one cell on the ranks, also with auto mode off.",
        "",
        "```text",
        usage("%%spmd", cell, _cell_options()),
        "```",
        "",
        options(option_rows(cell, _cell_options(), "docs/_ext/spmd_docs/magics.py (%%spmd)")),
        "",
        "(spmd-local)=",
        "## `%%local`",
        "",
        *_described(SpmdMagics.local.__doc__),
        "(spmd-help)=",
        "## What `%spmd?` shows",
        "",
        "The magic's docstring, as IPython shows it:",
        "",
        "````text",
        inspect.cleandoc(SpmdMagics.spmd.__doc__),
        "````",
        "",
    ]
    return "\n".join(out)


def _described(doc: str | None) -> list[str]:
    """A magic's docstring as MyST: its first paragraph, then its ``Example::`` block."""
    text = inspect.cleandoc(doc or "")
    first = text.split("\n\n")[0].replace("\n", " ")
    _, found, example = text.partition("Example::")
    shown = ["```python", textwrap.dedent(example).strip("\n"), "```", ""] if found else []
    return [first, "", *shown]
