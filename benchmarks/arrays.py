"""A global array in a cell: one jax.Array over 4 processes as a cell's value (small, and
8192x8192, of which only the printed corners travel), and in ``print()`` and ``display()``
1,000 times in a loop; the same for one torch DTensor. Each beside the same cell without the
global array (a cell ending in None, an array each process holds whole).

Each function takes the ``Bench`` (bench.py) and records its figures into it; run.py calls
them in turn.
"""

from __future__ import annotations

import time


def value_cells(bench, cells: int) -> None:
    """A cell whose value is one jax.Array over 4 processes (8x4, and 8192x8192: only its
    printed corners travel), beside the same cell ending in None."""
    bench.cell("%spmd start -n 4 -d 2")
    bench.cell(
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "mesh = jax.make_mesh((4, 2), ('x', 'y'))\n"
        "small = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P('x', 'y')))\n"
        "big = jax.jit(lambda: jnp.arange(8192 * 8192, dtype=jnp.float32).reshape(8192, 8192), "
        "out_shardings=NamedSharding(mesh, P('x', 'y')))()"
    )
    try:
        for _ in range(cells):
            for name, code in (("none", "small; None"), ("global_8x4", "small"),
                               ("global_8192sq", "big")):
                t0 = time.perf_counter()
                bench.cell(code)
                bench.record(f"value_cell/{name}", time.perf_counter() - t0)
    finally:
        bench.cell("%spmd stop")


def printed_loops(bench, rounds: int) -> None:
    """A loop that prints an array over 4 processes 1,000 times (the same one, and a new
    one each step: past the 100 a cell rebuilds), one that prints an array processes 0-1
    hold (the others print its holders' text), and one that displays it 1,000 times,
    beside the same loops with an array each process holds whole."""
    bench.cell("%spmd start -n 4 -d 2")
    bench.cell(
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "mesh = jax.make_mesh((8,), ('x',))\n"
        "spread = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P('x')))\n"
        "local = jnp.arange(8.0)\n"
        "import numpy as np\n"  # (copied on processes 0-1's devices: the others hold none)
        "first4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('x',))\n"
        "held = jax.device_put(jnp.arange(8.0), NamedSharding(first4, P()))"
    )
    try:
        for _ in range(rounds):
            for name, code in (("local", "for i in range(1000):\n    print(local)"),
                               ("global_same", "for i in range(1000):\n    print(spread)"),
                               ("global_new", "for i in range(1000):\n    print(spread + i)"),
                               ("local_new", "for i in range(1000):\n    print(local + i)"),
                               ("held_same", "for i in range(1000):\n    print(held)"),
                               ("display_local", "for i in range(1000):\n    display(local)"),
                               ("display_global", "for i in range(1000):\n    display(spread)")):
                t0 = time.perf_counter()
                bench.cell(code)
                bench.record(f"print_loop_1000/{name}", time.perf_counter() - t0)
    finally:
        bench.cell("%spmd stop")


def dtensor_value_cells(bench, cells: int) -> None:
    """A cell whose value is one torch DTensor over 4 processes (8x4, and 2048x2048:
    only its printed corners travel), beside the same cell ending in None; and a loop
    printing the 8x4 one 1,000 times, beside one printing a tensor each process holds."""
    bench.cell("%spmd start -n 4 --backend torch")
    bench.cell(
        "import torch\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import distribute_tensor, Shard\n"
        "mesh = init_device_mesh('cpu', (4,))\n"
        "small = distribute_tensor(torch.arange(32.).reshape(8, 4), mesh, [Shard(0)])\n"
        "big = distribute_tensor(torch.ones(2048, 2048), mesh, [Shard(1)])\n"
        "whole = torch.arange(32.).reshape(8, 4)"
    )
    try:
        for _ in range(cells):
            for name, code in (("dtensor_none", "small; None"), ("dtensor_8x4", "small"),
                               ("dtensor_2048sq", "big")):
                t0 = time.perf_counter()
                bench.cell(code)
                bench.record(f"value_cell/{name}", time.perf_counter() - t0)
        for _ in range(3):  # (print of a DTensor 1,000 times, beside a tensor each holds)
            for name, code in (("tensor", "for i in range(1000):\n    print(whole)"),
                               ("dtensor", "for i in range(1000):\n    print(small)")):
                t0 = time.perf_counter()
                bench.cell(code)
                bench.record(f"print_loop_1000/{name}", time.perf_counter() - t0)
    finally:
        bench.cell("%spmd stop")
