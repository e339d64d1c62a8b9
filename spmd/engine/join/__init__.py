"""A rank joining the job: which rank it is and its GPUs (placement.py), the addresses it
chooses (address.py), torch's process group (torch_group.py), jax's compilation cache
(jit_cache.py), and a cell that does the start-up again: jax's devices or job, torch's
group (started.py), or a variable jax reads at import (import_env.py)."""
