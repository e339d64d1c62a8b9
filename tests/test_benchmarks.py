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
    from benchmarks.run import Bench, summary

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
