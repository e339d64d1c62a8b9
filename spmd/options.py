"""Option values shared by ``%spmd start`` and ``python -m spmd.kernel install``."""

from __future__ import annotations

import argparse
import shlex

# What every rank initializes: jax, torch, both (on separate ports), or nothing.
BACKENDS = ("jax", "torch", "jax,torch", "none")
TORCH_BACKENDS = ("gloo", "nccl", "mpi")
INIT_METHODS = ("tcp", "env", "file")


def backend(text: str) -> str:
    """An argparse type: jax, torch, none, or jax and torch together (in either order)."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    chosen = [b for b in ("jax", "torch") if b in names]
    if names == ["none"]:
        return "none"
    if not chosen or len(chosen) != len(names):
        raise argparse.ArgumentTypeError(
            f"--backend takes jax, torch, jax,torch or none, not {text!r}"
        )
    return ",".join(chosen)


def init_method(text: str) -> str:
    """An argparse type: torch's init method, tcp, env, file, or file:///path/to/a/file."""
    if text in INIT_METHODS or (text.startswith("file:///") and not text.endswith("/")):
        return text
    raise argparse.ArgumentTypeError(
        f"--init-method takes tcp, env, file or file:///path/to/a/file, not {text!r}"
    )


def count(what: str, example: str):
    """An argparse type: a whole number of at least 1, or a sentence that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"{what} must be a whole number of at least 1, like {example}, not {text!r}"
            )
        return value

    return parse


def start_args(processes, devices_per_process, backend, torch_backend, cluster) -> list[str]:
    """The ``%spmd start`` arguments of a kernel with these settings (its cluster: the
    kernelspec's --hosts, --launcher... options, as one string)."""
    args = ["-n", str(processes), "--backend", str(backend)]
    if int(devices_per_process or 0):
        args += ["-d", str(devices_per_process)]
    if "torch" in str(backend):
        args += ["--torch-backend", str(torch_backend)]
    try:
        given = shlex.split(cluster or "")
    except ValueError as exc:  # (a quote left open in a kernel.json or a config file)
        from IPython.core.error import UsageError

        raise UsageError(f"{exc} in {cluster}: close the quote in the kernel's cluster "
                         "setting (kernel.json or the config file)") from None
    return args + given
