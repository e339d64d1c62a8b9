"""The site's generated reference (docs/_ext/spmd_docs), without a Sphinx build: each page
from its generator, against the code it is generated from; and the notebooks `make demo`
runs, each a page of the site; the measured figures the pages quote, each checked against
benchmarks/results.json (one check builds a one-page site, a few seconds); and the pages'
links to each other, plain Markdown that a repository host follows as the site does.

`make docs` builds the whole site, running the notebooks; these checks take seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from spmd_docs import benchmarks, figures, internals, kernel, magics  # noqa: E402
from spmd_docs.tables import Drift  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _commands_the_magic_lists() -> list[str]:
    """The commands as `%spmd` names them to a person who typed one it does not have."""
    from IPython.core.error import UsageError

    from spmd.magics.magics import SpmdMagics

    with pytest.raises(UsageError) as refused:
        SpmdMagics.spmd(object(), "frobnicate")
    listed = str(refused.value).split(": use ", 1)[1].rstrip(".")
    return re.split(r", | or ", listed)


def test_every_command_the_magic_lists_has_its_entry():
    listed = _commands_the_magic_lists()
    assert "start" in listed and "attach" in listed
    page = magics.page()
    for command in listed:
        assert f"(spmd-{command})=\n## `%spmd {command}`\n" in page, command
    assert page.count("\n## `%spmd ") == len(listed)
    assert "## `%%spmd`" in page and "## `%%local`" in page


@pytest.mark.parametrize("parser_of", ["start", "log", "export", "cell"])
def test_every_option_of_a_magics_parser_is_on_its_page(parser_of):
    from spmd.magics.start.arguments import _cell_parser

    parser = _cell_parser() if parser_of == "cell" else magics._parsers()[parser_of]
    page = magics.page()
    heading = "## `%%spmd`" if parser_of == "cell" else f"## `%spmd {parser_of}`"
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    for action in parser._actions:
        for option in action.option_strings:
            assert f"`{option}" in section, option


@pytest.mark.parametrize("parser_of", ["start", "log", "export", "cell"])
def test_every_option_of_a_magics_parser_is_in_its_help(parser_of):
    """`%spmd?` (the magic's docstring) names each option by one of its spellings (`-n` or
    `--processes`): it left out export's `--raw-output`."""
    from spmd.magics.magics import SpmdMagics
    from spmd.magics.start.arguments import _cell_parser

    parser = _cell_parser() if parser_of == "cell" else magics._parsers()[parser_of]
    help_text = SpmdMagics.spmd.__doc__
    missing = [action.option_strings for action in parser._actions if action.option_strings
               and not any(re.search(rf"{re.escape(o)}\b", help_text)
                           for o in action.option_strings)]
    assert missing == [], missing


def test_every_backend_is_in_the_readmes_start_line():
    """(it left out jax,torch)"""
    from spmd.options import BACKENDS

    listed = re.search(r"--backend ([\w,|]+)\]", (ROOT / "README.md").read_text()).group(1)
    assert listed.split("|") == list(BACKENDS)


def test_a_command_without_its_sentence_fails_the_build(monkeypatch):
    from spmd.magics import magics as dispatch

    monkeypatch.setitem(dispatch._COMMANDS, "frobnicate", dispatch.SpmdMagics._cmd_on)
    with pytest.raises(Drift, match="frobnicate has no sentence"):
        magics.page()


def test_an_option_without_its_sentence_fails_the_build(monkeypatch):
    parser = argparse.ArgumentParser(prog="%spmd log", add_help=False)
    parser.add_argument("rank")
    parser.add_argument("--tail")
    parser.add_argument("--colour", action="store_true")
    monkeypatch.setattr(magics, "_parsers", lambda: {"log": parser})
    with pytest.raises(Drift, match="%spmd log --colour has no sentence"):
        magics.page()


def test_a_sentence_for_an_option_gone_fails_the_build(monkeypatch):
    parser = argparse.ArgumentParser(prog="%spmd log", add_help=False)
    parser.add_argument("rank")
    monkeypatch.setattr(magics, "_parsers", lambda: {"log": parser})
    with pytest.raises(Drift, match="describes --tail, which %spmd log no longer has"):
        magics.page()


def test_the_kernel_page_has_every_setting_and_command():
    from spmd.kernel import kernelspec
    from spmd.kernel.kernel import SpmdKernel

    page = kernel.page()
    for name in SpmdKernel.class_own_traits(config=True):
        assert f"`SpmdKernel.{name}`" in page
    for command, sub in kernel._subparsers(kernelspec._parser()).items():
        assert f"### `{command}`" in page
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in page, option
    assert '"spmd.kernel.app"' in page  # kernel.json's argv
    assert "usage: python -m spmd stop" in page


