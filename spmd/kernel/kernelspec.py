"""Kernelspecs for the SPMD kernel: typed functions, with a thin command line over them.

    python -m spmd.kernel install [--user | --sys-prefix | --prefix P] [--name NAME]
                                  [--display-name TEXT] [-n N] [-d K] [--backend jax|torch|jax,torch|none]
                                  [--torch-backend gloo|nccl|mpi]
    python -m spmd.kernel list
    python -m spmd.kernel remove NAME

The spec's argv carries the cluster's settings as the kernel's traitlets
(``--SpmdKernel.processes=4``); its resources (logos) are ipykernel's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from spmd.options import TORCH_BACKENDS, count
from spmd.options import backend as backend_type

KERNEL_NAME = "spmd"
APP_MODULE = "spmd.kernel.app"


def display_name_for(processes: int) -> str:
    return f"Python 3 (SPMD, {processes} process{'es' if processes != 1 else ''})"


def kernel_dict(
    processes: int = 4,
    devices_per_process: int | None = None,
    backend: str = "jax",
    display_name: str | None = None,
    torch_backend: str = "gloo",
) -> dict:
    """The contents of kernel.json."""
    from ipykernel.kernelspec import make_ipkernel_cmd

    settings = [f"--SpmdKernel.processes={processes}", f"--SpmdKernel.backend={backend}"]
    if "torch" in backend:
        settings.append(f"--SpmdKernel.torch_backend={torch_backend}")
    if devices_per_process:
        settings.append(f"--SpmdKernel.devices_per_process={devices_per_process}")
    return {
        "argv": make_ipkernel_cmd(mod=APP_MODULE, extra_arguments=settings),
        "display_name": display_name or display_name_for(processes),
        "language": "python",
        # Jupyter's interrupt is SIGINT to the kernel, which the cell's wait turns into the
        # interrupt report; the debugger (debugpy) would attach to this process, not the ranks.
        "interrupt_mode": "signal",
        "metadata": {"debugger": False, "spmd": {"processes": processes, "backend": backend}},
    }


def write_kernel_spec(path: Path, **settings) -> Path:
    """Write a kernelspec folder (kernel.json and ipykernel's logos) at ``path``."""
    from ipykernel.kernelspec import write_kernel_spec as write_ipykernel_spec

    return Path(write_ipykernel_spec(path, overrides=kernel_dict(**settings)))


def install(
    name: str = KERNEL_NAME,
    user: bool = False,
    prefix: str | None = None,
    kernel_spec_manager: KernelSpecManager | None = None,
    **settings,
) -> str:
    """Install a kernelspec; the folder it went to.

    ``user`` installs for this user only, ``prefix`` into an environment (``sys.prefix`` for
    ``--sys-prefix``); neither: system-wide, as ``jupyter kernelspec install`` does.
    """
    ksm = kernel_spec_manager or KernelSpecManager()
    with tempfile.TemporaryDirectory() as tmp:
        source = write_kernel_spec(Path(tmp) / name, **settings)
        return ksm.install_kernel_spec(str(source), kernel_name=name, user=user, prefix=prefix)


def list_specs(kernel_spec_manager: KernelSpecManager | None = None) -> dict[str, dict]:
    """The SPMD kernelspecs Jupyter can see: {name: {"resource_dir", "spec"}}."""
    ksm = kernel_spec_manager or KernelSpecManager()
    return {
        name: found
        for name, found in ksm.get_all_specs().items()
        if APP_MODULE in found["spec"].get("argv", [])
    }


def remove(name: str, kernel_spec_manager: KernelSpecManager | None = None) -> str:
    """Remove the SPMD kernelspec ``name``; the folder removed. Other kernels are refused."""
    ksm = kernel_spec_manager or KernelSpecManager()
    if name not in list_specs(ksm):
        raise NoSuchKernel(name)
    return ksm.remove_kernel_spec(name)


# -- the command line -----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one sentence on stderr and exit status 2, not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see --help.\n")


def _parser() -> _Parser:
    p = _Parser(prog="python -m spmd.kernel", description="Manage SPMD kernelspecs.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inst = commands.add_parser("install", help="install a kernelspec")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument("--sys-prefix", action="store_true", help="into this Python environment")
    where.add_argument("--prefix", help="under this prefix (PREFIX/share/jupyter/kernels)")
    inst.add_argument("--name", default=KERNEL_NAME, help="the kernelspec's name (default spmd)")
    inst.add_argument("--display-name", help="the name in JupyterLab's launcher")
    inst.add_argument(
        "-n", "--processes", type=count("-n", "-n 4"), default=4, help="ranks (default 4)"
    )
    inst.add_argument(
        "-d", "--devices-per-process", type=count("-d", "-d 2"), help="CPU devices per rank"
    )
    inst.add_argument("--backend", type=backend_type, default="jax")
    inst.add_argument("--torch-backend", choices=TORCH_BACKENDS, default="gloo")
    commands.add_parser("list", help="list the SPMD kernelspecs")
    rm = commands.add_parser("remove", help="remove an SPMD kernelspec")
    rm.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "install":
        if not args.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            print(
                f"python -m spmd.kernel install: --name takes letters, digits, '-', '_' and '.', "
                f"not {args.name!r}.",
                file=sys.stderr,
            )
            return 2
        prefix = sys.prefix if args.sys_prefix else args.prefix
        try:
            path = install(
                args.name,
                user=args.user,
                prefix=prefix,
                processes=args.processes,
                devices_per_process=args.devices_per_process,
                backend=args.backend,
                torch_backend=args.torch_backend,
                display_name=args.display_name,
            )
        except OSError as exc:  # no permission, or a file where a folder should be
            print(
                f"python -m spmd.kernel install: cannot write {exc.filename} "
                f"({exc.strerror}): install with --user or --sys-prefix instead.",
                file=sys.stderr,
            )
            return 2
        print(f"Installed kernelspec {args.name} in {path}")
    elif args.command == "list":
        specs = list_specs()
        if not specs:
            print("No SPMD kernelspec is installed: python -m spmd.kernel install adds one.")
        width = max((len(n) for n in specs), default=0)
        for name, found in sorted(specs.items()):
            print(f"{name.ljust(width)}  {found['spec']['display_name']}  {found['resource_dir']}")
    else:
        try:
            path = remove(args.name)
        except NoSuchKernel:
            print(
                f"python -m spmd.kernel remove: there is no SPMD kernelspec named {args.name!r}; "
                "python -m spmd.kernel list shows them.",
                file=sys.stderr,
            )
            return 2
        print(f"Removed {path}")
    return 0
