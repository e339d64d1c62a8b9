"""Distributed arrays across 4 real processes x 2 CPU devices: the seed's parallel-programming
examples (001), drawn with %spmd sharding, fetched with %spmd gather, checked against numpy
and against what each process says it holds, printed and shown as one process with all 8
devices prints them. (The same prints on 2 x 4: test_arrays_on_two_processes.)"""

from __future__ import annotations

import ast
import base64
import re

import numpy as np
import pytest
from conftest import ready_cluster, run
from global_arrays import BIG2, SEED, one_process_output, one_process_reprs, unlabelled
from IPython.core.error import UsageError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def cluster(module_shell):
    # (its tests read SEED's names and never change them: it runs once per set of ranks)
    return ready_cluster(module_shell, "start -n 4 -d 2", SEED, once=True)


def held_by_each_process(shell, expr: str) -> set[tuple[str, int, int]]:
    """(slices, device, process) of every shard, as each process itself reports them."""
    out = run(
        shell,
        "print(sorted((str([f'{a}:{b}' for a, b, _ in (sl.indices(n) for sl, n in "
        f"zip(sh.index, {expr}.shape))]), sh.device.id, sh.device.process_index) "
        f"for sh in {expr}.addressable_shards))",
    )
    assert out.error is None, out.stderr
    held = set()
    for line in out.stdout.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[rank") else line
        for slices, device, process in ast.literal_eval(body):
            held.add((", ".join(ast.literal_eval(slices)), device, process))
    return held


def drawn(shell, expr: str, tmp_path) -> tuple[str, set[tuple[str, int, int]]]:
    """%spmd sharding's text form, the (slices, device, process) it names, and the PNG saved
    in the test's folder."""
    out = run(shell, f"%spmd sharding {expr}")
    assert out.error is None, out.stderr
    (bundle,) = out.outputs
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(b"\x89PNG")
    (tmp_path / f"{expr}.png").write_bytes(png)
    text = bundle["text/plain"]
    return text, owners_named(text)


def owners_named(text: str) -> set[tuple[str, int, int]]:
    """(slices, device, process) of every block a picture's text form names."""
    named = set()
    for slices, holders in re.findall(r"^  \[(.*?)\]\s+(CPU .*?)(?:   replicated.*)?$", text, re.M):
        for device, process in re.findall(r"CPU (\d+) \(process (\d+)\)", holders):
            named.add((slices, int(device), int(process)))
    return named


@pytest.mark.parametrize(
    "expr, first_line, blocks",
    [
        (
            "arr_sharded",
            "arr_sharded: float32[4,8], mesh x=2, y=4, P('x', 'y'), 8 blocks on 8 devices of 4 processes",
            8,
        ),
        (
            "result",
            "result: float32[8], mesh x=2, y=4, P('y'), 4 blocks on 8 devices of 4 processes",
            4,
        ),
        (
            "result_2",
            "result_2: float32[8], mesh x=2, y=4, P('x'), 2 blocks on 8 devices of 4 processes",
            2,
        ),
        ("y", "y: int32[32], mesh x=8, P('x'), 8 blocks on 8 devices of 4 processes", 8),
        ("sums", "sums: int32[8], mesh x=8, P('x'), 8 blocks on 8 devices of 4 processes", 8),
        (
            "everywhere",
            "everywhere: float32[4,8], mesh x=2, y=4, P(), 1 block on 8 devices of 4 processes",
            1,
        ),
        (
            "half",
            "half: float32[4,4], mesh a=2, b=2, P('a', 'b'), 4 blocks on 4 devices of 2 processes",
            4,
        ),
    ],
)
def test_the_picture_names_the_right_owner_of_every_block(
    cluster, tmp_path, expr, first_line, blocks
):
    text, named = drawn(cluster, expr, tmp_path)
    assert text.splitlines()[0] == first_line
    assert len(text.splitlines()) == 1 + blocks
    assert named == held_by_each_process(cluster, expr)


def test_replication_is_shown_explicitly(cluster, tmp_path):
    text, _ = drawn(cluster, "result", tmp_path)
    # x.sum(axis=0) is partially replicated: each quarter lives on two devices of two processes
    assert (
        text.splitlines()[1] == "  [0:2]  CPU 0 (process 0), CPU 4096 (process 2)   replicated ×2"
    )
    assert all(line.endswith("replicated ×2") for line in text.splitlines()[1:])
    text, _ = drawn(cluster, "result_2", tmp_path)
    assert all(line.endswith("replicated ×4") for line in text.splitlines()[1:])


def test_gather_gives_the_numbers_the_guide_prints(cluster):
    shown = run(cluster, "%spmd gather arr_sharded")  # without -o: the cell's value
    assert shown.error is None
    assert shown.texts[-1].startswith("array([[ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.],")
    out = run(cluster, "%spmd gather result -o summed")
    assert out.error is None
    assert out.stdout == "summed = numpy float32[8], from result on the ranks.\n"
    assert cluster.user_ns["summed"].tolist() == [48.0, 52.0, 56.0, 60.0, 64.0, 68.0, 72.0, 76.0]
    run(cluster, "%spmd gather result_2 -o constrained")
    assert cluster.user_ns["constrained"].tolist() == cluster.user_ns["summed"].tolist()
    run(cluster, "%spmd gather y -o doubled")
    assert np.array_equal(cluster.user_ns["doubled"], np.arange(32) * 2)
    run(cluster, "%spmd gather sums -o sums")
    assert cluster.user_ns["sums"].tolist() == [6, 22, 38, 54, 70, 86, 102, 118]
    run(cluster, "%spmd gather half -o half")  # on processes 0-1 only: 2-3 hold nothing
    assert np.array_equal(cluster.user_ns["half"], np.arange(16.0).reshape(4, 4))
    run(cluster, "%spmd gather everywhere -o everywhere")
    assert np.array_equal(cluster.user_ns["everywhere"], np.arange(32.0).reshape(4, 8))
    run(cluster, "%spmd gather total -o total")
    assert cluster.user_ns["total"] == 496 and cluster.user_ns["total"].shape == ()


def test_gather_of_a_plain_value_is_a_list_by_rank(cluster):
    run(cluster, "%spmd gather rank * 10 -o tens")
    assert cluster.user_ns["tens"] == [0, 10, 20, 30]


def test_jax_own_picture_is_shown_once_as_html_with_a_text_form(cluster):
    out = run(cluster, "jax.debug.visualize_array_sharding(arr_sharded)")
    assert out.error is None
    assert out.stdout == "[ranks 0-3]\n"  # one label, one picture
    (bundle,) = out.outputs
    assert {"text/html", "text/plain"} <= set(bundle)
    assert "CPU 2048" in bundle["text/plain"]


def test_show_sharding_inside_code_draws_once(cluster):
    out = run(cluster, "import spmd\nspmd.show_sharding(result, 'result')")
    assert out.error is None
    (bundle,) = out.outputs
    assert "image/png" in bundle
    text = bundle["text/plain"]
    assert text.splitlines()[0].startswith("result: float32[8], mesh x=2, y=4")
    # drawn on a rank from the sharding alone: the owners are the ones each process reports
    assert owners_named(text) == held_by_each_process(cluster, "result")


@pytest.mark.parametrize(
    "line, says",
    [
        (
            "%spmd sharding rank",
            "rank is an int, not a jax.Array or a torch tensor (on ranks 0-3): %spmd sharding draws jax.Arrays and torch tensors",
        ),
        (
            "%spmd sharding total",
            "total is a 0-d array (a scalar) on 8 devices of 4 processes: there is no layout to draw; %spmd gather total gives its value.",
        ),
        (
            "%spmd gather nowhere",
            "nowhere is not defined on ranks 0-3: run the cell that defines it on every rank first.",
        ),
        ("%spmd sharding", "Say which array: %spmd sharding x draws the layout of x."),
        ("%spmd gather arr_sharded -o 1x", "-o takes a variable name, like -o full, not '1x'."),
        (
            "%spmd gather arr_sharded --max-bytes lots",
            "--max-bytes takes a number of bytes, like 1e9, not 'lots'.",
        ),
        ("%spmd push", "Say which notebook variables: %spmd push x y sends x and y to every rank."),
        (
            "%spmd push not_in_the_notebook",
            "not_in_the_notebook is not defined in the notebook: define it in a %%local cell first.",
        ),
    ],
)
def test_bad_input_says_what_to_do(cluster, line, says):
    out = run(cluster, line)
    assert isinstance(out.error, UsageError)
    assert str(out.error).startswith(says)


def test_a_name_missing_on_some_ranks_names_them(cluster):
    assert run(cluster, "if rank == 0:\n    only_here = jnp.ones(3)").error is None
    out = run(cluster, "%spmd gather only_here")
    assert str(out.error) == (
        "only_here is not defined on ranks 1-3: run the cell that defines it on every rank first."
    )


def test_a_huge_array_is_refused_before_anything_moves(cluster):
    made = run(
        cluster,
        "big = jax.jit(lambda: jnp.zeros((8192, 10240)), out_shardings=sharding)()",
    )
    assert made.error is None
    out = run(cluster, "%spmd gather big")
    assert str(out.error) == (
        "big is 335,544,320 bytes in all, over --max-bytes 268,435,456: gather a slice, "
        "like big[:100], or raise --max-bytes."
    )
    run(cluster, "del big")


def test_push_sends_a_notebook_variable_to_every_rank(cluster):
    run(cluster, "%%local\nimport numpy as np\nweights = np.arange(3)")
    out = run(cluster, "%spmd push weights")
    assert out.stdout == "Pushed weights (ndarray) to ranks 0-3.\n"
    assert run(cluster, "print(int(weights.sum()) + rank)").stdout == (
        "[rank 0] 3\n[rank 1] 4\n[rank 2] 5\n[rank 3] 6\n"
    )


def test_a_value_that_cannot_be_sent_says_what_to_push_instead(cluster):
    run(cluster, "%%local\nnumbers = (i for i in range(3))")
    out = run(cluster, "%spmd push numbers")
    assert str(out.error) == (
        "numbers cannot be sent to the ranks (TypeError: cannot pickle 'generator' object): "
        "push the data it holds instead, like a list or an array."
    )
    assert run(cluster, "print(rank)").error is None  # nothing half-sent is left behind


def test_pushing_several_names_says_which_went_and_which_did_not(cluster):
    run(cluster, "%%local\nsent_one = [1, 2]\nstuck = (i for i in range(3))")
    out = run(cluster, "%spmd push sent_one stuck")
    assert str(out.error) == (
        "Pushed sent_one (list) to ranks 0-3, but stuck cannot be sent to the ranks "
        "(TypeError: cannot pickle 'generator' object): push the data it holds instead, like a "
        "list or an array."
    )
    assert run(cluster, "print(sent_one)").stdout == "[ranks 0-3] [1, 2]\n"


def test_gather_works_while_the_ranks_are_out_of_step(cluster):
    failed = run(
        cluster, "%%spmd --timeout 1\nif rank == 0:\n    raise ValueError('x')\ntime.sleep(30)"
    )
    assert failed.error is not None
    assert isinstance(run(cluster, "x").error, UsageError)  # cells are refused...
    out = run(cluster, "%spmd gather arr_sharded -o still_there")  # ...gather is not
    assert out.error is None, out.error
    assert np.array_equal(cluster.user_ns["still_there"], np.arange(32.0).reshape(4, 8))


def test_arrays_each_process_holds_on_its_own_are_described_and_gathered_by_rank(cluster):
    made = run(
        cluster,
        "local = jnp.arange(3.0) + 10 * jax.process_index()\n"
        "ragged = jnp.ones(jax.process_index() + 2)",
    )
    assert made.error is None
    out = run(cluster, "%spmd sharding local")
    assert out.error is None
    (text,) = out.texts
    assert text.startswith("local: each rank holds an array of its own, not a piece of one")
    assert "  rank 0: float32[3] on CPU 0\n" in text and "  rank 3: float32[3] on CPU " in text
    assert "replicated" not in text
    got = run(cluster, "%spmd gather local -o by_rank")
    assert got.stdout == "by_rank = a list of 4 values, by rank, from local on the ranks.\n"
    assert [a.tolist() for a in cluster.user_ns["by_rank"]] == [
        [10.0 * r, 10.0 * r + 1, 10.0 * r + 2] for r in range(4)
    ]
    got = run(cluster, "%spmd gather ragged -o shapes")
    assert got.error is None, got.stdout
    assert [a.shape for a in cluster.user_ns["shapes"]] == [(2,), (3,), (4,), (5,)]
    assert "each rank holds an array of its own" in run(cluster, "%spmd sharding ragged").texts[0]


# -- a cell's value that is one array over several processes ----------------------------------

# Each as a cell's last expression: fully sharded, partially replicated (over 2 of the 4
# processes), fully replicated (jax prints it itself), shard_map's outputs, an array on the
# devices of processes 0-1 only, one computed in the cell.
VALUES = ["arr_sharded", "result", "result_2", "y", "sums", "total", "everywhere", "half",
          "arr_sharded * 2 + 1"]


def test_a_global_array_as_a_cells_value_prints_once_as_one_process_prints_it(cluster):
    reference = one_process_reprs(VALUES)
    for expr in VALUES:
        out = run(cluster, expr)
        assert out.error is None, out.error
        assert out.texts == [reference[expr]], expr
        if expr not in ("total", "everywhere"):  # (replicated: every process holds it whole)
            assert re.fullmatch(r"\(one array (over 4 processes, 8 devices|on the 4 devices "
                                r"of processes 0-1 only): mesh \w=\d(, \w=\d)?, P\(.*\)\)\n",
                                out.stdout), out.stdout
    assert run(cluster, "half").stdout == (
        "(one array on the 4 devices of processes 0-1 only: mesh a=2, b=2, P('a', 'b'))\n")
    assert run(cluster, "result_2").stdout == (
        "(one array over 4 processes, 8 devices: mesh x=2, y=4, P('x'))\n")


def test_a_big_global_value_moves_only_its_printed_corners_and_out_is_numpy(cluster):
    setup = (
        "big = jax.jit(lambda: jnp.arange(8192 * 8192, dtype=jnp.float32).reshape(8192, 8192),"
        " out_shardings=sharding)()"
    )
    assert run(cluster, setup).error is None
    out = run(cluster, "big")
    assert out.error is None, out.error
    (text,) = out.texts
    assert text.startswith("Array([[0.0000000e+00, 1.0000000e+00, 2.0000000e+00, ..., ")
    assert text.endswith("6.7108864e+07]], dtype=float32)")
    # what the ranks sent for it: its 6 x 6 printed corners (4 bytes each, in base64), not
    # the 256 MB the array holds
    shown = cluster.user_ns["_"]
    assert shown.received <= 4 * 36 * 4 / 3 + 64, shown.received
    # Out[n] is the global value as numpy once used as an array (fetched then)
    out = run(cluster, "%%local\nimport numpy as np\nfull = np.asarray(_)\n"
                       "float(full[-1, -1]), full.shape, float(_.sum()) == float(full.sum())")
    assert out.error is None, out.error
    assert out.texts == ["(67108864.0, (8192, 8192), True)"]
    run(cluster, "del big")


def test_a_value_on_one_processs_devices_only_is_shown_once(cluster):
    """A mesh of jax.devices()[:2] (as JAX's shard_map tutorial builds it) lives on process
    0's devices only: the value is shown once, as process 0 prints it, under a line that says
    where it lives (before: rank 0's value, then the others' placeholders)."""
    out = run(cluster, "mesh2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('x',))\n"
                       "v = jax.device_put(np.arange(6.0, dtype=np.float32), "
                       "jax.sharding.NamedSharding(mesh2, P('x')))\nv")
    assert out.error is None, out.error
    assert out.stdout.startswith("(one array on the 2 devices of process 0 only: "), out.stdout
    assert len(out.stdout.splitlines()) == 1, out.stdout
    assert out.texts == ["Array([0., 1., 2., 3., 4., 5.], dtype=float32)"], out.texts


def test_a_display_of_a_global_array_shows_what_one_process_shows(cluster):
    """display(x) shows the array as one process of all the devices displays it, the same on
    every rank: once. Its corners go with the cell's reply (as a print's), once however often
    it is displayed; the display's own bundle holds no parts."""
    from spmd.wire import GLOBAL_ARRAY_MIME

    reference = one_process_reprs(["arr_sharded", "big2"], BIG2)
    out = run(cluster, "from IPython.display import display\ndisplay(arr_sharded)\n"
                       "display(arr_sharded)\n"
                       f"print({GLOBAL_ARRAY_MIME!r} in "
                       "get_ipython().display_formatter.format(arr_sharded)[0])")
    assert out.error is None, out.error
    assert out.stdout.endswith("[ranks 0-3] False\n"), out.stdout
    assert [o.get("text/plain") for o in out.outputs] == [reference["arr_sharded"]] * 2, out.outputs
    assert "\x00" not in out.stdout + out.stderr
    out = run(cluster, BIG2 + "\ndisplay(big2)")  # (summarized: its corners)
    assert out.error is None, out.error
    assert [o.get("text/plain") for o in out.outputs] == [reference["big2"]], out.outputs


# print(x) of arrays over several processes, in each way a program prints: print's arguments,
# an f-string, sep and end, stderr, repr, pprint, and a summarized 1000 x 1000 array.
PRINTS = [
    "print(arr_sharded)",
    "print(f'sum {arr_sharded.sum()} of {arr_sharded}')",
    "print(repr(arr_sharded), result_2, y, sep=' | ', end='!\\n')",
    "print('{} and {!r}'.format(arr_sharded * 2, sums))",
    "from pprint import pprint\npprint(result)",
    BIG2 + "\nprint(big2)",
]


@pytest.mark.parametrize("code", PRINTS)
def test_print_of_a_global_array_shows_what_one_process_prints(cluster, code):
    reference, _ = one_process_output(code)
    out = run(cluster, code)
    assert out.error is None, out.error
    assert unlabelled(out.stdout) == reference, out.stdout
    assert "no single process can print it" not in out.stderr  # (the hint: not true here)


def test_print_to_stderr_and_what_the_program_sees_stay_jaxs(cluster, tmp_path):
    reference, _ = one_process_output("print(arr_sharded)")
    out = run(cluster, "import sys\nprint(arr_sharded, file=sys.stderr)")
    assert out.error is None, out.error
    assert unlabelled(out.stderr) == reference, out.stderr
    # str(x) in the program (written to a file, compared) is jax's own text
    path = tmp_path / "x"
    out = run(cluster, f"open(f'{path}-{{rank}}', 'w').write(str(arr_sharded))\n"
                       f"print(open(f'{path}-{{rank}}').read())")
    assert out.stdout == "[ranks 0-3] Array(shape=(4, 8), dtype=float32)\n", out.stdout
    assert (tmp_path / "x-0").read_text() == "Array(shape=(4, 8), dtype=float32)"


def test_print_of_arrays_a_loop_makes_is_bounded_and_says_so(cluster):
    from spmd.engine.arrays.print_marks import MAX_ARRAYS

    setup = "v8 = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh8, P('x')))"
    assert run(cluster, setup).error is None
    out = run(cluster, f"for i in range({MAX_ARRAYS + 5}):\n    print(v8 + i)")
    assert out.error is None, out.error
    lines = unlabelled(out.stdout).splitlines()
    assert lines[:MAX_ARRAYS] == [str(np.arange(8.0) + i) for i in range(MAX_ARRAYS)]
    assert lines[MAX_ARRAYS:] == ["Array(shape=(8,), dtype=float32)"] * 5, lines[MAX_ARRAYS:]
    assert (f"(5 printed arrays over several processes stayed jax's placeholder: the cell "
            f"printed more than {MAX_ARRAYS} such arrays, or more than 10,000 prints of "
            "them.)") in out.stderr, out.stderr
    # the same array printed again and again travels once
    out = run(cluster, "for i in range(300):\n    print(v8)")
    assert unlabelled(out.stdout) == f"{np.arange(8.0)}\n" * 300


def test_print_where_only_one_rank_printed_keeps_the_placeholder_and_says_why(cluster):
    out = run(cluster, "%%spmd --ranks 0\nprint(arr_sharded)")
    assert out.error is None, out.error
    assert out.stdout == "[rank 0] Array(shape=(4, 8), dtype=float32)\n", out.stdout
    assert ("(1 printed array over several processes stayed jax's placeholder: a rank did not "
            "send its part of it") in out.stderr, out.stderr


def test_a_global_value_some_ranks_did_not_send_or_displayed_keeps_jaxs_placeholder(cluster):
    # only rank 0 ran the cell: its part alone is not the array (never zeros in its place)
    out = run(cluster, "%%spmd --ranks 0\narr_sharded")
    assert out.error is None, out.error
    assert out.texts == ["Array(shape=(4, 8), dtype=float32)"]
    assert out.stdout == "[rank 0]\n"
    # a display only rank 0 made: jax's placeholder, and why
    out = run(cluster, "%%spmd --ranks 0\nfrom IPython.display import display\n"
                       "display(arr_sharded)")
    assert out.outputs == [{"text/plain": "Array(shape=(4, 8), dtype=float32)"}], out.outputs
    assert ("(1 printed array over several processes stayed jax's placeholder: a rank did not "
            "send its part of it") in out.stderr, out.stderr


def test_a_global_value_under_numpys_print_everything_option(cluster):
    reference = one_process_reprs(["arr_sharded"])["arr_sharded"]
    try:
        # (threshold=inf: JSON has no inf; the printed form is still jax's)
        out = run(cluster, "np.set_printoptions(threshold=np.inf)\narr_sharded")
        assert out.error is None, out.error
        assert out.texts == [reference]
    finally:
        run(cluster, "np.set_printoptions(threshold=1000)")


def test_a_value_shown_before_a_restart_is_not_taken_for_one_shown_after(shell):
    """A rank finds the value a cell showed by its Out number and which object it was. A
    restarted rank is a new process forked from the same heap image, numbering its cells from
    1 again: the same number and the same id there name another array, which the notebook
    must not take for the old one. (Run here in the notebook's own process, as rank 0.)"""
    import numpy as np

    from spmd.engine.arrays import shards

    out = shell.user_ns.setdefault("Out", {})
    count = max(out, default=0) + 1000
    out[count] = np.arange(3.0)
    try:
        token = shards.shown_token(out[count])
        assert shards.fetch_shown("Out[x]", {0: (count, token)}, 1 << 20)
        restarted = [token[0] + 1, token[1]]  # (the same id, in another process)
        with pytest.raises(KeyError, match="no longer on this rank"):
            shards.fetch_shown("Out[x]", {0: (count, restarted)}, 1 << 20)
    finally:
        del out[count]