def test_the_internals_page_lists_every_internal():
    from spmd.internals import INTERNALS

    page = internals.page()
    for item in INTERNALS:
        assert f"`{item.module}.{item.path}`" in page
    assert f"{len(INTERNALS)} parts of " in page


def test_the_benchmarks_page_is_the_table_make_bench_printed():
    from benchmarks.table import table

    page = benchmarks.page()
    figures = json.loads(benchmarks.RESULTS.read_text())["figures"]
    assert table(figures) in page
    for family in {name.split("/")[0] for name in figures}:
        assert f"`{family}`\n: " in page


def test_every_figure_make_bench_compares_has_its_meaning():
    """(so that the next `make bench` does not fail the docs build)"""
    from benchmarks.table import DETECTION, TARGETS

    named = [f for row in TARGETS for f in row[:2]] + [row[0] for row in DETECTION]
    assert [f for f in named if benchmarks.meaning(f.split("/")[0]) is None] == []


def test_a_benchmark_without_its_meaning_fails_the_build(tmp_path):
    data = json.loads(benchmarks.RESULTS.read_text())
    data["figures"]["teleport_n4/spmd"] = dict(data["figures"]["stop/spmd"])
    results = tmp_path / "results.json"
    results.write_text(json.dumps(data))
    with pytest.raises(Drift, match="teleport_n4"):
        benchmarks.page(results)


