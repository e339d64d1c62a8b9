"""The measured figures the hand-written pages quote, as MyST substitutions read from
benchmarks/results.json (which ``make bench`` writes) at each build: a page says
``{{ restart_spmd }}``, never a number copied by hand, so a new run cannot leave it stale.

The keys, derived mechanically from the figures' names in results.json (a substitution key
is letters, digits and underscores):

- a figure's median, as the benchmark table prints it (``benchmarks.table.median_text``:
  "1.15 s", "9.56 ms", "318 MB"): its name with every character other than a letter or a
  digit made ``_``. ``restart/spmd`` is ``restart_spmd``, ``start_to_ready/spmd_n64_none``
  is ``start_to_ready_spmd_n64_none``.
- a row of the table's ratios (``benchmarks.table.ratio_rows``: a figure over its anchor,
  median over median, as the table prints it) followed by ``×``: ``ratio__`` + the figure's
  key + ``__`` + the anchor's key. ``restart/spmd`` over ``start_to_ready/floor`` is
  ``ratio__restart_spmd__start_to_ready_floor``, "0.20×".

Two names that make one key raise ``Drift``. A page that uses a key results.json does not
define (a figure the last run did not measure, a name mistyped) fails the build: MyST warns
of an undefined substitution, and the build is ``-W``. A figure that no run of ``make bench``
measures stays in its page as written, saying where it came from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from spmd_docs.tables import Drift

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results.json"


def key(name: str) -> str:
    """A figure's substitution key: ``restart/spmd`` -> ``restart_spmd``."""
    return re.sub(r"[^A-Za-z0-9]", "_", name)


def ratio_key(figure: str, anchor: str) -> str:
    """A ratio's key: ``ratio__restart_spmd__start_to_ready_floor``."""
    return f"ratio__{key(figure)}__{key(anchor)}"


def substitutions(results: Path = RESULTS) -> dict[str, str]:
    """Every key, with the text it stands for, from ``results``."""
    from benchmarks.table import median_text, ratio_rows, ratio_text

    stats = json.loads(results.read_text())["figures"]
    out: dict[str, str] = {}
    made_by: dict[str, str] = {}

    def add(k: str, text: str, source: str) -> None:
        if k in out:
            raise Drift(f"benchmarks/results.json: {made_by[k]} and {source} both make the "
                        f"substitution key {k}: rename one figure.")
        out[k], made_by[k] = text, source

    for name, s in stats.items():
        add(key(name), median_text(name, s), name)
    for fig, anchor in ratio_rows(stats):
        add(ratio_key(fig, anchor), f"{ratio_text(fig, anchor, stats)}×", f"{fig} / {anchor}")
    return out


def used(text: str) -> list[str]:
    """The substitution keys a MyST page's text uses (``{{ key }}``)."""
    return re.findall(r"\{\{\s*([^\s}]+)\s*\}\}", text)


def _config_inited(app, config) -> None:
    from sphinx.errors import SphinxError

    class FiguresDrifted(SphinxError):
        category = "benchmarks/results.json cannot give the pages their figures"

    try:
        figures = substitutions()
    except Drift as exc:
        raise FiguresDrifted(str(exc)) from None
    own = dict(config.myst_substitutions or {})
    clash = sorted(set(own) & set(figures))
    if clash:
        raise FiguresDrifted(f"conf.py's myst_substitutions define {', '.join(clash)}, "
                             "which are figures from benchmarks/results.json")
    # (a changed value makes Sphinx read every page again: myst_substitutions rebuilds "env")
    config.myst_substitutions = {**own, **figures}


def setup(app):
    app.connect("config-inited", _config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
