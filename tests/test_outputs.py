"""What a cell shows beyond plain lines: floods kept short (every line in the rank's log), the
live panel and its summary, per-rank outputs as tabs."""

from __future__ import annotations

import re
import time

import pytest
from conftest import displays, kernel_stream, ready_cluster, run, spmd_kernel
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(120)

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def cluster(module_shell):
    return ready_cluster(module_shell, "start -n 2 --backend none", "import os, time\nrank = int(os.environ['SPMD_RANK'])")


def test_a_flood_keeps_its_first_and_last_lines_and_the_log_keeps_every_line(cluster):
    out = run(cluster, "%%spmd --max-output 10\nfor i in range(100_000):\n    print('line', i)")
    assert out.error is None
    kept = out.stdout.splitlines()
    # the same on both ranks: shown once, 5 first and 5 last lines
    assert kept == ["[ranks 0-1]", *(f"line {i}" for i in range(5)),
                    "[ranks 0-1]", *(f"line {i}" for i in range(99_995, 100_000))]
    assert "99,990 lines left out here" in out.stderr
    # the log has every line, after a header that names the cell (and earlier cells before)
    tail = run(cluster, "%spmd log 1 --tail 100001")
    said, header, *lines = tail.stdout.splitlines()
    assert re.match(
        r"\[rank 1\] (the last 100,001 of [\d,]+ lines; all of them are in /.*rank-1\.log "
        r"\(%spmd log 1 --tail \d+ shows them here\)|100,001 lines \(/.*rank-1\.log\)):",
        said,
    ), said
    assert re.fullmatch(r"--- cell \d+: for i in range\(100_000\):", header)
    assert lines == [f"line {i}" for i in range(100_000)]
    # without --tail: as many lines as a cell keeps (1000 by default), and where the rest are
    default = run(cluster, "%spmd log 1").stdout.splitlines()
    assert re.match(r"\[rank 1\] the last 1,000 of [\d,]+ lines; all of them are in /", default[0])
    assert default[1:] == [f"line {i}" for i in range(99_000, 100_000)]
    # more lines than a machine can count are all of them, not an OverflowError
    huge = run(cluster, "%spmd log 1 --tail 99999999999999999999")
    assert huge.error is None and huge.stdout.endswith("line 99999\n")


def test_the_default_limit_keeps_a_thousand_lines_per_rank(cluster):
    out = run(cluster, "for i in range(1500):\n    print(rank, i)")
    assert out.error is None
    lines = [ln for ln in out.stdout.splitlines() if not ln.startswith("[rank")]
    assert len(lines) == 2 * 1000
    assert "500 lines left out here" in out.stderr
    whole = run(cluster, "%spmd log 0")
    assert "0 1499" in whole.stdout and "0 700" in whole.stdout


def test_log_and_max_output_say_what_they_take(cluster):
    for line, says in [
        ("%spmd log", "rank"),
        ("%spmd log 7", "this cluster has ranks 0-1"),
        ("%spmd log one", "say which rank by its number"),
        ("%spmd log ²", "say which rank by its number"),
        ("%spmd log -1", "say which rank by its number"),
        ("%spmd debug ²", "%spmd debug takes one rank number"),
        ("%spmd log 0 --tail 0", "--tail must be a whole number"),
        ("%%spmd --max-output lots\nx = 1", "--max-output must be a whole number"),
        ("%spmd panel sideways", "%spmd panel takes on, off or nothing"),
    ]:
        out = run(cluster, line)
        assert isinstance(out.error, UsageError), line
        assert says in str(out.error), (line, str(out.error))


def test_the_panel_freezes_to_a_summary_that_names_the_slowest_rank(cluster):
    out = run(cluster, "%%spmd --panel --grace 10\ntime.sleep(1.5 if rank == 1 else 0.1)")
    assert out.error is None
    # (the shell's capture keeps each update of the display: the last is what stays)
    panel = [o for o in out.outputs if "spmd-panel" in o.get("text/html", "")][-1]
    text = panel["text/plain"]
    assert re.match(r"The cell took 1\.\d\d s; the slowest was rank 1 \(1\.\d\d s behind", text)
    rows = text.splitlines()[2:]
    assert [r.split()[:2] for r in rows] == [["0", "done"], ["1", "done"]]
    assert all(re.search(r":\d+\s+\d+ MB$", r) for r in rows), rows  # pid and memory, read live
    # between cells
    now = run(cluster, "%spmd panel")
    assert now.outputs[0]["text/plain"].startswith("Ranks now: 2 idle.")


def test_the_live_view_shows_a_line_that_came_in_pieces_as_one_line(cluster):
    """A rank writes 'after', then ' 1' and its newline a second later (two messages: a rank
    sends what it has every 0.2 s): the live view shows '[rank 0] after 1', and 'after'
    alone while the rest has yet to come, never ' 1' as a line of its own."""
    with displays() as shown:  # every update of the live view
        out = run(cluster, "print('after', end='', flush=True)\ntime.sleep(1.5)\n"
                           "print('', 1)\ntime.sleep(1)")
    assert out.error is None
    live = [d["text/plain"].splitlines() for d in shown
            if "text/plain" in d and "[rank " in d["text/plain"]]
    assert any("[rank 0] after 1" in lines for lines in live), live
    assert not any("[rank 0]  1" in lines for lines in live), live
    assert any("[rank 0] after" in lines for lines in live), live  # (begun, shown as it is)


