"""The measured figures the hand-written pages quote, checked against benchmarks/results.json
(which ``make bench`` writes) at each build.

A page writes a figure as plain text between two HTML comments that name it:
``<!--fig:restart_spmd-->0.653 s<!--/fig-->``.

Why this form: the pages are read in two places, the built site and a repository host that
shows their Markdown as it is (the README links to them). A MyST substitution
(``{{ restart_spmd }}``, the form before) is filled by the build alone and shows as raw braces
on the host; an HTML comment is hidden there, so the sentence reads "0.653 s" in both. A
figure the build only replaced would leave the host showing whatever figure the page was
written with, so the written figure is checked too: at each build (``source-read``) every
marked figure is compared with results.json's, and one that differs is a warning, so a failed
build (``-W``), naming the page, the line and the command that writes the figures in. So is a
key results.json does not define (a figure the last run did not measure, a key mistyped), a
marker not closed on its own line, and a marker that starts its line (a host takes a line that
starts with ``<!--`` for a block of HTML, not Markdown). The site shows results.json's figure,
without the comments, whatever the page says: a build without ``-W`` prints no stale figure
either. ``make bench`` writes its figures into the pages after its run
(``PYTHONPATH=docs/_ext python -m spmd_docs.figures``: ``rewrite``), so a new run changes them
everywhere, in the same change as results.json. A marker inside a code span is the form shown,
not a figure (docs/development/tests.md shows it).

The keys, derived mechanically from the figures' names in results.json (letters, digits and
underscores):

- a figure's median, as the benchmark table prints it (``benchmarks.table.median_text``:
  "1.15 s", "9.56 ms", "318 MB"): its name with every character other than a letter or a
  digit made ``_``. ``restart/spmd`` is ``restart_spmd``, ``start_to_ready/spmd_n64_none``
  is ``start_to_ready_spmd_n64_none``.
- a row of the table's ratios (``benchmarks.table.ratio_rows``: a figure over its anchor,
  median over median, as the table prints it) followed by ``×``: ``ratio__`` + the figure's
  key + ``__`` + the anchor's key. ``restart/spmd`` over ``start_to_ready/floor`` is
  ``ratio__restart_spmd__start_to_ready_floor``, "0.19×".

Two names that make one key raise ``Drift``. A figure that no run of ``make bench`` measures
is written without the comments, saying where it came from.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from spmd_docs.tables import Drift

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results.json"

# <!--fig:KEY-->FIGURE<!--/fig-->, on one line
MARKED = re.compile(r"<!--\s*fig:(\w+)\s*-->([^<>`\n]*)<!--\s*/fig\s*-->")
OPENED = re.compile(r"<!--\s*fig:")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)")


def _marks(pattern: re.Pattern, text: str) -> list[re.Match]:
    """``pattern``'s matches in ``text`` outside its code spans."""
    code = [m.span() for m in CODE_SPAN.finditer(text)]
    return [m for m in pattern.finditer(text)
            if not any(start <= m.start() < end for start, end in code)]


def key(name: str) -> str:
    """A figure's key: ``restart/spmd`` -> ``restart_spmd``."""
    return re.sub(r"[^A-Za-z0-9]", "_", name)


def ratio_key(figure: str, anchor: str) -> str:
    """A ratio's key: ``ratio__restart_spmd__start_to_ready_floor``."""
    return f"ratio__{key(figure)}__{key(anchor)}"


def values(results: Path = RESULTS) -> dict[str, str]:
    """Every key, with the text of its figure, from ``results``."""
    from benchmarks.table import median_text, ratio_rows, ratio_text

    stats = json.loads(results.read_text())["figures"]
    out: dict[str, str] = {}
    made_by: dict[str, str] = {}

    def add(k: str, text: str, source: str) -> None:
        if k in out:
            raise Drift(f"benchmarks/results.json: {made_by[k]} and {source} both make the "
                        f"figure key {k}: rename one figure.")
        out[k], made_by[k] = text, source

    for name, s in stats.items():
        add(key(name), median_text(name, s), name)
    for fig, anchor in ratio_rows(stats):
        add(ratio_key(fig, anchor), f"{ratio_text(fig, anchor, stats)}×", f"{fig} / {anchor}")
    return out


