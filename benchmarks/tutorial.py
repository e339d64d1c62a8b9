"""JAX's sharding tutorial ("Introduction to parallel programming", the seed 001), its cells
unchanged, in the SPMD kernel on 4 processes x 2 CPU devices, beside one process with the same
8 devices in a plain Python kernel: for each cell, whether it ran and whether it printed what
the one process printed.

    python -m benchmarks.tutorial [--auto-axes]

(``--auto-axes``: with the one change jax >= 0.7 asks of the tutorial, its meshes' axes Auto.)

A rank label that covers every rank (``[ranks 0-3] ``, or a line of its own) and the line that
says a value is one array over several processes are the notebook's own words, not the
cell's: they are left out of the comparison. Device names differ between one process and
four (``CPU 2048`` is process 1's first device), so cells that print devices cannot match.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from jupyter_client.manager import start_new_kernel

from spmd.kernel.kernelspec import install

CELLS = [
    "import jax\njax.devices()",
    "import jax.numpy as jnp\narr = jnp.arange(32.0).reshape(4, 8)\narr.devices()",
    "arr.sharding",
    "jax.debug.visualize_array_sharding(arr)",
    "from jax.sharding import PartitionSpec as P\n\nmesh = jax.make_mesh((2, 4), ('x', 'y'))\n"
    "sharding = jax.sharding.NamedSharding(mesh, P('x', 'y'))\nprint(sharding)",
    "arr_sharded = jax.device_put(arr, sharding)\n\nprint(arr_sharded)\n"
    "jax.debug.visualize_array_sharding(arr_sharded)",
    "@jax.jit\ndef f_elementwise(x):\n  return 2 * jnp.sin(x) + 1\n\n"
    "result = f_elementwise(arr_sharded)\n\n"
    "print(\"shardings match:\", result.sharding == arr_sharded.sharding)",
    "@jax.jit\ndef f_contract(x):\n  return x.sum(axis=0)\n\nresult = f_contract(arr_sharded)\n"
    "jax.debug.visualize_array_sharding(result)\nprint(result)",
    "@jax.jit\ndef f_contract_2(x):\n  out = x.sum(axis=0)\n"
    "  sharding = jax.sharding.NamedSharding(mesh, P('x'))\n"
    "  return jax.lax.with_sharding_constraint(out, sharding)\n\n"
    "result = f_contract_2(arr_sharded)\njax.debug.visualize_array_sharding(result)\n"
    "print(result)",
    "from jax.experimental.shard_map import shard_map\nmesh = jax.make_mesh((8,), ('x',))\n\n"
    "f_elementwise_sharded = shard_map(\n    f_elementwise,\n    mesh=mesh,\n"
    "    in_specs=P('x'),\n    out_specs=P('x'))\n\narr = jnp.arange(32)\n"
    "f_elementwise_sharded(arr)",
    "x = jnp.arange(32)\nprint(f\"global shape: {x.shape=}\")\n\ndef f(x):\n"
    "  print(f\"device local shape: {x.shape=}\")\n  return x * 2\n\n"
    "y = shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'))(x)",
    "def f(x):\n  return jnp.sum(x, keepdims=True)\n\n"
    "shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'))(x)",
    "def f(x):\n  sum_in_shard = x.sum()\n  return jax.lax.psum(sum_in_shard, 'x')\n\n"
    "shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P())(x)",
    "@jax.jit\ndef layer(x, weights, bias):\n  return jax.nn.sigmoid(x @ weights + bias)",
    "import numpy as np\nrng = np.random.default_rng(0)\n\nx = rng.normal(size=(32,))\n"
    "weights = rng.normal(size=(32, 4))\nbias = rng.normal(size=(4,))\n\n"
    "layer(x, weights, bias)",
    "mesh = jax.make_mesh((8,), ('x',))\nsharding = jax.sharding.NamedSharding(mesh, P('x'))\n\n"
    "x_sharded = jax.device_put(x, sharding)\n"
    "weights_sharded = jax.device_put(weights, sharding)\n\n"
    "layer(x_sharded, weights_sharded, bias)",
    "@jax.jit\ndef layer_auto(x, weights, bias):\n"
    "  x = jax.lax.with_sharding_constraint(x, sharding)\n"
    "  weights = jax.lax.with_sharding_constraint(weights, sharding)\n"
    "  return layer(x, weights, bias)\n\nlayer_auto(x, weights, bias)  # pass in unsharded inputs",
    "from functools import partial\n\n@jax.jit\n@partial(shard_map, mesh=mesh,\n"
    "         in_specs=(P('x'), P('x', None), P(None)),\n         out_specs=P(None))\n"
    "def layer_sharded(x, weights, bias):\n"
    "  return jax.nn.sigmoid(jax.lax.psum(x @ weights, 'x') + bias)\n\n"
    "layer_sharded(x, weights, bias)",
]

_EVERY_RANK = re.compile(r"^\[ranks 0-3\](?: |\n)", re.M)
_ABOUT = re.compile(r"^\(one array over \d+ processes, .*\)\n", re.M)


def _run_cells(kernel: str, cells: list[str], env: dict | None = None) -> list[tuple[bool, str]]:
    """(ran without an error, what it showed as text) for each cell, in one kernel."""
    km, kc = start_new_kernel(kernel_name=kernel, **({"env": env} if env else {}))
    shown: list[tuple[bool, str]] = []
    try:
        for code in cells:
            texts: list[str] = []

            def keep(msg, texts=texts):
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream" and content["name"] == "stdout":
                    texts.append(content["text"])
                elif kind in ("display_data", "execute_result"):
                    texts.append(content["data"].get("text/plain", "") + "\n")

            reply = kc.execute_interactive(code, timeout=300, output_hook=keep)
            ok = reply["content"]["status"] == "ok"
            error = "" if ok else f"{reply['content'].get('ename')}: {reply['content'].get('evalue')}"
            shown.append((ok, "".join(texts) if ok else error))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return shown


def _as_one_process(text: str) -> str:
    return _EVERY_RANK.sub("", _ABOUT.sub("", text))


def _auto_axes(cell: str) -> str:
    """The one change jax >= 0.7 asks of the tutorial: its meshes with Auto axes (the default
    became Explicit, which with_sharding_constraint and shard_map's in_specs refuse here)."""
    return re.sub(r"jax\.make_mesh\(\(([^)]*)\), (\([^)]*\))\)",
                  lambda m: f"jax.make_mesh(({m.group(1)}), {m.group(2)}, axis_types=("
                            f"jax.sharding.AxisType.Auto,) * {m.group(1).count(',') + (0 if m.group(1).endswith(',') else 1)})",
                  cell)


def main() -> None:
    cells = CELLS
    if "--auto-axes" in sys.argv:
        cells = [_auto_axes(c) for c in CELLS]
    with tempfile.TemporaryDirectory(prefix="spmd-tutorial-") as folder:
        os.environ["JUPYTER_PATH"] = os.environ["JUPYTER_DATA_DIR"] = folder
        install("spmd-tutorial", user=True, processes=4, devices_per_process=2)
        ours = _run_cells("spmd-tutorial", cells)
    one = _run_cells("python3", ["import jax\njax.config.update('jax_num_cpu_devices', 8)",
                                 *cells])[1:]
    ran = same = alone = 0
    for i, ((ok, text), (one_ok, reference)) in enumerate(zip(ours, one), 1):
        matches = ok and one_ok and _as_one_process(text) == reference
        ran += ok
        same += matches
        alone += one_ok
        first = cells[i - 1].splitlines()[-1][:50]
        print(f"{i:2} one process: {'ran ' if one_ok else 'FAIL'}  4 processes: "
              f"{'ran ' if ok else 'FAIL'} {'same' if matches else '    '}  {first}")
        if not ok:
            print(f"     {text.splitlines()[0][:150] if text else ''}")
    print(f"{alone} of {len(CELLS)} cells ran in one process; on 4 processes {ran} ran and "
          f"{same} printed what one process prints.")


if __name__ == "__main__":
    main()
