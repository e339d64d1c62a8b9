"""development/benchmarks: the table ``make bench`` printed, from benchmarks/results.json.

The table is ``benchmarks.table.table`` itself, so the page shows what the run printed. What
each figure measures is said here, once per family of figures (the part of a name before
its ``/``); a family in results.json without its sentence fails the build (tables.Drift), so
a new benchmark comes with its meaning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from spmd_docs.tables import Drift

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results.json"

# (a family's name, as a pattern; what its figures measure)
FAMILIES = [
    (r"start_to_ready", "From `%spmd start` until a first psum (torch: an `all_reduce`) has "
     "returned on every rank. `floor`: as many bare processes doing import jax + "
     "`jax.distributed.initialize` + psum; `ipyparallel`: plain ipyparallel doing the same. "
     "`_n16_jax`: 16 ranks; `_n64_none`: 64 ranks with `--backend none`, until a trivial "
     "cell returns; `ssh`: 4 ranks over ssh into two hosts (network namespaces on this "
     "machine); `mpi`: through MPICH's mpiexec."),
    (r"restart", "`%spmd restart` until a psum returns: the old ranks end and the rank server "
     "forks new ones (`_forked`: the fork alone)."),
    (r"stop", "`%spmd stop` until every process it started has ended."),
    (r"restart_after_fault", "The restarts after a divergence and after two deaths."),
    (r"memory_pss_mb", "Right after a 4-rank start (`-d 2`) and a psum, the proportional set "
     "size (shared pages split between the processes sharing them) of the ranks, and of "
     "every process the cluster holds (controller, rank server, ranks)."),
    (r"jit_cell_(first|after_restart)", "A jitted function of 40 steps across all 8 devices "
     "of the 4 processes, run first, then again after a restart, read from the compilation "
     "cache the ranks share."),
    (r"cell_n\d+", "A trivial cell on N ranks, against `%px` on the same engines and a bare "
     "zmq round trip; `spmd_panel` with the live panel on; `none`: `--backend none`; "
     "`ranks_cpu_over_cores`: the ranks' own CPU per cell over the machine's cores."),
    (r"cpu_per_cell_and_rank_n\d+", "CPU time a trivial cell costs per rank, in the "
     "notebook, the controller and the ranks themselves."),
    (r"start_and_cell", "A start of N ranks (`--backend none`) until a first cell has run."),
    (r"sleep_1s_cell", "A cell that sleeps one second on 4 ranks, with the live panel updating "
     "4 times a second, and without it."),
    (r"flood_1M_lines", "A notebook, run by nbclient, whose cell prints 1,000,000 lines on each "
     "of 2 ranks (`--max-output` at its default), beside the same loop in a plain Python "
     "kernel: the cell's time."),
    (r"flood_memory_mb", "The same flood: what the notebook's own process grew by."),
    (r"flood_saved_mb", "The same flood: the size of the saved notebook (the ranks' logs "
     "keep every line)."),
    (r"output", "10,000 lines from each of 4 ranks (`--max-output all`, as `%px` keeps every "
     "line), against `%%px`."),
    (r"rss_growth_\d+_cells_mb", "What the notebook's process grew by over that many cells."),
    (r"first_result", "Launching the SPMD kernel until its first cell (a psum) has returned, "
     "against a plain Python kernel running `%load_ext spmd`, `%spmd start -n 4 -d 2` and "
     "that cell."),
    (r"attach_to_first_result", "`%spmd attach` to a lingering cluster until a cell has "
     "returned, against a fresh start and against the cell alone."),
    (r"divergence_report(_beyond_grace)?", "From a divergence (ranks that part ways) to the "
     "failed cell in the notebook; plain ipyparallel waits for ever. The report comes after "
     "the grace (2 s by default); `_beyond_grace` from the end of the grace."),
    (r"death_report_rank\d+", "From a rank's death (SIGKILL) to the failed cell in the "
     "notebook."),
    (r"debugger_cell_n\d+", "JupyterLab's debugger on 4 ranks: a trivial cell with the "
     "debugger attached and no breakpoint, detached, and before it was ever turned on."),
    (r"debugger_stop_n\d+", "From a cell's execute_request to its breakpoint's `stopped` "
     "event."),
    (r"debugger_server_n\d+", "JupyterLab's debugger on 4 ranks driven through one Jupyter "
     "Server, as JupyterLab drives it, beside jupyter-distributed 0.1.1 (a python3 kernel its "
     "server extension runs as 4 processes) in alternating rounds: `setup` (initialize, attach, "
     "debugInfo, configurationDone), `execute_to_stopped` (a cell to its breakpoint's first "
     "`stopped` event), `continue_to_reply` (every rank stopped: `continue` to the cell's "
     "reply). The peer's rows only where it is installed (`.venv-peer`, which `make bench` "
     "makes)."),
    (r"census_.*", "The census of cross-process launches: 1,000 launches through its wrapper "
     "(`on`), through jax's or torch's own call (`off`), through an empty wrapper (`empty`), "
     "and with torch's own check (`checked`); the cost per cell and per launch."),
    (r"value_cell", "A cell whose value is one global array (`global_8x4`, an 8192 x 8192 "
     "`global_8192sq`, torch DTensors), against the same cell ending in `None`."),
    (r"print_loop_\d+", "1,000 `print(x)` of a global array in a loop, against the same loop "
     "printing an array each process holds whole (`_new`: a new array each step; "
     "`display_`: `display(x)` instead; `dtensor`: a torch DTensor, against a tensor each "
     "process holds)."),
]


def _family(figure: str) -> str:
    return figure.split("/", 1)[0]


def meaning(family: str) -> str | None:
    for pattern, text in FAMILIES:
        if re.fullmatch(pattern, family):
            return text
    return None


def page(results: Path = RESULTS) -> str:
    from benchmarks.table import table

    data = json.loads(results.read_text())
    figures = data["figures"]
    families = list(dict.fromkeys(_family(f) for f in figures))
    unsaid = [f for f in families if meaning(f) is None]
    if unsaid:
        raise Drift(f"benchmarks/results.json has figures of {', '.join(unsaid)}, which "
                    "docs/_ext/spmd_docs/benchmarks.py (FAMILIES) does not explain: add a "
                    "sentence for each.")
    run = (f"{data['rounds']} round{'s' if data['rounds'] != 1 else ''}"
           f"{', the --quick subset' if data.get('quick') else ''}, {data['seconds']:.0f} s")
    out = [
        "---",
        "html_theme.sidebar_secondary.remove: true",  # (the table needs the width)
        "---",
        "",
        "# Benchmarks",
        "",
        "`make bench` (about 6 minutes; `make bench ARGS=--quick` for a one-minute subset) "
        "measures start, stop, restart, per-cell overhead, output floods, memory and how soon "
        "a fault is reported, each beside an anchor: the bare floor (plain processes doing the "
        "same jax work), plain ipyparallel (`%px`), or a plain kernel, alternated within one "
        "run. It writes every figure, with its min and max, to `benchmarks/results.json`; "
        "this page is generated from that file when the site is built, with the table the "
        "run printed.",
        "",
        f"The last run: {data['machine']}, {run}. Absolute times drift on a shared machine; "
        "read the ratios, which come from one run. A target is met or missed by the median.",
        "",
        "```{table} The figures, each beside its anchor",
        ":widths: auto",
        ":class: spmd-figures",
        "",
        table(figures),
        "```",
        "",
    ]
    facts = data.get("facts") or {}
    if facts:
        out += ["What the run saw, besides times:", ""]
        out += [f"- {name}: {value}" for name, value in facts.items()]
        out += [""]
    out += ["## What each figure measures", ""]
    for family in families:
        names = ", ".join(f"`{f}`" for f in figures if _family(f) == family)
        out += [f"`{family}`", f": {meaning(family)} ({names})", ""]
    return "\n".join(out)
