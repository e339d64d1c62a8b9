"""On a rank: arrays over several processes (jax.Array, torch DTensor). What this process
holds of one, as plain data (shards.py, torch_shards.py), a cell's value that is one
(results.py), ``print(x)`` of one and where it is (print_marks.py, print_place.py), jax's
device_put check done as one process (device_put.py), and an error on a mesh of other
processes' devices (mesh_errors.py)."""