def test_every_notebook_make_demo_runs_is_a_page_of_the_site():
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^NOTEBOOKS := ((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    names = listed.replace("\\\n", " ").split()
    assert "pitfalls" in names
    toctrees = (DOCS / "tutorials" / "index.md").read_text() + (
        DOCS / "getting-started" / "index.md").read_text()
    for name in names:
        page = DOCS / "tutorials" / f"{name}.ipynb"
        assert page.resolve() == ROOT / "notebooks" / f"{name}.ipynb", name
        assert re.search(rf"^(/tutorials/)?{re.escape(name)}$", toctrees, re.M), name


def test_every_figure_a_page_quotes_is_the_one_results_json_gives():
    """A page writes a measured figure as <!--fig:key-->figure<!--/fig-->; each must be the
    figure results.json gives now, or the build fails on it."""
    known = figures.values()
    pages = figures.hand_written_pages()
    assert DOCS / "how-to" / "faster-starts.md" in pages
    assert DOCS / "reference" / "magics.md" not in pages  # (generated)
    quoted = {page.relative_to(DOCS).as_posix(): figures.used(page.read_text())
              for page in pages}
    assert sum(map(len, quoted.values())) >= 10  # (the pages do quote figures this way)
    wrong = {page.relative_to(DOCS).as_posix(): figures.problems(page.read_text(), known)
             for page in pages}
    assert {page: found for page, found in wrong.items() if found} == {}


def test_what_the_build_says_of_a_pages_figures():
    known = {"restart_spmd": "0.653 s", "ratio__a__b": "0.19×"}
    page = ("# Figures\n\n"
            "A restart takes <!--fig:restart_spmd-->0.653 s<!--/fig-->, or\n"
            "<!--fig:ratio__a__b-->0.19×<!--/fig--> a start; the form is\n"
            "`<!--fig:KEY-->FIGURE<!--/fig-->`, and `<!--fig:` opens it.\n"
            "Then <!--fig:restart_spmd-->0.7 s<!--/fig--> and <!--fig:restart_n3-->1 s<!--/fig-->\n"
            "and <!--fig:restart_spmd--> 0.653 s\n")
    assert figures.used(page) == [("restart_spmd", "0.653 s"), ("ratio__a__b", "0.19×"),
                                  ("restart_spmd", "0.7 s"), ("restart_n3", "1 s")]
    found = figures.problems(page, known)
    assert [line for line, _ in found] == [4, 6, 6, 7]
    assert "starts its line" in found[0][1]
    assert "written '0.7 s', and benchmarks/results.json has '0.653 s'" in found[1][1]
    assert "restart_n3 is not in benchmarks/results.json" in found[2][1]
    assert "without its figure and <!--/fig--> on the same line" in found[3][1]
    filled = figures.filled(page, known)
    assert "A restart takes 0.653 s, or\n0.19× a start" in filled
    assert "`<!--fig:KEY-->FIGURE<!--/fig-->`" in filled  # (a code span is left as it is)
    assert "Then 0.653 s and 1 s\n" in filled


def test_make_bench_writes_its_figures_into_the_pages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Restarts take <!--fig:restart_spmd-->0.7 s<!--/fig--> (form: "
                    "`<!--fig:restart_spmd-->0.7 s<!--/fig-->`), starts <!--fig:x-->1 s<!--/fig-->.\n")
    changed, missing = figures.rewrite([page], {"restart_spmd": "0.653 s"})
    assert changed == [page] and missing == [f"{page}: x"]
    assert page.read_text() == (
        "Restarts take <!--fig:restart_spmd-->0.653 s<!--/fig--> (form: "
        "`<!--fig:restart_spmd-->0.7 s<!--/fig-->`), starts <!--fig:x-->1 s<!--/fig-->.\n")
    makefile = (ROOT / "Makefile").read_text()
    bench = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "PYTHONPATH=docs/_ext $(BIN)/python -m spmd_docs.figures" in bench


def test_the_figures_keys_are_made_from_their_names():
    from benchmarks.table import median_text

    defined = figures.values()
    stats = json.loads(figures.RESULTS.read_text())["figures"]
    assert figures.key("restart/spmd") == "restart_spmd"
    assert defined["restart_spmd"] == median_text("restart/spmd", stats["restart/spmd"])
    for name in stats:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", figures.key(name)), name
    ratio = figures.ratio_key("restart/spmd", "start_to_ready/floor")
    assert ratio == "ratio__restart_spmd__start_to_ready_floor"
    want = stats["restart/spmd"]["median"] / stats["start_to_ready/floor"]["median"]
    assert defined[ratio] == f"{want:.2f}×"


def test_two_figures_with_one_key_fail_the_build(tmp_path):
    data = json.loads(figures.RESULTS.read_text())
    data["figures"]["restart_spmd/x"] = data["figures"]["restart/spmd"]
    data["figures"]["restart/spmd_x"] = data["figures"]["restart/spmd"]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(data))
    with pytest.raises(Drift, match="restart_spmd_x"):
        figures.values(results)


# a link in a MyST page: [text](target), the target up to a space or the closing parenthesis
_LINK = re.compile(r"\]\(([^()\s]+)\)")
# what shows as raw text where a repository host renders the Markdown as it is
_RAW_ON_A_HOST = re.compile(r"\{(?:doc|ref|download|numref)\}`|\{\{")


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as the site (myst_heading_anchors = 3) and a
    repository host both make them."""
    from myst_parser.slugs import github_slugify

    headings = re.findall(r"^#{1,3} (.+)$", page.read_text(), re.M)
    return {github_slugify(h.replace("`", "")) for h in headings}


@pytest.mark.parametrize("page", ["README.md", *(
    p.relative_to(ROOT).as_posix() for p in figures.hand_written_pages())])
def test_a_pages_links_are_markdown_that_a_repository_host_follows(page):
    """Pages link to each other as Markdown links to their files (relative, which the site
    and a repository host both follow), never by a MyST role (raw text on a host); a link
    names a file that is there (or that the build generates) and a heading that page has."""
    from spmd_docs import PAGES

    path = ROOT / page
    text = path.read_text()
    assert _RAW_ON_A_HOST.findall(text) == []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # (another site)
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        generated = linked.is_relative_to(DOCS) and linked.relative_to(DOCS).as_posix() in PAGES
        assert linked.exists() or generated, f"{page}: {target}"
        if anchor and linked.suffix == ".md" and not generated:
            assert anchor in _anchors(linked), f"{page}: {target}"


def test_a_page_whose_figure_drifted_from_results_json_fails_the_build(tmp_path):
    """The check the site's build makes: a Sphinx build with -W, the MyST pages and this
    extension, of a page whose figures are results.json's, and of one with a figure written
    otherwise and one results.json does not have."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(DOCS / '_ext')!r}, {str(ROOT)!r}]\n"
        "extensions = ['myst_parser', 'spmd_docs.figures']\n"
    )
    page = src / "index.md"
    measured = figures.values()["restart_spmd"]

    def build(text: str) -> subprocess.CompletedProcess:
        page.write_text(f"# Figures\n\n{text}\n")
        return subprocess.run(
            [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "text",
             str(src), str(tmp_path / "out")], capture_output=True, text=True, timeout=50)

    ok = build(f"A restart takes <!--fig:restart_spmd-->{measured}<!--/fig-->.")
    assert ok.returncode == 0, ok.stderr
    said = (tmp_path / "out" / "index.txt").read_text()
    assert f"A restart takes {measured}." in said
    drifted = build("A restart takes <!--fig:restart_spmd-->0.001 s<!--/fig-->, a start\n"
                    "<!--fig:restart_spmd_n3-->1 s<!--/fig-->.")
    assert drifted.returncode != 0
    assert "index.md:3" in drifted.stderr and "written '0.001 s'" in drifted.stderr
    assert "index.md:4" in drifted.stderr and "restart_spmd_n3 is not in" in drifted.stderr


