"""Ranks beyond this process's machine: SSH, MPI and Slurm, through ipyparallel's launchers.

ipyparallel starts, signals and stops the processes (its SSH, MPI and Slurm engine set
launchers; ours for SSH are in ``ssh.py``); this module only turns ``--hosts``, ``--launcher``
and ``--launcher-arg`` into their settings, and picks the address the controller listens on:
the interface that reaches the hosts, never all interfaces.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass

from ipyparallel.cluster.launcher import (
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
)
from traitlets import Any, Bool, Dict, Float, Integer, List, Unicode
from traitlets.config import Config

from spmd.cluster.launchers import ssh
from spmd.engine.join.address import address_toward

LOOPBACK = "127.0.0.1"
LAUNCHERS = ("local", "ssh", "mpi", "slurm")

# ssh must never stop to ask (a password, a new host key): it fails at once, and says why.
# A host that stops answering is given up within about 3 s (ServerAlive*): the connection
# ends, and with it every command on it, so a lost host is reported and a stop goes on.
SSH_ARGS = [
    "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
    "-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=3",
]

# Slurm's own option names, and the launcher setting each one is.
_SLURM_NAMES = {"partition": "queue", "time": "timelimit"}


class HostsError(ValueError):
    """``--hosts`` or ``--launcher-arg`` cannot be used; the text says what to do."""


@dataclass(frozen=True)
class Placement:
    """Where the ranks run: which launcher, and how many ranks on each host, in rank order."""

    launcher: str = "local"
    hosts: tuple[tuple[str, int], ...] = ()
    launcher_args: tuple[tuple[str, str], ...] = ()
    python: str = ""  # the engines' interpreter on the hosts ('' : the notebook's own)

    @property
    def on_this_machine(self) -> bool:
        """Whether every rank runs on this machine (so its memory must hold them)."""
        return self.launcher in ("local", "mpi") and not self.leaves_machine

    @property
    def ssh_args(self) -> list[str]:
        """ssh's arguments: ours, then the user's ``--launcher-arg ssh_args=...``."""
        return SSH_ARGS + shlex.split(dict(self.launcher_args).get("ssh_args", ""))

    @property
    def ssh_cmd(self) -> list[str]:
        """The ssh command (``--launcher-arg ssh_cmd=...``, else ssh), for every command."""
        return shlex.split(dict(self.launcher_args).get("ssh_cmd", "")) or ["ssh"]

    @property
    def leaves_machine(self) -> bool:
        """Whether ranks may run on another machine (so traffic is encrypted by default)."""
        if self.launcher == "slurm":
            return True
        if self.launcher == "mpi" and not self.hosts and mpi_spreads(self.launcher_args):
            return True
        return any(not ssh.is_this_machine(host) for host, _ in self.hosts)


# mpiexec's flags (MPICH's and Open MPI's) that place ranks on other machines.
_MPI_HOST_FLAGS = ("-f", "-hostfile", "--hostfile", "-machinefile", "--machinefile", "-hosts",
                   "--host", "-host", "-H")


# Host files an allocation or an MPI reads from the environment: PBS's, LSF's, Open MPI's.
_MPI_HOST_FILES = ("PBS_NODEFILE", "LSB_DJOB_HOSTFILE", "OMPI_MCA_orte_default_hostfile",
                   "PRTE_MCA_prte_default_hostfile")


def mpi_spreads(launcher_args) -> bool:
    """Whether mpiexec may place ranks on other machines without --hosts: a host file or
    host list in its own arguments, or an allocation's nodes in the environment (Slurm's,
    PBS's), as mpiexec itself reads them. Then the controller listens where they reach it."""
    args = shlex.split(dict(launcher_args).get("mpi_args", ""))
    if any(a in _MPI_HOST_FLAGS or a.split("=", 1)[0] in _MPI_HOST_FLAGS for a in args):
        return True
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodes:  # (node names may be short where this machine's own name is not)
        return nodes.split(".")[0] != socket.gethostname().split(".")[0]
    return any(os.environ.get(name) for name in _MPI_HOST_FILES)


def parse_hosts(text: str, n: int) -> tuple[tuple[str, int], ...]:
    """``h1,h2`` (ranks shared out in order, the first hosts taking one more where they do
    not divide) or ``h1:2,h2:6`` (ranks per host, adding up to ``n``)."""
    entries = [part.strip() for part in text.split(",") if part.strip()]
    names, counts = [], []
    for entry in entries:
        name, _, count = entry.partition(":")
        if not name or (count and not count.isdigit()) or count == "0":
            raise HostsError(
                f"--hosts takes host names with an optional count of ranks, like "
                f"node1,node2 or node1:2,node2:6, not {entry!r}"
            )
        names.append(name)
        counts.append(int(count) if count else None)
    if not names:
        raise HostsError("--hosts needs at least one host name, like --hosts node1,node2")
    if len(set(names)) < len(names):
        raise HostsError(f"--hosts names a host twice ({text}): give each host once, with a count")
    if all(c is None for c in counts):
        base, extra = divmod(n, len(names))
        counts = [base + (i < extra) for i in range(len(names))]
        if 0 in counts:
            raise HostsError(f"-n {n} is fewer ranks than the {len(names)} hosts given")
    elif None in counts or sum(counts) != n:
        raise HostsError(
            f"the counts in --hosts {text} add up to {sum(c or 0 for c in counts)}, not -n {n}: "
            "give every host a count that adds up to -n, or no counts"
        )
    return tuple(zip(names, counts))


