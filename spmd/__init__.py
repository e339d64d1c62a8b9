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
