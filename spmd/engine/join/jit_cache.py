"""On a rank: jax's persistent compilation cache, in a folder the ranks share.

jax writes cache entries from process 0 only (to spare shared file systems like GCS many
writers of one entry), expecting the other processes to find the same keys. Here they do not:
a computation's key differs from process to process (seen for cells on local arrays and for
a jit across all 8 devices of 4 processes alike: each process has its own key). So after a
restart, rank 0 read every cell from the cache while the others compiled it again, a second
or more behind: time lost on every cell (the watchdog waits for a rank that is compiling).

So here every process writes its own entries too. Keys are per process, so no two processes
write one entry; the folder is on this machine or one the user named. Where jax's internals
differ from what this expects, nothing is patched and the cache works as jax made it.
"""

from __future__ import annotations

import functools


def enable(folder: str) -> None:
    """Use ``folder`` as jax's persistent compilation cache, for every compiled cell."""
    import jax

    jax.config.update("jax_compilation_cache_dir", folder)
    # every compiled cell, however quick to compile: a restart re-runs them all
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _let_every_process_write_its_own()


def _let_every_process_write_its_own() -> None:
    try:
        from jax._src import compilation_cache, compiler, distributed
    except ImportError:
        return
    write_fn = getattr(compiler, "_cache_write", None)
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if write_fn is None or put is None or hasattr(write_fn, "spmd"):
        return

    @functools.wraps(write_fn)
    def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                    host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks:
            # (jax's own rules: process 0 writes; computations with host callbacks are not
            # cached)
            return write_fn(cache_key, compile_time_secs, module_name, backend, executable,
                            host_callbacks)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception:  # a cache that cannot be written only costs a compile
            return None
        return None

    cache_write.spmd = True
    compiler._cache_write = cache_write
