"""The figures ``make bench`` recorded, summed up and shown: each figure's median and min-max,
the table of ratios to their anchors with the targets they meet or miss, the absolute detection
times, and what a run carries over from the one before for the parts it left out.

The docs read their figures through the same functions (docs/_ext/spmd_docs/benchmarks.py,
figures.py), so a page shows what the run printed. Plain functions of the samples and of
results.json: this module runs no benchmark and imports none of the parts.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import psutil

from benchmarks.bench import GRACE, Bench

RESULTS = Path(__file__).with_name("results.json")


def summarize(samples: dict[str, list[float]]) -> dict[str, dict]:
    return {
        name: {
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "runs": len(xs),
        }
        for name, xs in samples.items()
    }


TARGETS = [
    # (figure, anchor, target ratio or None, what the target says)
    ("start_to_ready/spmd", "start_to_ready/floor", 0.6, "≤ 0.6 × floor"),
    ("start_to_ready/spmd_n16_jax", "start_to_ready/floor_n16", 0.6, "≤ 0.6 × floor"),
    ("restart/spmd_n16_jax", "start_to_ready/floor_n16", 0.3, "≤ 0.3 × floor"),
    ("memory_pss_mb/cluster", "memory_pss_mb/ranks", 1.45, "≤ 1.45 × the ranks' own"),
    ("start_to_ready/spmd", "start_to_ready/ipyparallel", None, ""),
    ("stop/spmd", "stop/ipyparallel", None, "≤ 1 s"),
    ("restart/spmd", "start_to_ready/floor", 0.3, "≤ 0.3 × floor"),
    ("restart/spmd", "restart/ipyparallel", None, ""),
    ("jit_cell_after_restart/spmd", "jit_cell_first/spmd", 0.3, "≤ 0.3 × first run"),
    ("cell_n4/spmd_panel", "cell_n4/spmd", None, ""),
    ("sleep_1s_cell/spmd_panel", "sleep_1s_cell/spmd", 1.02, "≤ 1.02 × without the panel"),
    ("flood_1M_lines/spmd", "flood_1M_lines/plain_kernel", None, ""),
    ("cell_n2/spmd", "cell_n2/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n4/spmd", "cell_n4/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n8/spmd", "cell_n8/px", 1.0, "≤ 1.0 × %px"),
    ("cell_n4/spmd", "cell_n4/zmq", None, ""),
    ("debugger_cell_n4/attached", "debugger_cell_n4/detached", 1.2, "≤ 1.2 × detached"),
    ("debugger_cell_n4/attached", "debugger_cell_n4/never_attached", None, ""),
    # JupyterLab's debugger through one Jupyter Server, beside jupyter-distributed 0.1.1's
    # (benchmarks/debugger_server.py; its rows only where the peer is installed)
    *((f"debugger_server_n4/{fig}_spmd", f"debugger_server_n4/{fig}_peer", 0.8,
       "≤ 0.8 × jupyter-distributed")
      for fig in ("setup", "execute_to_stopped", "continue_to_reply")),
    ("census_jit_1000/on", "census_jit_1000/off", 1.03, "≤ 1.03 × without the census"),
    ("cell_n64/none", "cell_n4/none", 6.0, "≤ 6 × 4 ranks"),
    ("cell_n64/none", "cell_n64/ranks_cpu_over_cores", None, ""),
    ("cell_n64/none", "cell_n64/px", 1.0, "≤ 1.0 × %px"),
    ("census_jit_1000/empty", "census_jit_1000/off", None, ""),
    ("census_torch_all_reduce_1000/on", "census_torch_all_reduce_1000/off", None, ""),
    ("census_torch_all_reduce_1000/checked", "census_torch_all_reduce_1000/off", None, ""),
    ("value_cell/global_8x4", "value_cell/none", None, ""),
    ("value_cell/global_8192sq", "value_cell/none", None, ""),
    ("value_cell/dtensor_8x4", "value_cell/dtensor_none", None, ""),
    ("value_cell/dtensor_2048sq", "value_cell/dtensor_none", None, ""),
    ("output/spmd", "output/px", 1.0, "≤ 1.0 × %px"),
    ("print_loop_1000/global_same", "print_loop_1000/local", None, ""),
    ("print_loop_1000/global_new", "print_loop_1000/local_new", None, ""),
    ("print_loop_1000/held_same", "print_loop_1000/local", None, ""),
    ("print_loop_1000/display_global", "print_loop_1000/display_local", None, ""),
    ("print_loop_1000/dtensor", "print_loop_1000/tensor", None, ""),
    ("restart_after_fault/spmd", "start_to_ready/spmd", 1.5, "≤ 1.5 × a fresh start"),
    ("first_result/kernel", "first_result/magic", 1.0, "≤ 1.0 × the magic"),
    ("first_result/kernel", "start_to_ready/floor", 0.8, "≤ 0.8 × floor"),
    ("start_to_ready/ssh", "start_to_ready/spmd", 1.2, "≤ 1.2 × local"),
    ("restart/ssh", "start_to_ready/ssh", 0.3, "≤ 0.3 × an ssh start"),
    ("stop/ssh", "stop/spmd", None, ""),
    ("start_to_ready/mpi", "start_to_ready/spmd", None, ""),
    ("start_to_ready/torch", "start_to_ready/torch_floor", 0.6, "≤ 0.6 × floor"),
    ("stop/torch", "stop/spmd", None, ""),
    ("stop/mpi", "stop/spmd", None, ""),
    ("attach_to_first_result/spmd_n4", "attach_to_first_result/fresh_start_n4", None,
     "< 1 s"),
    ("attach_to_first_result/spmd_n4", "attach_to_first_result/cell_alone_n4", None, ""),
    ("attach_to_first_result/spmd_n64", "attach_to_first_result/fresh_start_n64", None, ""),
    ("attach_to_first_result/spmd_n64", "attach_to_first_result/cell_alone_n64", None, ""),
]

# Detection times: absolute, from the fault to the failed cell in the notebook. Plain
# ipyparallel has no figure here: its cells wait for ever.
DETECTION = [
    ("divergence_report/spmd", GRACE + 2.0, "≤ grace (2 s) + 2 s"),
    ("divergence_report_beyond_grace/spmd", 2.0, "≤ 2 s"),
    ("death_report_rank0/spmd", 2.0, "≤ 2 s"),
    ("death_report_rank3/spmd", 2.0, "≤ 2 s"),
    ("debugger_stop_n4/execute_to_stopped", 1.0, "≤ 1 s"),
    ("start_to_ready/spmd_n64_none", 5.0, "≤ 5 s"),
    ("restart/spmd_n64_none", 2.0, "≤ 2 s"),
    ("restart/spmd_n64_none_forked", 2.0, "≤ 2 s"),
    ("start_and_cell/spmd_n128_none", 10.0, "≤ 10 s"),
    ("start_and_cell/spmd_n256_none", None, "runs"),
    ("cpu_per_cell_and_rank_n64/notebook", 0.00025, "≤ 0.25 ms"),
    ("cpu_per_cell_and_rank_n64/controller", 0.00025, "≤ 0.25 ms"),
    ("cpu_per_cell_and_rank_n64/ranks", None, ""),
]


# The table's rows that compare memory: their figures are shown to 3 digits, without min-max,
# and their ratio to 3 places.
MEMORY = [("flood_memory_mb/spmd", "flood_memory_mb/plain_kernel"),
          ("flood_saved_mb/spmd", "flood_saved_mb/plain_kernel")]


def median_text(name: str, s: dict) -> str:
    """A figure's median as the table shows it: "1.15 s", "9.56 ms", "318 MB"."""
    m = s["median"]
    if name.startswith(("flood_memory_mb/", "flood_saved_mb/")):
        return f"{m:.3g} MB"
    if name.startswith("rss_growth"):
        return f"{m:.1f} MB"
    if "_mb/" in name:
        return f"{m:.0f} MB"
    unit, k = ("ms", 1000) if m < 0.5 else ("s", 1)
    return f"{m * k:.3g} {unit}"


