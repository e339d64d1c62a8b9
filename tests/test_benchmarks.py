"""``make bench`` on a machine with less free memory than a part of it needs: the part is left
out, with why, and the bench goes on to its tables. (The bench itself is not run here: it takes
an hour.)"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_the_many_ranks_part_leaves_out_what_does_not_fit_and_goes_on(fresh):
    """Trivial cells on 2 ranks are measured; a start of 1,000,000 ranks is refused by the
    start's own room check, as 256 ranks are on a machine with 13 GiB free (that failed the
    whole bench, before any table). It is left out with the check's sentence, and the end of
    the bench prints its table and says what it left out and why."""
    from benchmarks import many
    from benchmarks.bench import Bench
    from benchmarks.table import summary

    bench = Bench()
    many.measure(bench, count=3, cells_on=(2,), starts=(1_000_000,))
    assert len(bench.samples["cell_n2/none"]) == 3  # (measured: it fits)
    assert not [name for name in bench.samples if "n1000000" in name]
    [(what, why)] = bench.left_out.items()
    assert what == "1000000 ranks: a start and a cell"
    assert why.startswith("-n 1000000 is more ranks than this machine has room for: each "
                          "needs about 64 MiB (none, forked by the rank server)"), why
    assert fresh.magics_manager.registry["SpmdMagics"].session.running is False
    text = summary(bench)
    assert "| figure " in text  # (the table, whatever rows this part's figures make)
    assert text.endswith(f"\n- {what}: {why}"), text
    assert "Left out (1): this machine had no room for them when their turn came." in text


def test_a_part_left_out_keeps_the_earlier_runs_figures_marked(tmp_path):
    """Where 64 ranks did not fit, results.json kept no ``_n64`` figure, which the pages quote:
    the docs build failed. The earlier run's figures of that part are carried over, marked
    with that run's date; a part measured, or one not left out, is not."""
    import json

    from benchmarks.table import carry_over, figure_text

    earlier = tmp_path / "results.json"
    old = {"median": 3.5, "min": 3.2, "max": 3.7, "runs": 3}
    earlier.write_text(json.dumps({"date": "2026-11-01", "figures": {
        "restart/spmd_n64_none": old, "start_to_ready/spmd_n64_none": old,
        "start_to_ready/spmd_n640_none": old, "restart/spmd": old, "cell_n16/none": old}}))
    figures = {"start_to_ready/spmd_n64_none": {**old, "median": 3.0}}
    carried = carry_over(figures, {64}, earlier)
    assert carried == ["restart/spmd_n64_none"]
    assert figures["restart/spmd_n64_none"] == {**old, "carried_over": "2026-11-01"}
    assert figures["start_to_ready/spmd_n64_none"]["median"] == 3.0
    assert figure_text("restart/spmd_n64_none", figures["restart/spmd_n64_none"]).endswith(
        ", from the run of 2026-11-01")
    assert carry_over({}, set(), earlier) == []
    assert carry_over({}, {64}, tmp_path / "none.json") == []
