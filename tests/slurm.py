"""A real Slurm for the tests: a single node on this machine (``Slurm``), or the network
namespace hosts of hosts.py as two compute nodes (``HostsSlurm``).

Its own config, ports, state folder and munge socket, so it touches no Slurm the machine may
already run; every daemon is started here and ended by its handle. Jobs run as root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time


def why_not() -> str:
    """'' when a Slurm can be started here; else why not."""
    if os.geteuid() != 0:
        return "slurmd and munged run as root here"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    if not os.path.exists("/etc/munge/munge.key"):
        return "munge has no key (/etc/munge/munge.key)"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm:
    """``with Slurm() as slurm:`` a cluster of one node; ``slurm.env`` points Slurm's
    commands at it (``SLURM_CONF``)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="spmd-slurm-")
        self.conf = os.path.join(self.folder, "slurm.conf")
        self.env = {"SLURM_CONF": self.conf}
        self._daemons: list[subprocess.Popen] = []
        self.slurmd: list[subprocess.Popen] = []  # (one per node)

    def __enter__(self) -> Slurm:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        node = socket.gethostname()
        # 8 CPUs on a 2-core machine: 4 ranks of 1 CPU each fit, as on a real node
        self._configure(f"{node}(127.0.0.1)", [(node, "127.0.0.1")], cpus=8)
        self._start_daemons({node: ["slurmd", "-D"]})

    def _configure(self, controller: str, nodes: list[tuple[str, str]], cpus: int) -> None:
        """Write slurm.conf: slurmctld on ``controller`` ("host(address)"), and ``nodes``
        (name, address) of ``cpus`` CPUs each, in one partition."""
        f = self.folder
        os.makedirs(f"{f}/state")
        for name, _ in nodes:
            os.makedirs(f"{f}/spool-{name}")
        with open(self.conf, "w") as conf:
            conf.write(
                f"ClusterName=spmdtest\nSlurmctldHost={controller}\n"
                "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n"
                f"AuthInfo=socket={f}/munge.sock\n"
                f"SlurmctldPort={_free_port()}\nSlurmdPort={_free_port()}\n"
                f"StateSaveLocation={f}/state\nSlurmdSpoolDir={f}/spool-%n\n"
                f"SlurmctldPidFile={f}/slurmctld.pid\nSlurmdPidFile={f}/slurmd-%n.pid\n"
                f"SlurmctldLogFile={f}/slurmctld.log\nSlurmdLogFile={f}/slurmd-%n.log\n"
                "SlurmdParameters=config_overrides\n"
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
                "SchedulerType=sched/builtin\nReturnToService=2\nMpiDefault=none\n"
                # a step that ignores SIGTERM is killed 2 s later, not 30
                "KillWait=2\n"
                # sbatch --wait looks at its job every 2 s, not after 2, 8, then 32 s (it waits
                # less than MinJobAge / 2); 0 also keeps every record of an ended job
                "MinJobAge=0\n"
                "JobAcctGatherType=jobacct_gather/none\n"
                "AccountingStorageType=accounting_storage/none\n"
                + "".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN\n"
                          for name, address in nodes)
                + f"PartitionName=debug Nodes={','.join(n for n, _ in nodes)} Default=YES "
                "MaxTime=INFINITE State=UP\n"
            )

    def _start_daemons(self, slurmd: dict[str, list[str]]) -> None:
        """munged and slurmctld here, then each node's slurmd command; until every node is
        idle."""
        f, env = self.folder, dict(os.environ, **self.env)
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL,
                 "stderr": subprocess.DEVNULL, "env": env}
        self._daemons.append(subprocess.Popen(
            ["munged", "--force", "-F", f"--socket={f}/munge.sock",
             f"--pid-file={f}/munged.pid", f"--seed-file={f}/munge.seed",
             f"--log-file={f}/munged.log"], **quiet))
        self._wait_for(lambda: os.path.exists(f"{f}/munge.sock"), "munged")
        self._daemons.append(subprocess.Popen(["slurmctld", "-D", "-i"], **quiet))
        self.slurmd = [subprocess.Popen(command, **quiet) for command in slurmd.values()]
        self._daemons += self.slurmd

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                                 text=True, env=env).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            for name, state in states.items():
                if "drain" in state:  # a state left from a start with other settings
                    subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"],
                                   capture_output=True, env=env)
            return states == {name: "idle" for name in slurmd}

        self._wait_for(idle, "the Slurm nodes")

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if any(d.poll() is not None for d in self._daemons):
                raise RuntimeError(f"a Slurm daemon exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready within {timeout:.0f} s")
            time.sleep(0.1)

    @contextlib.contextmanager
    def as_default(self):
        """This Slurm as the one Slurm's commands find (``SLURM_CONF``), in the block."""
        before = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.conf
        try:
            yield self
        finally:
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before

    def jobs(self) -> str:
        return subprocess.run(["squeue", "-h"], capture_output=True, text=True,
                              env=dict(os.environ, **self.env)).stdout

    def close(self) -> None:
        # Jobs end before the daemons do: a step whose slurmd is gone would run on.
        env = dict(os.environ, **self.env)
        if self._daemons and self.jobs():
            subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, env=env)
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in reversed(self._daemons):
            daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


class HostsSlurm(Slurm):
    """``with HostsSlurm(hosts) as slurm:`` the hosts (node1, node2, ... in network namespaces)
    as Slurm's compute nodes, a slurmd in each with its own node name and address, and
    slurmctld and munged on this machine, on the hosts' bridge. Jobs see the hosts' network
    and host name, and this machine's file system (the checkout, its Python)."""

    def __init__(self, hosts) -> None:
        super().__init__()
        self.hosts = hosts

    def _start(self) -> None:
        hosts = self.hosts
        bridge = hosts.addresses[0].rsplit(".", 1)[0] + ".1"
        self._configure(f"{socket.gethostname()}({bridge})",
                        list(zip(hosts.names, hosts.addresses)), cpus=4)
        # (nsenter, not ip netns exec, which mounts a /sys of its own without the cgroups
        # slurmd needs; the node's own host name, in a UTS namespace, and the hosts' names,
        # as ip netns exec gives them: gloo looks its own up)
        self._start_daemons({
            name: ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh",
                   "-c", f"mount --bind /etc/netns/{ns}/hosts /etc/hosts && hostname {name} "
                   f"&& exec slurmd -D -N {name}"]
            for name, ns in zip(hosts.names, hosts._namespaces)
        })

    def daemon_pids(self) -> set[int]:
        """The slurmd in each host's namespace (nsenter, unshare and sh exec into it)."""
        return {d.pid for d in self.slurmd}