def figure_text(name: str, s: dict) -> str:
    """A figure as the table's columns of figures show it: the median and (min-max)."""
    if "_mb/" in name:
        said = f"{median_text(name, s)} ({s['min']:.0f}-{s['max']:.0f})"
    else:
        k = 1000 if s["median"] < 0.5 else 1
        said = f"{median_text(name, s)} ({s['min'] * k:.3g}-{s['max'] * k:.3g})"
    # (a part this run left out: the earlier run's figure, carry_over)
    return said + (f", from the run of {s['carried_over']}" if s.get("carried_over") else "")


def ratio_text(fig: str, anchor: str, stats: dict[str, dict]) -> str:
    """The table's ratio of ``fig``'s median to ``anchor``'s: "0.44"."""
    ratio = stats[fig]["median"] / stats[anchor]["median"]
    return f"{ratio:.3f}" if (fig, anchor) in MEMORY else f"{ratio:.2f}"


def ratio_rows(stats: dict[str, dict]) -> list[tuple[str, str]]:
    """The (figure, anchor) of every row of the table that has a ratio, in its order."""
    pairs = [(fig, anchor) for fig, anchor, *_ in TARGETS] + MEMORY
    return [(fig, anchor) for fig, anchor in pairs if fig in stats and anchor in stats]


