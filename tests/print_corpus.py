"""The judge of "print(x) shows what one process shows", shared by the printed tests: the arrays
every cell prints (SETUP, made the same on 2 processes x 4 CPU devices, 4 x 2, and one process
of all 8), a corpus of cells that print them, and what one process of all 8 devices prints
for each cell, which the notebook's text, rank labels removed, must be."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import report, run

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
