"""What the arrays tests share (test_arrays, test_arrays_on_two_processes): the seed's
parallel-programming examples (001) as the cell that sets up the ranks, a 1000 x 1000 array
that prints summarized, what one process with all the cluster's 8 CPU devices prints of them
(the reference a cluster's print must match), and a grouped output without its rank label."""

from __future__ import annotations

SEED = """
import time
import jax, jax.numpy as jnp, numpy as np
from functools import partial
from jax.sharding import PartitionSpec as P
from jax.experimental.shard_map import shard_map
rank = jax.process_index()
arr = jnp.arange(32.0).reshape(4, 8)
# jax >= 0.7 makes Explicit mesh axes by default; the guide's with_sharding_constraint
# needs the Auto axes it was written for.
mesh = jax.make_mesh((2, 4), ('x', 'y'), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sharding = jax.sharding.NamedSharding(mesh, P('x', 'y'))
arr_sharded = jax.device_put(arr, sharding)

@jax.jit
def f_contract(x):
  return x.sum(axis=0)

result = f_contract(arr_sharded)

@jax.jit
def f_contract_2(x):
  out = x.sum(axis=0)
  sharding = jax.sharding.NamedSharding(mesh, P('x'))
  return jax.lax.with_sharding_constraint(out, sharding)

result_2 = f_contract_2(arr_sharded)

mesh8 = jax.make_mesh((8,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))
x = jnp.arange(32)
y = shard_map(lambda x: x * 2, mesh=mesh8, in_specs=P('x'), out_specs=P('x'))(x)
sums = shard_map(lambda x: jnp.sum(x, keepdims=True), mesh=mesh8, in_specs=P('x'), out_specs=P('x'))(x)
total = shard_map(lambda x: jax.lax.psum(x.sum(), 'x'), mesh=mesh8, in_specs=P('x'), out_specs=P())(x)

# beyond the guide: fully replicated, and on the devices of processes 0-1 only
everywhere = jax.device_put(arr, jax.sharding.NamedSharding(mesh, P()))
sub = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('a', 'b'))
half = jax.device_put(jnp.arange(16.0).reshape(4, 4), jax.sharding.NamedSharding(sub, P('a', 'b')))
"""

BIG2 = ("big2 = jax.device_put(jnp.arange(1000 * 1000, dtype=jnp.float32).reshape(1000, 1000), "
        "sharding)")


def one_process_reprs(exprs: list[str], setup: str = "") -> dict[str, str]:
    """What one process with the cluster's 8 devices prints for each of ``exprs`` after SEED
    (and ``setup``)."""
    import json
    import subprocess
    import sys

    code = (
        "import jax\njax.config.update('jax_num_cpu_devices', 8)\n" + SEED + "\n" + setup
        + f"\nimport json\nprint(json.dumps({{e: repr(eval(e)) for e in {exprs!r}}}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def one_process_output(code: str) -> tuple[str, str]:
    """(stdout, stderr) of ``code`` after SEED in one process with the cluster's 8 devices."""
    import subprocess
    import sys

    program = "import jax\njax.config.update('jax_num_cpu_devices', 8)\n" + SEED + "\n" + code
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def unlabelled(text: str, label: str = "[ranks 0-3]") -> str:
    """A grouped output's text without its rank label (on its own line, or before one)."""
    if text.startswith(label + "\n"):
        return text[len(label) + 1:]
    assert text.startswith(label + " "), text
    return text[len(label) + 1:]
