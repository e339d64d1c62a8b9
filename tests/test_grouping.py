"""Grouping of per-rank outputs, on hand-made outputs (no processes needed)."""

from spmd.cluster.lockstep.run import (
    LINE_WIDTH,
    Output,
    RankCell,
    drop_chatter,
    left_out_line,
    same_on_every_rank,
)
from spmd.magics.cells.render import (
    RankResults,
    group_errors,
    group_outputs,
    group_results,
    labelled,
)
from spmd.words import rank_label, rank_set


def cells(*per_rank):
    made = {}
    for rank, outs in enumerate(per_rank):
        cell = RankCell(rank)
        for out in outs:
            cell.add(out)
        cell.finish()
        made[rank] = cell
    return made


def test_rank_sets_are_written_short():
    assert rank_set([0, 1, 2, 3]) == "0-3"
    assert rank_set([2, 0]) == "0,2"
    assert rank_set([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_label([3]) == "[rank 3]"
    assert rank_label([1, 0]) == "[ranks 0-1]"


def test_output_in_many_small_pieces_without_newlines_is_capped_by_its_characters():
    # print('.', end='') in a loop: no newline ever, so only the characters can cap it; the
    # first and the last max_lines // 2 * LINE_WIDTH characters are kept, and each piece of
    # LINE_WIDTH between counts as a line left out
    cell = RankCell(0, max_lines=10)
    for _ in range(100_000):
        cell.add(Output("stdout", "."))
    cell.finish()
    half = 5 * LINE_WIDTH
    assert [(o.kind, o.text) for o in cell.outputs] == [
        ("stdout", "." * half),
        ("stderr", left_out_line(cell.left_out)),
        ("stdout", "." * half),
    ]
    assert cell.left_out * LINE_WIDTH + 2 * half == 100_000  # (every character accounted for)


def test_identical_outputs_collapse_and_different_ones_stay_per_rank():
    same = Output("stdout", "8 2\n")
    groups = group_outputs(
        cells(
            [same, Output("stdout", "0\n")],
            [Output("stdout", "8 2\n"), Output("stdout", "1\n")],
        )
    )
    # stream chunks of one stream merge; the lines both ranks printed first are shown once
    assert [(ranks, out.text) for ranks, out in groups] == [
        ([0, 1], "8 2\n"),
        ([0], "0\n"),
        ([1], "1\n"),
    ]


def test_lines_every_rank_printed_first_are_shown_once():
    groups = group_outputs(
        cells(
            [Output("stdout", "same\nI am 0\n")],
            [Output("stdout", "same\nI am 1\n")],
            [Output("stdout", "same\n")],
        )
    )
    assert [(ranks, out.text) for ranks, out in groups] == [
        ([0, 1, 2], "same\n"),
        ([0], "I am 0\n"),
        ([1], "I am 1\n"),
    ]


def test_outputs_align_by_position_across_kinds():
    fig = {"image/png": "AAAA", "text/plain": "<Figure>"}
    ran = cells(
        [
            Output("stdout", "a\n"),
            Output("display", data=fig),
            Output("result", data={"text/plain": "0"}),
        ],
        [
            Output("stdout", "a\n"),
            Output("display", data=fig),
            Output("result", data={"text/plain": "1"}),
        ],
        [
            Output("stdout", "b\n"),
            Output("display", data=fig),
            Output("result", data={"text/plain": "0"}),
        ],
    )
    assert [(ranks, out.kind) for ranks, out in group_outputs(ran)] == [
        ([0, 1], "stdout"),
        ([2], "stdout"),
        ([0, 1, 2], "display"),
    ]
    # results come last, as the notebook cell's own result (one Out[n])
    results = group_results(ran)
    assert [(ranks, out.data["text/plain"]) for ranks, out in results] == [
        ([0, 2], "0"),
        ([1], "1"),
    ]
    shown = RankResults.of(results)._repr_mimebundle_()[0]
    assert shown == {"text/plain": "[ranks 0,2] 0\n[rank 1] 1"}


def test_a_result_that_is_the_same_everywhere_keeps_its_bundle():
    html = {"text/html": "<b>x</b>", "text/plain": "x"}
    ran = cells(*[[Output("result", data=html)] for _ in range(3)])
    data, metadata = RankResults.of(group_results(ran))._repr_mimebundle_()
    assert data == html  # its rank label is a line of its own above it, as for a display
    assert metadata == {"spmd": {"ranks": [0, 1, 2]}}


def test_a_text_result_the_same_everywhere_is_the_value_itself():
    # (what papermill, nbval and jupyter_kernel_test read: 42, as one process shows it)
    ran = cells(*[[Output("result", data={"text/plain": "42"})] for _ in range(2)])
    data, metadata = RankResults.of(group_results(ran))._repr_mimebundle_()
    assert data == {"text/plain": "42"} and metadata == {"spmd": {"ranks": [0, 1]}}


def test_clear_output_on_the_ranks_is_one_clear_in_the_notebook():
    ran = cells(
        *[
            [
                Output("stdout", "50%\n"),
                Output("clear", data={"wait": True}),
                Output("stdout", "done\n"),
            ]
            for _ in range(2)
        ]
    )
    assert [(ranks, out.kind) for ranks, out in group_outputs(ran)] == [
        ([0, 1], "stdout"),
        ([0, 1], "clear"),
        ([0, 1], "stdout"),
    ]


def test_errors_group_by_identical_traceback():
    boom = Output("error", ename="ValueError", evalue="boom", traceback=["tb", "ValueError: boom"])
    other = Output("error", ename="KeyError", evalue="'x'", traceback=["tb", "KeyError: 'x'"])
    groups = group_errors(cells([boom], [], [boom], [other]))
    assert [(ranks, err.ename) for ranks, err in groups] == [
        ([0, 2], "ValueError"),
        ([3], "KeyError"),
    ]


def test_gloo_chatter_is_dropped_and_nothing_else():
    text = (
        "[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
        "hello [Gloo]\n"
    )
    assert drop_chatter(text) == "hello [Gloo]\n"


def test_gloo_chatter_from_two_device_threads_at_once_is_dropped():
    # Two local devices connect at the same time and their C-level writes interleave.
    text = (
        "[Gloo] Rank 1[Gloo] Rank  is connected to 30 peer ranks.  is connected to Expected "
        "number of connected peer ranks is : 33 peer ranks. \n"
        "Expected number of connected peer ranks is : 3\n[4. 4.]\n"
    )
    assert drop_chatter(text) == "[4. 4.]\n"


def test_labels_go_inline_for_one_line_and_above_for_several():
    assert labelled("[rank 0]", "8 2\n") == "[rank 0] 8 2\n"
    assert labelled("[ranks 0-1]", "a\nb\n") == "[ranks 0-1]\na\nb\n"


def test_cell_file_names_that_differ_only_by_pid_are_made_the_same():
    warning = (
        "/tmp/ipykernel_22203/2177033046.py:1: DeprecationWarning: jax.experimental.shard_map "
        "is deprecated\n"
    )
    assert same_on_every_rank(warning) == (
        "<cell>:1: DeprecationWarning: jax.experimental.shard_map is deprecated\n"
    )
    assert same_on_every_rank(warning.replace("22203", "22206")) == same_on_every_rank(warning)


def test_the_same_text_on_stdout_and_on_stderr_stays_apart():
    ran = cells(
        [Output("stdout", "same\n")], [Output("stderr", "same\n")], [Output("stdout", "same\n")]
    )
    groups = group_outputs(ran)
    assert [(ranks, out.kind, out.text) for ranks, out in groups] == [
        ([0, 2], "stdout", "same\n"),
        ([1], "stderr", "same\n"),
    ]


def test_the_same_error_groups_although_the_ranks_count_their_cells_differently():
    # after a %%spmd --ranks 0 cell, rank 0 has run one cell more than rank 1
    def raised(count):
        return Output(
            "error",
            ename="ZeroDivisionError",
            evalue="division by zero",
            traceback=[
                f"\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[{count}]\x1b[39m, line 1",
                "1/0",
            ],
        )

    groups = group_errors(cells([raised(12)], [raised(11)]))
    assert [ranks for ranks, _ in groups] == [[0, 1]]
    assert "In[12]" in groups[0][1].traceback[0]  # the lowest rank's text is shown


def test_the_panel_of_256_ranks_is_a_row_per_state_and_of_16_a_row_per_rank():
    from spmd.magics.cells.panel import panel_html, panel_text

    def rows(n, stragglers):
        return [dict(rank=r, state="straggler" if r in stragglers else "done",
                     seconds=0.5 if r in stragglers else 0.10 + r / 10000,
                     host=f"node{r // 8}", pid=1000 + r, memory=(100 + r % 3) * 2**20)
                for r in range(n)]

    text = panel_text(rows(256, {5, 200}), live=True).splitlines()
    assert text == [
        "Running: ranks 5,200 still busy after the others finished.",
        "ranks              state  seconds      hosts     memory",
        "0-4,6-199,201-255  done   0.10-0.13 s  32 hosts  100-102 MB",
        "5,200              busy   0.50 s       2 hosts   102 MB   <- straggler",
    ], text
    assert panel_html(rows(256, {5}), live=True).count("<tr") == 3  # (the head, 2 groups)
    assert len(panel_text(rows(16, {5}), live=True).splitlines()) == 18  # (head, 16 ranks)


def test_ranks_outside_the_cells_code_are_one_section_however_many_places():
    """A death caught 128 ranks at a dozen places in ipykernel and IPython (the cell not
    begun yet): a section each buried the cell's own."""
    from spmd.cluster.lockstep.where import Frame, Stack
    from spmd.magics.cells.report import stack_section

    lib = "/venv/lib/python3.11/site-packages/"
    cell = Frame("/tmp/ipykernel_7/1234.py", 4, "<module>", "time.sleep(60)")
    stacks = {r: Stack(r, [cell]) for r in range(6)}
    stacks[4] = Stack(4, [Frame(lib + "IPython/core/compilerop.py", 90, "ast_parse", "")])
    stacks[5] = Stack(5, [Frame(lib + "ipykernel/kernelbase.py", 506, "dispatch_shell", "")])
    lines = [line for line in stack_section(list(range(6)), stacks) if line.startswith("[")]
    assert lines == ["[ranks 0-3] was running at cell line 4: time.sleep(60)",
                     "[ranks 4-5] were outside the cell's code, in ipykernel or IPython (the "
                     "cell not begun yet, or just ended), at 2 places; the first of them:"]
    del stacks[5]  # (one place only: as any other stack)
    lines = [line for line in stack_section([0, 1, 2, 3, 4], stacks) if line.startswith("[")]
    assert lines[1] == "[rank 4] was running", lines
