"""The judge of "print(x) shows what one process shows" on 2 processes x 4 CPU devices: the
corpus of cells that print arrays (print_corpus.py), each run on real ranks and in one
process of all 8 devices; the notebook's text, rank labels removed, must be that one
process's. Cells whose ranks print different things (a rank-dependent branch) are checked
against what each rank can show: the arrays every rank printed at the same place are put
together, the others stay jax's placeholder with a line that says why, and no value is ever
put together from two arrays. (test_printed_4x2.py: the corpus on 4 processes x 2.)"""

from __future__ import annotations

import re

import pytest
from conftest import ready_cluster, report, run
from print_corpus import SETUP, check_corpus, one_process

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def two(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 4", SETUP)


def test_the_corpus_on_two_processes_prints_what_one_process_prints(two):
    check_corpus(two, 2)


def test_arrays_some_processes_hold_are_never_shown_with_another_arrays_value(two):
    """Prints whose holders' text cannot be found where the others' placeholder is (pprint's
    second repr, a transformed text, a text past what a rank sends): each line is what one
    process prints, or keeps jax's placeholder; never another array's value (before: rank 1
    showed the next array's value in each)."""
    cells = [
        "from pprint import pprint\n"
        "pprint({'a': held([[0., 1.], [2., 3.]]), 'b': held([[100., 101.], [102., 103.]]), "
        "'c': held([[7., 8.], [9., 10.]])})",
        "import textwrap\nr1 = held(np.random.default_rng(0).normal(size=(1, 12)))\n"
        "z1 = held(np.zeros((1, 12)))\nfor w in [r1, z1]:\n"
        "    print(textwrap.indent(str(w), '> '))",
        # (a text past what a holder sends: one line of 5,000 numbers, ~80,000 characters)
        "big1 = held(np.random.default_rng(1).normal(size=5000))\nsmall1 = held(np.zeros(5000))\n"
        "with np.printoptions(threshold=10**7, linewidth=10**6):\n"
        "    for w in [big1, small1]:\n        print(w)",
    ]
    for cell, (expected, _) in zip(cells, one_process(cells)):
        out = run(two, cell)
        assert out.error is None, report(out)
        for rank in (0, 1):
            shown = ranks_text(out.stdout, rank, 2)
            if "Array(shape=" in shown:  # (kept: each line a placeholder or the value)
                lines = [line for line in shown.splitlines() if "Array(shape=" not in line]
                assert set(lines) <= set(expected.splitlines()), (cell, shown)
            else:  # (the values, in order; an indent's "> " is on the placeholder's one line)
                words = [w for w in shown.split() if w != ">"]
                assert words == [w for w in expected.split() if w != ">"], (
                    cell, rank, shown[:2000], expected[:2000])


def ranks_text(stdout: str, rank: int, n: int) -> str:
    """What ``rank`` printed, from the grouped output (its labels removed)."""
    label = re.compile(r"^\[ranks? ([0-9, -]+)\] ?(.*)$")
    mine, keep = [], False
    for line in stdout.splitlines(keepends=True):
        found = label.match(line)
        if found:
            who = set()
            for part in found.group(1).split(","):
                lo, _, hi = part.strip().partition("-")
                who |= set(range(int(lo), int(hi or lo) + 1))
            keep = rank in who
            line = found.group(2) + ("\n" if found.group(2) else "")
        if keep and line:
            mine.append(line)
    return "".join(mine)


def test_arrays_printed_in_an_order_that_differs_by_rank_are_never_mixed(two):
    """Rank 0 prints params, then every rank prints grads: grads is put together from every
    rank's grads; params, which rank 1 did not print, stays jax's placeholder and one line
    says why (before: rank 0's half of params and rank 1's half of grads, named params)."""
    out = run(two, "if rank == 0:\n    print('params', params)\nprint('grads', grads)")
    assert out.error is None, report(out)
    expected_grads = one_process(["print('grads', grads)"])[0][0]
    assert out.stdout == ("[rank 0]\nparams Array(shape=(8,), dtype=float32)\n"
                          f"{expected_grads}[rank 1] {expected_grads}"), out.stdout
    assert ("printed array over several processes stayed jax's placeholder: a rank did not "
            "send its part of it (it did not print it at that place in the cell") in out.stderr
    # in a loop that rank 1 enters once less: the n-th print at a place is matched with the
    # n-th of every rank, never with the print of another step
    out = run(two, "for i in range(3):\n    if rank == 1 and i == 0:\n        continue\n"
                   "    print(i, params + i)")
    assert out.error is None, report(out)
    steps = one_process(["for i in range(3):\n    print(i, params + i)"])[0][0].splitlines()
    assert out.stdout.splitlines() == [
        "[rank 0]", "0 Array(shape=(8,), dtype=float32)", steps[1], steps[2],
        "[rank 1]", steps[1], steps[2]], out.stdout


def test_an_array_printed_on_one_rank_only_stays_a_placeholder_and_says_why(two):
    out = run(two, "if rank == 1:\n    print(params)")
    assert out.error is None, report(out)
    assert out.stdout == "[rank 1] Array(shape=(8,), dtype=float32)\n", out.stdout
    assert "a rank did not send its part of it" in out.stderr, out.stderr


def test_different_arrays_printed_at_one_place_stay_placeholders_and_say_why(two):
    """At one print, rank 0 prints one array and rank 1 another, of another dtype, then of
    another shape: no value is made of the two; each rank keeps jax's placeholder, and one
    line says why (without the check: a wrong value, then an IndexError in the notebook)."""
    for other, placeholder in [("params.astype(jnp.int32)", "Array(shape=(8,), dtype=int32)"),
                               ("wide", "Array(shape=(2, 8), dtype=float32)")]:
        out = run(two, f"other = {other}\nprint(params if rank == 0 else other)")
        assert out.error is None, report(out)
        assert out.stdout == ("[rank 0] Array(shape=(8,), dtype=float32)\n"
                              f"[rank 1] {placeholder}\n"), out.stdout
        assert "the ranks printed different arrays at that place in the cell" in out.stderr, (
            out.stderr)


def test_printing_an_array_keeps_nothing_alive(two):
    """After print(x) (and after repr(x) that no print shows, as a logger makes it), ``del x``
    frees the array at once, as in plain jax: nothing here holds it until the cell's reply or
    across cells."""
    out = run(two, "import gc, weakref, logging\n"
                   "x = params * 3\nalive = weakref.ref(x)\nprint(x)\n"
                   "logging.getLogger('quiet').debug('%r', x); text = repr(x)\n"
                   "del x\ngc.collect()\nprint('freed', alive() is None)")
    assert out.error is None, report(out)
    assert out.stdout.endswith("freed True\n"), out.stdout
    # noted by a repr in one cell, freed in the next
    assert run(two, "y = grads * 3\nalive = weakref.ref(y)\ntext = repr(y)").error is None
    out = run(two, "del y\ngc.collect()\nprint('freed', alive() is None)")
    assert out.stdout == "[ranks 0-1] freed True\n", out.stdout


def test_jax_debug_print_inside_jit_shows_the_value_one_process_prints(two):
    """jax.debug.print of a sharded value runs its callback on process 0's first device with
    the whole value: rank 0 prints what one process prints."""
    cell = ("@jax.jit\ndef g(v):\n    jax.debug.print('v {v}', v=v)\n    return v\n"
            "_ = g(params).block_until_ready()")
    out = run(two, cell)
    assert out.error is None, report(out)
    # (on the device jax runs the callback on: process 0's, as the label says)
    assert out.stdout == f"[rank 0] {one_process([cell])[0][0]}", out.stdout


def generated_program(seed: int, n: int) -> tuple[str, set[str]]:
    """A cell of a few prints, each under a control flow drawn at random: on every rank, on
    some ranks only, in a loop that some rank leaves a step of, through a function. Each
    print starts with its own tag; the tags every rank prints are returned too."""
    import random

    pick = random.Random(seed)
    # (elementwise: no collective, which a rank-dependent branch would leave waiting)
    arrays = ["params", "grads", "params * 2", "grads - params", "params * grads"]
    lines, everywhere = ["def show(tag, a):", "    print(tag, a)"], set()
    for k in range(6):
        array, tag = pick.choice(arrays), f"s{k}"
        kind = pick.choice(["all", "some", "loop", "function", "some loop"])
        some = pick.choice([f"rank == {pick.randrange(n)}", "rank % 2 == 1", f"rank != {n - 1}"])
        if kind == "all":
            lines.append(f"print('{tag}', {array})")
            everywhere.add(tag)
        elif kind == "some":
            lines += [f"if {some}:", f"    print('{tag}', {array})"]
        elif kind == "function":
            lines.append(f"show('{tag}', {array})")
            everywhere.add(tag)
        else:
            skip = pick.randrange(3)
            guard = f"rank == {pick.randrange(n)} and i == {skip}" if kind == "loop" else \
                f"not ({some})"
            lines += ["for i in range(3):", f"    if {guard}:", "        continue",
                      f"    print('{tag}', i, {array} + i)"]
    return "\n".join(lines), everywhere


@pytest.mark.parametrize("seed", range(6))
def test_generated_control_flows_never_show_a_wrong_value(two, seed):
    """Every printed line is the value one process prints at that print, or jax's
    placeholder where not every rank printed it there; a print every rank made is never a
    placeholder."""

    cell, everywhere = generated_program(seed, 2)
    out = run(two, cell)
    assert out.error is None, report(out)
    reference = {}
    for line in one_process([cell])[0][0].splitlines():
        reference.setdefault(" ".join(line.split()[:2]) if " " in line else line, set()).add(line)
    label = re.compile(r"^\[ranks? [0-9, -]+\]\s?")
    for line in out.stdout.splitlines():
        line = label.sub("", line)
        if not line:
            continue
        tag = line.split()[0]
        if line.endswith("Array(shape=(8,), dtype=float32)"):
            assert tag not in everywhere, (cell, out.stdout)
            continue
        keys = [" ".join(line.split()[:2]), tag]
        assert any(line in reference.get(key, ()) for key in keys), (cell, line, out.stdout)


def test_prints_inside_a_module_function_are_matched_by_their_own_line(two, tmp_path):
    """Training code lives in modules: ``report()`` of a module, called from one cell line,
    prints params on rank 0 only, then grads on every rank. Each line of the function is a
    place of its own, so grads is put together from grads alone, and params stays a
    placeholder."""
    (tmp_path / "trainlib_printed.py").write_text(
        "import jax\n\ndef report(params, grads):\n    if jax.process_index() == 0:\n"
        "        print('params', params)\n    print('grads', grads)\n")
    out = run(two, f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
                   "import trainlib_printed\ntrainlib_printed.report(params, grads)")
    assert out.error is None, report(out)
    expected = one_process(["print('grads', grads)"])[0][0]
    assert out.stdout == ("[rank 0]\nparams Array(shape=(8,), dtype=float32)\n"
                          f"{expected}[rank 1] {expected}"), out.stdout


def test_prints_from_a_pool_or_an_old_str_are_never_put_together_wrongly(two):
    """A pool runs whichever task comes next on each rank, so its workers' prints keep jax's
    placeholder; so does a placeholder written beside a str(x) kept from before, where which
    one is the print's cannot be told. Never a value of another array."""
    # (one print at a time: print writes its words one by one, and two threads' words would
    # interleave on one line, as in plain Python: 'tasktask  Array(...)')
    out = run(two, "from concurrent.futures import ThreadPoolExecutor\n"
                   "one_at_a_time = threading.Lock()\n"
                   "def task(i):\n    with one_at_a_time:\n        print('task', params * i)\n"
                   "with ThreadPoolExecutor(2) as pool:\n"
                   "    list(pool.map(task, range(4)))")
    assert out.error is None, report(out)
    tasks = [line for line in out.stdout.splitlines() if "task" in line]
    assert tasks and all(line.endswith("task Array(shape=(8,), dtype=float32)")
                         for line in tasks), out.stdout
    out = run(two, "before = str(grads)\nprint(f'now {params} before {before}')")
    assert out.stdout == ("[ranks 0-1] now Array(shape=(8,), dtype=float32) before "
                          "Array(shape=(8,), dtype=float32)\n"), out.stdout


def test_two_placeholders_made_before_either_is_written_are_never_swapped(two):
    """print(f'params {params}', f'grads {grads}') makes both texts before the first is
    written: which repr is which placeholder cannot be told from the first write alone, so
    neither is put together from the other's parts."""
    out = run(two, "print(f'params {params}', f'grads {grads}')")
    assert out.error is None, report(out)
    expected = one_process(["print(f'params {params}', f'grads {grads}')"])[0][0]
    text = out.stdout.removeprefix("[ranks 0-1] ")
    assert text in (expected, "params Array(shape=(8,), dtype=float32) grads "
                              "Array(shape=(8,), dtype=float32)\n"), out.stdout
    assert "-0. -1." not in text.split("grads")[0], out.stdout  # (grads' value as params)