def table(stats: dict[str, dict]) -> str:
    def fmt(name: str) -> str:
        return figure_text(name, stats[name])

    rows = [("figure", "median (min-max)", "anchor", "anchor median", "ratio", "target")]
    for fig, anchor, limit, says in TARGETS:
        if fig not in stats or anchor not in stats:
            continue
        ratio = stats[fig]["median"] / stats[anchor]["median"]
        if fig == "stop/spmd":
            verdict = "met" if stats[fig]["median"] <= 1.0 else "missed"
        elif limit is not None:
            verdict = "met" if ratio <= limit else "missed"
        else:
            verdict = ""
        rows.append((fig, fmt(fig), anchor, fmt(anchor), ratio_text(fig, anchor, stats),
                     f"{says} {verdict}".strip()))
    for name, limit, says in DETECTION:
        if name in stats:
            verdict = "" if limit is None else (
                "met" if stats[name]["median"] <= limit else "missed")
            rows.append((name, fmt(name), "", "", "", f"{says} {verdict}".strip()))
    for ours, plain in MEMORY:
        if ours in stats and plain in stats:
            rows.append((ours, median_text(ours, stats[ours]), plain,
                         median_text(plain, stats[plain]), ratio_text(ours, plain, stats), ""))
    for name in stats:
        if name.startswith("rss_growth"):
            mb = stats[name]["median"]
            rows.append((name, median_text(name, stats[name]), "", "", "",
                         f"< 20 MB {'met' if mb < 20 else 'missed'}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def carry_over(figures: dict[str, dict], left_out_ranks: set[int], previous: Path) -> list[str]:
    """Add to ``figures`` the earlier run's (``previous``, the results.json it wrote) of the
    parts this run left out for want of room (those of ``left_out_ranks`` ranks: ``_n64`` in
    their names), each marked ``carried_over`` with that run's date, so that the pages that
    quote them still build; their names."""
    try:
        earlier = json.loads(previous.read_text())
        date = earlier.get("date") or time.strftime(
            "%Y-%m-%d", time.localtime(previous.stat().st_mtime))
        old = dict(earlier["figures"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    names = re.compile("|".join(rf"_n{n}(?![0-9])" for n in sorted(left_out_ranks)) or "(?!)")
    carried = []
    for name, s in old.items():
        if name not in figures and names.search(name) and isinstance(s, dict):
            figures[name] = {**s, "carried_over": s.get("carried_over") or date}
            carried.append(name)
    return carried


def machine() -> str:
    return f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, {sys.platform}"


def summary(bench: Bench) -> str:
    """What ``make bench`` prints at its end: the table, the facts, and the parts this machine
    had no room for, each with why."""
    lines = [f"\njupyter-spmd benchmarks on {machine()}; ratios from one run\n",
             table(summarize(bench.samples))]
    lines += [f"{name}: {value}" for name, value in bench.facts.items()]
    if bench.left_out:
        lines += ["", f"Left out ({len(bench.left_out)}): this machine had no room for them "
                  "when their turn came."]
        lines += [f"- {what}: {why}" for what, why in bench.left_out.items()]
    return "\n".join(lines)
