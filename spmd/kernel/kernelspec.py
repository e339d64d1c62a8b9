"""Kernelspecs for the SPMD kernel: typed functions, with a thin command line over them.

    python -m spmd.kernel install [--user | --sys-prefix | --prefix P] [--name NAME]
                                  [--display-name TEXT] [-n N] [-d K] [--backend jax|torch|jax,torch|none]
                                  [--torch-backend gloo|nccl|mpi]
                                  [--hosts H1,H2 | H1:2,H2:6] [--launcher local|ssh|mpi|slurm]
                                  [--launcher-arg KEY=VALUE ...] [--python PATH]
                                  [--gpus-per-process K] [--start-timeout S]
                                  [--check-collectives]
    python -m spmd.kernel list
    python -m spmd.kernel remove NAME

The wheel ships the default spec (``spmd``, 4 processes) as data files, written at build by
``write_kernel_spec(..., executable="python")`` (hatch_build.py), as ipykernel ships
``python3``: Jupyter runs a bare ``python`` as its own interpreter, the environment's. An
install by this command writes the interpreter's full path, and overrides it (the same
name, in the user's folder or over it with ``--sys-prefix``).

The spec's argv carries the cluster's settings as the kernel's traitlets
(``--SpmdKernel.processes=4``; where the ranks run, as ``%spmd start``'s own options in one
``--SpmdKernel.cluster=...``); its resources (logos) are ipykernel's. An install checks the
options as ``%spmd start`` does, and refuses what it would refuse, in the same words.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from spmd.options import TORCH_BACKENDS, count
from spmd.options import backend as backend_type

KERNEL_NAME = "spmd"
APP_MODULE = "spmd.kernel.app"


def display_name_for(processes: int, cluster: str = "", backend: str = "jax") -> str:
    """"Python 3 (SPMD, 4 processes)", or where the ranks run: "Python 3 (SPMD, 8 ranks on
    Slurm)", "... on node1, node2", "... with mpiexec"."""
    where = cluster_settings(processes, cluster, backend=backend).where if cluster else None
    if where is None or (where.launcher == "local" and not where.hosts):  # (this machine)
        return f"Python 3 (SPMD, {processes} process{'es' if processes != 1 else ''})"
    if where.launcher == "slurm":
        place = "on Slurm"
    elif where.launcher == "mpi":
        place = "with mpiexec" + (f" on {_hosts(where)}" if where.hosts else "")
    else:
        place = f"on {_hosts(where)}"
    return f"Python 3 (SPMD, {processes} rank{'s' if processes != 1 else ''} {place})"


def _hosts(where) -> str:
    return ", ".join(host.rsplit("@", 1)[-1] for host, _ in where.hosts)


def _check_gpus(settings) -> None:
    """Where the ranks run on this machine, its GPUs checked as %spmd start checks them
    (UsageError): enough for --gpus-per-process, or none asked of a machine that has none.
    (Other hosts' GPUs are checked by the start, there.)"""
    from IPython.core.error import UsageError

    from spmd.engine.join.placement import GpuError, host_gpus, share_gpus

    if settings.where.launcher != "local" or settings.where.hosts:
        return
    try:
        share_gpus(0, settings.n, host_gpus(), settings.gpus_per_process, "this machine")
    except GpuError as exc:
        raise UsageError(str(exc)) from None


def cluster_settings(processes: int, cluster: str, **settings):
    """The Settings a kernel with this ``cluster`` would start (UsageError, in %spmd start's
    words, for options it cannot use)."""
    from spmd.magics.start.arguments import start_settings
    from spmd.options import start_args

    args = start_args(processes, settings.get("devices_per_process"),
                      settings.get("backend", "jax"), settings.get("torch_backend", "gloo"),
                      cluster)
    return start_settings(args, make_folders=False)[1]


def cluster_options(hosts: str = "", launcher: str | None = None,
                    launcher_args: list[str] = (), python: str = "",
                    gpus_per_process: int | None = None, start_timeout: float | None = None,
                    check_collectives: bool = False, linger: str | None = None) -> str:
    """The kernel's cluster as one string of %spmd start options."""
    import shlex

    words = []
    if hosts:
        words += ["--hosts", hosts]
    if launcher:
        words += ["--launcher", launcher]
    for arg in launcher_args:
        words += ["--launcher-arg", arg]
    if python:
        words += ["--python", python]
    if gpus_per_process is not None:
        words += ["--gpus-per-process", str(gpus_per_process)]
    if start_timeout is not None:
        words += ["--start-timeout", f"{start_timeout:g}"]
    if check_collectives:
        words += ["--check-collectives"]
    if linger is not None:
        words += ["--linger", linger]
    return shlex.join(words)