def used(text: str) -> list[tuple[str, str]]:
    """The figures a page's text quotes: (key, the figure as written), in order."""
    return [(m.group(1), m.group(2)) for m in _marks(MARKED, text)]


def problems(text: str, known: dict[str, str]) -> list[tuple[int, str]]:
    """What is wrong with the figures of a page's ``text``: (line, sentence) each."""
    found = []
    for m in _marks(MARKED, text):
        k, written = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if not text[text.rfind("\n", 0, m.start()) + 1:m.start()].strip():
            found.append((line, f"the figure {k} starts its line, which a repository host "
                                "then shows as HTML, not Markdown: start the line with a word "
                                "of the sentence"))
        if k not in known:
            found.append((line, f"the figure {k} is not in benchmarks/results.json (a figure "
                                "the last `make bench` did not measure, or a key mistyped)"))
        elif written != known[k]:
            found.append((line, f"the figure {k} is written {written!r}, and "
                                f"benchmarks/results.json has {known[k]!r}: `PYTHONPATH="
                                "docs/_ext python -m spmd_docs.figures` writes its figures "
                                "into the pages"))
    for m in _marks(OPENED, text):
        if not MARKED.match(text, m.start()):
            line = text.count("\n", 0, m.start()) + 1
            found.append((line, "a figure's marker without its figure and <!--/fig--> on "
                                "the same line (<!--fig:KEY-->FIGURE<!--/fig-->)"))
    return sorted(found, key=lambda f: f[0])  # (by line; in order within one)


def _replaced(text: str, make) -> str:
    """``text`` with each marked figure outside a code span replaced by ``make(match)``."""
    out, at = [], 0
    for m in _marks(MARKED, text):
        out += [text[at:m.start()], make(m)]
        at = m.end()
    return "".join(out) + text[at:]


def filled(text: str, known: dict[str, str]) -> str:
    """``text`` with each marked figure replaced by results.json's, without its comments."""
    return _replaced(text, lambda m: known.get(m.group(1), m.group(2)))


def rewrite(pages: list[Path], known: dict[str, str]) -> tuple[list[Path], list[str]]:
    """Write results.json's figures into ``pages`` (each marked figure): the pages changed,
    and the keys quoted that results.json does not define ("page: key")."""
    changed, missing = [], []
    for page in pages:
        text = page.read_text()
        for k, _ in used(text):
            if k not in known:
                missing.append(f"{page}: {k}")
        new = _replaced(text, lambda m: (f"<!--fig:{m.group(1)}-->{known[m.group(1)]}<!--/fig-->"
                                         if m.group(1) in known else m.group(0)))
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed, missing


def hand_written_pages() -> list[Path]:
    """The MyST pages under docs/ that people write (not the generated ones, not _build)."""
    from spmd_docs import PAGES

    docs = ROOT / "docs"
    return [p for p in sorted(docs.rglob("*.md"))
            if "_build" not in p.relative_to(docs).parts
            and p.relative_to(docs).as_posix() not in PAGES]


def _config_inited(app, config) -> None:
    from sphinx.errors import SphinxError

    class FiguresDrifted(SphinxError):
        category = "benchmarks/results.json cannot give the pages their figures"

    try:
        # a configuration value: when one changes, Sphinx reads every page again ("env"),
        # so each page's figures are checked against the new run
        config.spmd_figures = values()
    except Drift as exc:
        raise FiguresDrifted(str(exc)) from None


def _source_read(app, docname: str, source: list) -> None:
    from sphinx.util import logging

    known = app.config.spmd_figures
    for line, sentence in problems(source[0], known):
        logging.getLogger(__name__).warning(sentence, location=(docname, line),
                                            type="spmd", subtype="figures")
    source[0] = filled(source[0], known)


def main() -> int:
    """``make bench``'s last step: results.json's figures into the hand-written pages."""
    changed, missing = rewrite(hand_written_pages(), values())
    for page in changed:
        print(f"figures rewritten in {page.relative_to(ROOT)}")
    for item in missing:
        print(f"not in benchmarks/results.json: {item}", file=sys.stderr)
    return 1 if missing else 0


def setup(app):
    app.add_config_value("spmd_figures", {}, "env", types=dict)
    app.connect("config-inited", _config_inited)
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}


if __name__ == "__main__":
    sys.exit(main())
