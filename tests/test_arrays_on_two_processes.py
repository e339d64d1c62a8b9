"""The seed's global arrays (001) on 2 real processes x 4 CPU devices in place of test_arrays'
4 x 2: print, an f-string, a print to stderr, display, and a summarized array show what one
process with all 8 devices shows."""

from __future__ import annotations

import pytest
from conftest import ready_cluster, run
from global_arrays import BIG2, SEED, one_process_output, one_process_reprs, unlabelled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_print_and_display_on_two_processes_show_what_one_process_shows(fresh):
    """test_arrays' prints on 4 processes of 2 devices, the same on 2 processes of 4: print,
    an f-string, stderr, display, and a summarized array."""
    ready_cluster(fresh, "start -n 2 -d 4", SEED + "\n" + BIG2 + "\nimport sys")
    for code in ("print(arr_sharded)", "print(f'sum {arr_sharded.sum()} of {arr_sharded}')",
                 "print(big2)"):
        out = run(fresh, code)
        reference = one_process_output(BIG2 + "\n" + code)[0]
        assert unlabelled(out.stdout, "[ranks 0-1]") == reference, out.stdout
    out = run(fresh, "print(arr_sharded, file=sys.stderr)")
    assert unlabelled(out.stderr, "[ranks 0-1]") == one_process_output("print(arr_sharded)")[0]
    reference = one_process_reprs(["arr_sharded", "big2"], BIG2)
    out = run(fresh, "display(arr_sharded)\ndisplay(big2)")
    assert [o.get("text/plain") for o in out.outputs] == [
        reference["arr_sharded"], reference["big2"]], out.outputs
