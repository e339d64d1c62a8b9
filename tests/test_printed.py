"""The judge of "print(x) shows what one process shows": a corpus of cells that print arrays
over several processes, each run on real ranks (2 processes x 4 CPU devices, and 4 x 2) and in
one process of all 8 devices; the notebook's text, rank labels removed, must be that one
process's. Cells whose ranks print different things (a rank-dependent branch) are checked
against what each rank can show: the arrays every rank printed at the same place are put
together, the others stay jax's placeholder with a line that says why, and no value is ever
put together from two arrays."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ready_cluster, report, run

pytestmark = pytest.mark.timeout(300)

SETUP = """
import threading
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
rank = jax.process_index()
auto = (jax.sharding.AxisType.Auto,)  # (the meshes jax's guides were written for)
mesh = jax.make_mesh((2, 4), ('x', 'y'), axis_types=auto * 2)
mesh8 = jax.make_mesh((8,), ('x',), axis_types=auto)
params = jax.device_put(jnp.arange(8.0), NamedSharding(mesh8, P('x')))
grads = jax.device_put(-jnp.arange(8.0), NamedSharding(mesh8, P('x')))
wide = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P('x', 'y')))
big = jax.device_put(jnp.arange(1000.0 * 1000).reshape(1000, 1000), NamedSharding(mesh8, P('x')))
# meshes over some processes' devices (as JAX's tutorials make them: the first devices):
# first2 is process 0's on 2 x 4 and on 4 x 2; first4, process 0's on 2 x 4, 0-1's on 4 x 2
first2 = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('x',))
first4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('x',))
on_first2 = jax.device_put(jnp.arange(4.0), NamedSharding(first2, P('x')))
copied = jax.device_put(jnp.arange(3.0) + 0.5, NamedSharding(first4, P()))
split = jax.device_put(jnp.arange(8.0), NamedSharding(first4, P('x')))
double = jax.jit(lambda a: a * 2 + 1)
def held(value):  # (a value copied on process 0's devices only)
    return jax.device_put(np.asarray(value), NamedSharding(first2, P()))
"""

# Cells that print the same on every rank: the notebook shows them once, as one process does.
CORPUS = {
    "print": "print(params)",
    "two arrays in one print": "print('params', params, 'grads', grads)",
    "f-string": "print(f'{params} and {grads!r} and {wide}')",
    "format spec of its own": "print(f'{params.sum():.2f}')",
    "containers": "print([params, grads], {'w': wide}, (grads,))",
    "repr and pprint": "from pprint import pprint\nprint(repr(grads))\npprint(wide)",
    "stderr": "import sys\nprint(grads, file=sys.stderr)\nprint(params)",
    "a loop of new arrays": "for i in range(3):\n    print(i, params + i)",
    "a loop rebinding one name": "v = params\nfor i in range(3):\n    v = v.at[i].set(100 + i)\n"
                                 "    print(v)",
    "the same array again and again": "for i in range(50):\n    print(grads)",
    "two places in a loop": "for i in range(2):\n    print('p', params * i)\n"
                            "    print('g', grads * i)",
    "a function called from two lines": "def show(a):\n    print('shown', a)\n"
                                        "show(params)\nshow(grads)",
    "a thread": "t = threading.Thread(target=lambda: print('from a thread', grads))\n"
                "t.start()\nt.join()",
    "a large summarized array": "print(big)\nprint(big + 1)",
    "a replicated result": "print(params.sum(), jnp.dot(params, grads))",
    "print options": "with np.printoptions(precision=2):\n    print(params / 3)\n"
                     "print(params / 3)",
}


# Cells that print arrays some processes hold (a mesh of the first devices): the ranks that
# hold none print jax's placeholder, shown as the holders print the array, with one line
# (on stderr) that names them.
HELD = {
    "a check on a mesh of some processes": "print(jnp.allclose(double(split), split * 2 + 1))",
    "every form": "print(f'{copied!r} {copied} {copied.sum():.2f} {on_first2}')",
    "two in one print": "print(on_first2, double(copied))",
    "a loop": "for i in range(2):\n    print(i, on_first2 * i, copied + i)",
    "a function": "def show(a):\n    print('shown', a)\nshow(copied)\nshow(on_first2)",
    "a container": "print([copied, on_first2], {'c': copied})",
    "a value's text in the print's words": "c, t = held(7), held(3)\n"
                                           "print(f'batch 3: correct {c} of {t}')",
    "one value's text starting another's": "for a, b in [(held(42), held(4)), "
                                           "(held(53), held(5))]:\n    print(f'{a} {b}')",
}
HELD_LINE = re.compile(r"^(\(The arrays? printed here lives? on the devices of process(es)? "
                       r"[0-9-]+ only; the other ranks hold none of (it|them)\.\)\n)+")


def one_process(cells: list[str]) -> list[str]:
    """What each cell prints (stdout + stderr) in one process with all 8 devices."""
    marker = "\x01cell\x01"
    program = ["import jax, sys", "jax.config.update('jax_num_cpu_devices', 8)", SETUP]
    for cell in cells:
        program += [f"print({marker!r}, flush=True)", f"print({marker!r}, file=sys.stderr, "
                    "flush=True)", cell, "sys.stdout.flush(); sys.stderr.flush()"]
    done = subprocess.run([sys.executable, "-c", "\n".join(program)], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    outs = done.stdout.split(marker + "\n")[1:]
    errs = done.stderr.split(marker + "\n")[1:]
    return [(o, e) for o, e in zip(outs, errs)]


def unlabelled(text: str, n: int) -> str:
    """The text of one output shown once for every rank, without its label."""
    label = f"[ranks 0-{n - 1}]"
    if not text:
        return text
    if not text.startswith(label):
        return None  # (not once for every rank: check_corpus names the cell)
    return text[len(label) + 1:]


def check_corpus(shell, n: int) -> None:
    corpus = {**CORPUS, **HELD}
    reference = one_process(list(corpus.values()))
    wrong = []
    for (name, cell), (stdout, stderr) in zip(corpus.items(), reference):
        out = run(shell, cell)
        assert out.error is None, (name, report(out))
        said = HELD_LINE.match(out.stderr) if name in HELD else None
        if name in HELD and not said:
            wrong.append(f"{name}: no line names the processes that hold it: {out.stderr!r}")
        errors = out.stderr[said.end():] if said else out.stderr
        shown = (unlabelled(out.stdout, n), unlabelled(errors, n))
        if shown != (stdout, stderr) or None in shown:
            wrong.append(f"{name}:\n  notebook: {(out.stdout, out.stderr)!r}\n  one process: "
                         f"{(stdout, stderr)!r}")
    assert not wrong, "\n".join(wrong)


@pytest.fixture
def two(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 4", SETUP)


def test_the_corpus_on_two_processes_prints_what_one_process_prints(two):
    check_corpus(two, 2)


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
    out = run(two, "from concurrent.futures import ThreadPoolExecutor\n"
                   "with ThreadPoolExecutor(2) as pool:\n"
                   "    list(pool.map(lambda i: print('task', params * i), range(4)))")
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