def test_the_panel_shows_the_straggler_while_the_cell_runs(cluster):
    try:
        assert run(cluster, "%spmd panel on").error is None
        with displays() as shown:  # every update of the panel, as a front end gets it
            out = run(cluster, "%%spmd --grace 10\ntime.sleep(2 if rank == 1 else 0.1)")
        assert out.error is None
    finally:
        run(cluster, "%spmd panel off")
    live = [d for d in shown if "spmd-panel" in d.get("text/html", "")]
    straggling = [d for d in live if "<- straggler" in d["text/plain"]]
    assert straggling, [d["text/plain"] for d in live]
    rows = straggling[0]["text/plain"].splitlines()
    assert any(r.split()[:2] == ["0", "done"] for r in rows), rows
    assert any(r.split()[:2] == ["1", "busy"] and r.endswith("<- straggler") for r in rows), rows
    assert run(cluster, "x = 1").outputs == []  # off again: no panel


def test_tabs_show_one_tab_per_group_of_ranks_and_keep_the_text(cluster):
    out = run(cluster, "%%spmd --tabs\nprint('same')\nprint('rank', rank)")
    assert out.error is None
    (tabs,) = out.outputs
    assert WIDGET_VIEW in tabs
    assert tabs["text/plain"] == "[ranks 0-1] same\n[rank 0] rank 0\n[rank 1] rank 1"
    # what the browser draws: one page per rank, titled by it, holding that rank's lines
    from ipywidgets import Widget

    tab = Widget.widgets[tabs[WIDGET_VIEW]["model_id"]]
    assert tuple(tab.titles) == ("rank 0", "rank 1")
    pages = ["".join(o.get("text", "") for o in page.outputs) for page in tab.children]
    assert pages == ["same\nrank 0\n", "same\nrank 1\n"]
    # the same on every rank: no tabs
    out = run(cluster, "%%spmd --tabs\nprint('same')")
    assert out.outputs == [] and out.stdout == "[ranks 0-1] same\n"


def test_output_without_newlines_is_capped_too(cluster):
    out = run(cluster, "%%spmd --max-output 10\nfor i in range(100_000):\n    print('.', end='')")
    assert out.error is None
    assert len(out.stdout) < 12_000, len(out.stdout)  # 100 kB per rank without the cap
    assert "lines left out here" in out.stderr
    # every dot is in the log
    log = run(cluster, "%spmd log 0 --tail 1").stdout
    assert log.splitlines()[-1].count(".") == 100_000


def test_a_rank_still_streaming_a_flood_is_not_taken_for_a_diverged_one(cluster):
    # (the flood takes 2.5-3.5 s here, past the grace, so without the rule the rank would be
    # called diverged; the rule allows 10 graces at most, which 0.3 s made a race with it)
    out = run(
        cluster,
        "%%spmd --grace 1 --max-output 10\n"
        "for i in range(300_000 if rank == 0 else 1):\n    print(i)",
    )
    assert out.error is None, out.error
    assert "299999" in out.stdout


def logged(shell, rank: int, text: str, timeout: float = 30) -> None:
    """Until ``%spmd log RANK`` has ``text`` (a rank's late line has come)."""
    deadline = time.monotonic() + timeout
    while text not in run(shell, f"%spmd log {rank}").stdout:
        assert time.monotonic() < deadline, f"{text!r} not in rank {rank}'s log"
        time.sleep(0.1)


def test_what_a_thread_prints_after_its_cell_ended_is_logged_and_shown_next(cluster):
    from conftest import session

    client = session(cluster).record().client
    started = run(
        cluster,
        "import threading\nthreading.Timer(0.5, print, ('FROM-THREAD', rank)).start()",
    )
    assert started.error is None
    entries = len(client.metadata)
    logged(cluster, 1, "FROM-THREAD 1")  # (the line came)
    # ipyparallel keeps no entry for a message whose cell had ended ...
    assert len(client.metadata) <= entries
    # ... the rank's log has the line ...
    assert "FROM-THREAD 1" in run(cluster, "%spmd log 1").stdout
    # ... and the next cell shows what came after the last look, labelled
    assert run(cluster, "threading.Timer(0.3, print, ('AGAIN', rank)).start()").error is None
    for rank in (0, 1):  # (a look into the logs keeps what it took for the next cell)
        logged(cluster, rank, f"AGAIN {rank}")
    shown = run(cluster, "x = 1").stdout
    assert "[rank 0, after its cell ended] AGAIN 0\n" in shown, shown
    assert "[rank 1, after its cell ended] AGAIN 1\n" in shown, shown


# A comm message that ipyparallel's relay to the front end cannot handle (no comm_id), sent by
# rank 0 only: the other rank's end then starts the grace, so a cell held by it is reported
# as diverged rather than waited for without end.
BAD_COMM = (
    "import os\n"
    "kernel = get_ipython().kernel\n"
    "if os.environ['SPMD_RANK'] == '0':\n"
    "    kernel.session.send(kernel.iopub_socket, 'comm_open', content={'target_name': 'x'},\n"
    "                        parent=kernel.get_parent('shell'))\n"
    "print('after')"
)


def test_a_widget_message_the_notebook_cannot_relay_does_not_hold_the_cell():
    """The SPMD kernel relays the ranks' comm messages to the front end (ipyparallel's
    handler); one that fails there is still counted among its rank's outputs, so the cell
    ends, and the next cell runs."""
    with spmd_kernel() as (_km, kc):
        reply, text = kernel_stream(kc, BAD_COMM, timeout=60)
        assert reply["content"]["status"] == "ok", text
        # (the kernel's log line that says so may show among them)
        assert "[ranks 0-1] after\n" in text, text
        reply, text = kernel_stream(kc, "print('next')", timeout=60)
        assert reply["content"]["status"] == "ok" and text == "[ranks 0-1] next\n", text