def test_a_link_to_a_page_that_is_a_symbolic_link_finds_that_page(tmp_path):
    """The tutorials are symbolic links to notebooks/, which Sphinx follows when it resolves
    a link's path: a Markdown link to one names the page, not a file outside the site."""
    src, elsewhere = tmp_path / "src", tmp_path / "notebooks"
    src.mkdir()
    elsewhere.mkdir()
    (src / "conf.py").write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(DOCS / '_ext')!r}, {str(ROOT)!r}]\n"
        "extensions = ['myst_parser', 'spmd_docs.links']\n"
    )
    (elsewhere / "guide.md").write_text("# The guide\n")
    (src / "guide.md").symlink_to(elsewhere / "guide.md")
    (src / "index.md").write_text("# Pages\n\nRead [the guide](guide.md).\n\n"
                                  "```{toctree}\nguide\n```\n")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-E", "-b", "pseudoxml", str(src),
         str(tmp_path / "out")], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert 'refuri="guide"' in (tmp_path / "out" / "index.pseudoxml").read_text()


def test_a_notebook_the_site_ran_is_read_by_the_tests_only_while_its_sources_stand(
        tmp_path, monkeypatch):
    """The tests read a notebook's executed copy from the site's build only while the notebook,
    the package and the Python are what the build ran; a build that failed, or did not run
    the notebooks, leaves them none."""
    import nbformat
    from spmd_docs import executed

    (tmp_path / "spmd").mkdir()
    (tmp_path / "spmd" / "cell.py").write_text("x = 1\n")
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nbformat.write(nb, str(tmp_path / "notebooks" / "guide.ipynb"))
    out = tmp_path / "_build" / "jupyter_execute" / "tutorials"
    for name, value in [("ROOT", tmp_path), ("NOTEBOOKS", tmp_path / "notebooks"),
                        ("EXECUTED", out), ("STAMP", out / "sources.json")]:
        monkeypatch.setattr(executed, name, value)

    def build(failed: bool = False, mode: str = "force") -> None:
        """What a build that reads the notebook does: runs it (with ``mode`` "off", writes
        it without outputs), then stamps it."""
        app = argparse.Namespace(config=argparse.Namespace(nb_execution_mode=mode))
        executed._config_inited(app, app.config)
        executed._source_read(app, "tutorials/guide", [""])
        nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(out / "guide.ipynb"))
        executed._build_finished(app, RuntimeError("a cell failed") if failed else None)

    assert executed.executed_copy("guide") is None  # (no build yet)
    build()
    assert executed.executed_copy("guide").cells[0].outputs[0].text == "1\n"
    (tmp_path / "spmd" / "cell.py").write_text("x = 2\n")  # the code changed since
    assert executed.executed_copy("guide") is None
    (tmp_path / "spmd" / "cell.py").write_text("x = 1\n")
    assert executed.executed_copy("guide") is not None
    nb.cells[0].source = "print(2)"  # the notebook changed since
    nbformat.write(nb, str(tmp_path / "notebooks" / "guide.ipynb"))
    assert executed.executed_copy("guide") is None
    build()
    assert executed.executed_copy("guide") is not None
    build(failed=True)
    assert executed.executed_copy("guide") is None
    build()
    build(mode="off")  # (the site without running the notebooks: copies without outputs)
    assert executed.executed_copy("guide") is None
    build()
    app = argparse.Namespace(config=argparse.Namespace(nb_execution_mode="force"))
    executed._config_inited(app, app.config)
    executed._source_read(app, "tutorials/guide", [""])  # ... and the build is killed here
    assert executed.executed_copy("guide") is None


def test_the_site_keeps_each_stream_output_as_the_kernel_wrote_it():
    """myst-nb merges a cell's streams for the page in place; the copy the tests read keeps
    them as they came (the merge works on copies)."""
    import nbformat
    from myst_nb.core import render
    from spmd_docs import executed

    executed._keep_outputs_whole()
    outputs = [nbformat.v4.new_output("stream", name="stdout", text=t)
               for t in ("[rank 0] 0\n", "[rank 1] 1\r\n")]
    merged = render.coalesce_streams(outputs)
    assert [o.text for o in merged] == ["[rank 0] 0\n[rank 1] 1\n"]
    assert [o.text for o in outputs] == ["[rank 0] 0\n", "[rank 1] 1\r\n"]
