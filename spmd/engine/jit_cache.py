"""On a rank: jax's persistent compilation cache, in a folder the ranks share.

jax writes cache entries from process 0 only (to spare shared file systems like GCS many
writers of one entry). A computation across processes has one key, the same on every
process, so process 0's entry serves them all. But a computation on one process's own
devices (most cells: ``jnp`` on local arrays, a ``jit`` of local data) has a key of its own on
every process, and only rank 0's was ever written: after a restart rank 0 finished such a cell
from the cache while the others compiled it again, a second or more behind, which the
watchdog's grace could take for a divergence.

So here every process also writes the entries of its process-local computations (each key is
written by one process only; the folder is on this machine or one the user named). Entries of
computations across processes stay process 0's, as in jax. Where jax's internals differ from
what this expects, nothing is patched and the cache works as jax made it.
"""

from __future__ import annotations

import contextvars
import functools

# Whether the computation being compiled on this thread spans several processes.
_ACROSS_PROCESSES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "spmd_across_processes", default=True
)


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
    compile_fn = getattr(compiler, "compile_or_get_cached", None)
    write_fn = getattr(compiler, "_cache_write", None)
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if compile_fn is None or write_fn is None or put is None or hasattr(write_fn, "spmd"):
        return

    @functools.wraps(compile_fn)
    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        processes = {d.process_index for d in devices.flatten()}
        token = _ACROSS_PROCESSES.set(len(processes) > 1)
        try:
            return compile_fn(backend, computation, devices, *args, **kwargs)
        finally:
            _ACROSS_PROCESSES.reset(token)

    @functools.wraps(write_fn)
    def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                    host_callbacks):
        if distributed.global_state.process_id == 0 or _ACROSS_PROCESSES.get():
            return write_fn(cache_key, compile_time_secs, module_name, backend, executable,
                            host_callbacks)
        if host_callbacks:  # (jax does not cache these either)
            return None
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception:  # a cache that cannot be written only costs a compile
            return None
        return None

    cache_write.spmd = True
    compiler.compile_or_get_cached = compile_or_get_cached
    compiler._cache_write = cache_write