def kernel_dict(
    processes: int = 4,
    devices_per_process: int | None = None,
    backend: str = "jax",
    display_name: str | None = None,
    torch_backend: str = "gloo",
    cluster: str = "",
    executable: str | None = None,
) -> dict:
    """The contents of kernel.json (``cluster``: %spmd start's options for where the ranks
    run, checked here: UsageError). ``executable``: the Python it runs, this one's full path
    unless told (the wheel's spec says ``python``, which Jupyter takes as its own)."""
    from ipykernel.kernelspec import make_ipkernel_cmd

    if cluster:
        chosen = cluster_settings(processes, cluster, devices_per_process=devices_per_process,
                                  backend=backend, torch_backend=torch_backend)
        _check_gpus(chosen)
    settings = [f"--SpmdKernel.processes={processes}", f"--SpmdKernel.backend={backend}"]
    if "torch" in backend:
        settings.append(f"--SpmdKernel.torch_backend={torch_backend}")
    if devices_per_process:
        settings.append(f"--SpmdKernel.devices_per_process={devices_per_process}")
    if cluster:
        settings.append(f"--SpmdKernel.cluster={cluster}")
    return {
        "argv": make_ipkernel_cmd(mod=APP_MODULE, executable=executable,
                                  extra_arguments=settings),
        "display_name": display_name or display_name_for(processes, cluster, backend),
        "language": "python",
        # Jupyter's interrupt is SIGINT to the kernel, which the cell's wait turns into the
        # interrupt report.
        "interrupt_mode": "signal",
        "metadata": {
            # JupyterLab offers its debugger from this; it debugs the ranks (debugger.py),
            # which run debugpy where it is installed (ipykernel needs it: it usually is)
            "debugger": importlib.util.find_spec("debugpy") is not None,
            "spmd": {"processes": processes, "backend": backend, "cluster": cluster},
        },
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
    # (imported here: the wheel's build writes a spec with only ipykernel at hand)
    from spmd.cluster.launchers.remote import LAUNCHERS

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
    # where the ranks run: %spmd start's own options (checked, and refused, in its words)
    inst.add_argument("--hosts", default="", help="ranks over ssh on these hosts: h1,h2 or h1:2,h2:6")
    inst.add_argument("--launcher", choices=LAUNCHERS)
    inst.add_argument("--launcher-arg", action="append", default=[], metavar="KEY=VALUE",
                      help="a setting of the launcher (repeatable), like partition=gpu")
    inst.add_argument("--python", default="", help="the ranks' Python on the hosts")
    inst.add_argument("--gpus-per-process", type=int, help="GPUs per rank (0 hides them)")
    inst.add_argument("--start-timeout", type=float, help="seconds the ranks may take to start")
    inst.add_argument("--check-collectives", action="store_true",
                      help="torch's own check of each collective across the ranks")
    inst.add_argument("--linger", help="how long the ranks outlive a kernel that died, for the "
                      "next to attach: 10m by default, 0 for none")
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
        cluster = cluster_options(
            args.hosts, args.launcher, args.launcher_arg, args.python, args.gpus_per_process,
            args.start_timeout, args.check_collectives, args.linger,
        )
        from IPython.core.error import UsageError

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
                cluster=cluster,
            )
        except UsageError as exc:  # (%spmd start's own sentence, for the same options)
            print(f"python -m spmd.kernel install: {str(exc).removeprefix('%spmd start: ')}",
                  file=sys.stderr)
            return 2
        except OSError as exc:  # no permission, or a file where a folder should be
            print(
                f"python -m spmd.kernel install: cannot write {exc.filename} "
                f"({exc.strerror}): install with --user or --sys-prefix instead.",
                file=sys.stderr,
            )
            return 2
        print(f"Installed kernelspec {args.name} in {path}")
        found = KernelSpecManager().find_kernel_specs().get(args.name)
        if found and Path(found).resolve() != Path(path).resolve():
            # (in a virtual environment Jupyter looks in the environment's folder before the
            # user's: the wheel's own spec there hides a --user one of the same name from a
            # JupyterLab of this environment, not from one of another environment)
            print(
                f"Note: a Jupyter run from this Python finds the kernelspec {args.name} in "
                f"{found} first, and starts that one (a Jupyter of another environment finds "
                f"this one): to change what it starts, install with --sys-prefix, or with "
                f"another --name for a second kernel.",
                file=sys.stderr,
            )
    elif args.command == "list":
        specs = list_specs()
        if not specs:
            print("No SPMD kernelspec is installed: python -m spmd.kernel install adds one.")
        width = max((len(n) for n in specs), default=0)
        for name, found in sorted(specs.items()):
            cluster = found["spec"].get("metadata", {}).get("spmd", {}).get("cluster", "")
            print(f"{name.ljust(width)}  {found['spec']['display_name']}  {found['resource_dir']}"
                  + (f"\n{' ' * width}  {cluster}" if cluster else ""))
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