def hosts_of(where: Placement, ranks: list[int]) -> list[str]:
    """The hosts that ``--hosts`` put these ranks on, in order ([] where it did not say)."""
    found, first = [], 0
    for host, count in where.hosts:
        if any(first <= r < first + count for r in ranks):
            found.append(host)
        first += count
    return found


def ssh_address(host: str, ssh_args: list[str], ssh_cmd: list[str] | None = None) -> str:
    """The IP address ssh connects to for ``host``, after the user's ssh config
    (``HostName`` aliases) and DNS."""
    try:
        out = subprocess.run(
            [*(ssh_cmd or ["ssh"]), *ssh_args, "-G", host],
            capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    name = host.rsplit("@", 1)[-1]
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname":
            name = value.strip()
    try:
        return socket.gethostbyname(name)
    except OSError:
        raise HostsError(f"the host {host} cannot be found: check its name") from None


def controller_address(where: Placement, ssh_args: list[str]) -> str:
    """The address of this machine that the ranks reach: loopback when they all run here."""
    if where.launcher in ("local", "mpi") and not where.leaves_machine:
        return LOOPBACK
    if where.hosts:
        first = ssh_address(where.hosts[0][0], ssh_args, where.ssh_cmd)
        return address_toward(first)
    # Slurm: the interface toward the nodes the ranks will run on (the allocation's, or the
    # partition's), as Slurm knows their addresses.
    node = slurm_node_address(where) if where.launcher == "slurm" else ""
    if node:
        return address_toward(node)
    # mpiexec over an allocation, without hosts, or a Slurm that does not say: they reach
    # this machine by the interface of its default route, or else by its name.
    try:
        return address_toward("192.0.2.1")  # (a documentation address: nothing is sent)
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class SpmdSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine set, writing any sbatch option in its script.

    ipyparallel writes partition, time, account and qos; its ``options`` setting is not
    written at all. ``--launcher-arg mem=4G`` becomes ``#SBATCH --mem=4G`` here.
    """

    sbatch_lines = List(Unicode(), config=True, help="Lines to add to the batch script.")

    def _insert_options_in_script(self) -> None:
        super()._insert_options_in_script()
        if self.sbatch_lines:
            first, rest = self.batch_template.split("\n", 1)
            self.batch_template = "\n".join([first, *self.sbatch_lines, rest])


class SrunEngineSetLauncher(MPIEngineSetLauncher):
    """The ranks as one ``srun`` step of the Slurm allocation the notebook runs in
    (``salloc`` then ``jupyter lab``, or a batch-spawned JupyterLab): no batch job and no
    queue. ipyparallel's MPI engine set runs ``mpi_cmd -n N mpi_args engine``, which is also
    srun's form; Slurm places the ranks and gives each its SLURM_PROCID, SLURM_LOCALID and
    SLURM_NODEID. ``--launcher-arg KEY=VALUE`` becomes ``--KEY=VALUE`` on srun's line."""


def in_allocation() -> str:
    """The Slurm job this process runs in ('' outside one)."""
    return os.environ.get("SLURM_JOB_ID", "")


def slurm_node_address(where: Placement) -> str:
    """The address of a node the ranks will run on: the allocation's first node, or the
    first of the partition's (``--launcher-arg partition=...``, else Slurm's default); ''
    where Slurm does not say."""
    command = ["sinfo", "-h", "-N", "-o", "%o"]
    nodes = os.environ.get("SLURM_JOB_NODELIST", "") if in_allocation() else ""
    partition = dict(where.launcher_args).get("partition", "")
    if nodes:
        command += ["-n", nodes]
    elif partition:
        command += ["-p", partition]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    addresses = out.split()
    if not addresses:
        return ""
    try:
        return socket.gethostbyname(addresses[0])
    except OSError:
        return ""


_SET_LAUNCHERS = {
    "ssh": ssh.RankedSSHEngineSetLauncher,
    "mpi": MPIEngineSetLauncher,
    "slurm": SpmdSlurmEngineSetLauncher,
}




def _value(launcher_cls, key: str, text: str):
    """``text`` as the type of the launcher's setting ``key``."""
    trait = launcher_cls.class_traits(config=True).get(key)
    if isinstance(trait, List):
        return shlex.split(text)
    if isinstance(trait, Bool):
        return text.lower() in ("1", "true", "yes", "on")
    if isinstance(trait, Integer):
        return int(text)
    if isinstance(trait, Float):
        return float(text)
    if isinstance(trait, Dict):
        raise HostsError(f"--launcher-arg cannot set {key}, a dict; use --hosts for engines")
    if isinstance(trait, (Unicode, Any)):
        return text
    raise HostsError(f"--launcher-arg {key}={text} cannot be set")


def configure(c: Config, where: Placement, engine_cmd: list[str], engine_args: list[str],
              env: dict[str, str]) -> type:
    """Set the config of ``where.launcher``'s engine set launcher; return its class."""
    if where.launcher == "slurm" and in_allocation():
        return _configure_srun(c, where, engine_cmd, engine_args, env)
    cls = _SET_LAUNCHERS[where.launcher]
    section = c[cls.__name__]
    section.engine_cmd = engine_cmd
    section.engine_args = engine_args
    section.environment = env
    if where.launcher == "ssh":
        section.engines = dict(where.hosts)
        section.ssh_args = list(SSH_ARGS)
        section.scp_args = list(SSH_ARGS)
        # The connection info travels in the engines' environment, over ssh; nothing is copied.
        c.SSHEngineLauncher.to_send = []
        # (the notebook's own path by default, as the engines' command: not ipyparallel's
        # python3, which may be another Python there)
        section.remote_python = where.python or sys.executable
    elif where.launcher == "mpi":
        section.mpi_args = _mpi_args(where.hosts)
    options = []
    for key, text in where.launcher_args:
        name = _SLURM_NAMES.get(key, key) if where.launcher == "slurm" else key
        if where.launcher == "ssh" and name == "ssh_args":
            # scp takes the same -F, -i and -o options (a port would be -P there)
            section.ssh_args = section.scp_args = where.ssh_args
        elif name in cls.class_traits(config=True):
            section[name] = _value(cls, name, text)
        elif where.launcher == "slurm":
            options.append(f"#SBATCH --{key}={text}")
        else:
            known = ", ".join(sorted(cls.class_traits(config=True)))
            raise HostsError(
                f"the {where.launcher} launcher has no setting {key!r}; "
                f"its settings are: {known}"
            )
    if options:
        section.sbatch_lines = options
    return cls


def _configure_srun(c: Config, where: Placement, engine_cmd: list[str],
                    engine_args: list[str], env: dict[str, str]) -> type:
    """The ranks as a step of the allocation this notebook runs in (see SrunEngineSetLauncher)."""
    section = c[SrunEngineSetLauncher.__name__]
    section.engine_cmd = engine_cmd
    section.engine_args = engine_args
    section.environment = env
    section.mpi_cmd = ["srun", f"--jobid={in_allocation()}"]
    args = []
    for key, text in where.launcher_args:
        if not re.fullmatch(r"[A-Za-z][\w-]*", key):
            raise HostsError(f"--launcher-arg {key}={text} is not an srun option name")
        args.append(f"--{key}={text}" if text else f"--{key}")
    # (every rank's output, and a rank that fails does not end the others: the notebook
    # reports which died and stops the rest itself)
    section.mpi_args = [*args, "--kill-on-bad-exit=0"]
    return SrunEngineSetLauncher


def _mpi_args(hosts) -> list[str]:
    """mpiexec's own flags for ranks per host: MPICH's ``-hosts`` or Open MPI's ``--host``."""
    try:
        version = subprocess.run(
            ["mpiexec", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    open_mpi = "Open MPI" in version
    args = []
    if hosts:
        spec = ",".join(f"{host}:{count}" for host, count in hosts)
        args += ["--host", spec] if open_mpi else ["-hosts", spec]
    return args


def launch_failure(where: Placement, exc: subprocess.CalledProcessError) -> str:
    """One sentence for a launch command that failed, with what it said."""
    said = (exc.stderr or exc.output or b"")
    if isinstance(said, bytes):
        said = said.decode(errors="replace")
    lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
    detail = lines[-1] if lines else f"exit status {exc.returncode}"
    command = exc.cmd[0] if isinstance(exc.cmd, list) and exc.cmd else str(exc.cmd)
    if where.launcher == "ssh":
        hosts = ", ".join(host for host, _ in where.hosts)
        return (
            f"Starting ranks over ssh on {hosts} failed ({detail}): check that "
            "`ssh HOST` logs in without a prompt and that --python names a Python with "
            "jupyter-spmd installed there."
        )
    return f"{command} failed ({detail}): check the {where.launcher} launcher's settings."


def mpi_culprit(output: str) -> tuple[int, int] | None:
    """(pid, exit code: negative for a signal) of the rank whose end made mpiexec end the
    others, from what MPICH's mpiexec printed; None where it did not say."""
    pid = re.search(r"PID (\d+) RUNNING AT", output)
    if pid is None:
        return None
    by_signal = re.search(r"\(signal (\d+)\)", output)
    if by_signal:
        return int(pid.group(1)), -int(by_signal.group(1))
    code = re.search(r"EXIT CODE: (\d+)", output)
    return int(pid.group(1)), int(code.group(1)) if code else None
