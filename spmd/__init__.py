"""jupyter-spmd: one notebook drives N processes of a JAX (or PyTorch) SPMD program.

%load_ext spmd
%spmd start -n 4
"""

from __future__ import annotations

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """Register %spmd, %%spmd and %%local (``%load_ext spmd``)."""
    from spmd.magics.magics import register

    register(ipython)


def unload_ipython_extension(ipython) -> None:
    from spmd.magics.magics import unregister

    unregister(ipython)


def show_sharding(x, title: str = "") -> None:
    """Display one picture of jax.Array or DTensor ``x``: which process and device holds
    each block (a DTensor's devices are the ranks of its DeviceMesh).

    Call it in a cell on the ranks (``spmd.show_sharding(y)``); every process draws the same
    picture from the sharding alone, so the notebook shows it once. ``%spmd sharding y`` draws
    it from the shards each process reports instead.
    """
    from spmd.engine.arrays.shards import show

    show(x, title)


def initialize_args() -> dict:
    """On a rank: the keyword arguments ``%spmd start`` passed to ``jax.distributed.initialize``
    in this process (``{}`` in the notebook, which never joins the job)."""
    from spmd.engine.bootstrap import INITIALIZE_ARGS

    return dict(INITIALIZE_ARGS)


def init_process_group_args() -> dict:
    """On a rank: the keyword arguments ``%spmd start --backend torch`` passed to
    ``torch.distributed.init_process_group`` in this process (``{}`` in the notebook)."""
    from spmd.engine.join.torch_group import INIT_ARGS

    return dict(INIT_ARGS)
