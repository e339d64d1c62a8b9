"""print(x) on 4 processes x 2 CPU devices shows what one process of all 8 shows: the corpus of
print_corpus.py, and a cell's value that lives on some processes' devices only (process 0's,
or processes 0-1's), shown once as one process shows it, under one line naming its holders.
test_printed.py judges the same on 2 processes x 4 devices."""

from __future__ import annotations

import pytest
from conftest import ready_cluster, report, run
from print_corpus import HELD_LINE, SETUP, check_corpus, one_process

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_the_corpus_on_four_processes_prints_what_one_process_prints(module_shell):
    check_corpus(ready_cluster(module_shell, "start -n 4 -d 2", SETUP), 4)


@pytest.mark.slow
def test_a_value_some_processes_hold_is_shown_once_as_they_show_it(module_shell):
    """On 4 x 2, a cell's value (or display) that lives on process 0's devices, or is copied on
    processes 0-1's, is shown once as one process shows it, under one line naming the
    processes that hold it (before: the holders' text, then the others' placeholders). No
    warning of launches that differ: rank 0 computing on its own devices while the others
    hold none is one program on every rank."""
    shell = ready_cluster(module_shell, "start -n 4 -d 2", SETUP)
    cells = {"double(on_first2)": "process 0", "copied": "processes 0-1",
             "double(copied)": "processes 0-1", "display(on_first2 + 1)": None}
    reference = one_process([f"print(repr({cell.removeprefix('display')}))"
                             for cell in cells])
    for (cell, holders), (expected, _) in zip(cells.items(), reference):
        out = run(shell, cell)
        assert out.error is None, (cell, report(out))
        assert [o["text/plain"] for o in out.outputs] == [expected.rstrip("\n")], (cell, out)
        if holders is None:  # (a display: said as a print is)
            assert HELD_LINE.fullmatch(out.stderr), out
        else:
            assert out.stderr == "", (cell, out)
            assert out.stdout.startswith(f"(one array on the 2 devices of {holders} only: "
                                         if holders == "process 0" else
                                         f"(one array on the 4 devices of {holders} only: "), out
    # numpy of it fails on the ranks that hold none: the hint names those that do (before: "no
    # single process can print it")
    out = run(shell, "np.asarray(copied)")
    text = "\n".join(out.error._render_traceback_())
    assert "copied lives on the devices of processes 0-1 only: the other ranks hold none" in \
        text, text
    assert "no single process" not in text, text
