"""Hosts for the tests: network namespaces on a bridge, each running its own sshd.

Each host has its own network stack (its own loopback, its own address on the bridge), its
own host name and its own /tmp, so ranks started there reach the notebook only across the
bridge and leave their files on their own disk, as on a real cluster. The rest of the file
system is shared, as home folders are on a cluster: the hosts run this checkout's Python (and
see, in their /tmp, this checkout and its environment where those are under /tmp, and the
hosts' own folder, ``folder``, for files a test gives them). Everything is made from the test
and ended by its own handles: the sshd processes and what runs in the namespaces, the
namespaces, the bridge.
"""

from __future__ import annotations

import itertools
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

_MADE = itertools.count()


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def why_not() -> str:
    """'' when namespace hosts can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount", "/usr/sbin/sshd", "ssh"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 openssh-server)"
    probe = f"spmdprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    _run("ip", "netns", "del", probe)
    return ""


@dataclass
class Hosts:
    """``count`` hosts named node1, node2, ...; ``ssh_args`` reaches them by those names."""

    count: int = 2
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="spmd-hosts-"))
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    _sshd: list[subprocess.Popen] = field(default_factory=list)
    _outer: list[str] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _bridge: str = ""

    @property
    def ssh_config(self) -> str:
        return os.path.join(self.folder, "ssh_config")

    @property
    def ssh_args(self) -> list[str]:
        return ["-F", self.ssh_config]

    @property
    def launcher_arg(self) -> str:
        """The ``%spmd start`` option that makes its ssh use these hosts' config."""
        return f'--launcher-arg "ssh_args=-F {self.ssh_config}"'

    @property
    def python(self) -> str:
        return sys.executable

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        # (names unique to this set of hosts: a test may make its own beside a module's;
        # an interface name has at most 15 characters)
        tag = f"{os.getpid() % 10000:04d}{next(_MADE) % 100:02d}"  # (test workers: two pids)
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self._bridge = f"spbr{tag}"
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        key = os.path.join(self.folder, "id_ed25519")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        shutil.copy(key + ".pub", os.path.join(self.folder, "authorized_keys"))
        known, config = [], []
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
        for i in range(1, self.count + 1):
            name, ns, address = f"node{i}", f"spmd{tag}n{i}", f"{subnet}.{10 + i}"
            veth = f"spv{tag}n{i}"
            _run("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self._bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            host_key = os.path.join(self.folder, f"host_{name}")
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
            with open(host_key + ".pub") as f:
                known.append(f"{address} {f.read().strip()}")
            sshd_config = os.path.join(self.folder, f"sshd_{name}")
            with open(sshd_config, "w") as f:
                f.write(
                    f"ListenAddress {address}\nHostKey {host_key}\n"
                    f"AuthorizedKeysFile {self.folder}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    f"PidFile {self.folder}/sshd_{name}.pid\nMaxStartups 100\n"
                    "MaxSessions 100\nSubsystem sftp internal-sftp\n"
                )
            config.append(f"Host {name}\n  HostName {address}\n")
            self.names.append(name)
            self.addresses.append(address)
        # Each host resolves every host's name (gloo and jax look up their own), through the
        # /etc/hosts that ``ip netns exec`` mounts for its namespace.
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for address, name in zip(self.addresses, self.names)
        )
        for ns in self._namespaces:
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts_file)
        for name, ns in zip(self.names, self._namespaces):
            sshd_config = os.path.join(self.folder, f"sshd_{name}")
            # Its own host name (a UTS namespace), so the ranks there say "node1", and its
            # own /tmp (a mount namespace), with the shared folders bound back into it.
            # /tmp is where what ssh starts writes (ssh passes no TMPDIR), and this
            # machine's temporary folder (a test worker's own, under /tmp) is where the
            # notebook puts the cluster's folders, on every host by the same path.
            script, q = "", shlex.quote
            for i, tmp in enumerate(self.private_folders()):
                outer = f"/run/spmd-outer-{tag}-{name}-{i}"
                os.makedirs(outer, exist_ok=True)
                self._outer.append(outer)
                binds = "".join(
                    f" && mkdir -p {q(d)} && mount --rbind {q(outer + d[len(tmp):])} {q(d)}"
                    for d in self.shared_under(tmp)
                )
                script += (
                    f"mount --rbind {q(tmp)} {q(outer)} "
                    f"&& mount -t tmpfs -o mode=1777 tmpfs {q(tmp)}{binds} "
                    f"&& umount -l {q(outer)} && "
                )
            script += (
                f"hostname {name} "
                f"&& exec /usr/sbin/sshd -D -e -f {q(sshd_config)}"
            )
            self._sshd.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c",
                     script],
                    stdout=subprocess.DEVNULL,
                    stderr=open(os.path.join(self.folder, f"sshd_{name}.log"), "w"),  # noqa: SIM115
                )
            )
        with open(os.path.join(self.folder, "known_hosts"), "w") as f:
            f.write("\n".join(known) + "\n")
        with open(self.ssh_config, "w") as f:
            f.write("".join(config))
            f.write(
                f"Host *\n  User root\n  IdentityFile {key}\n"
                f"  UserKnownHostsFile {self.folder}/known_hosts\n"
                "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n"
            )
        for name in self.names:  # each sshd answers before the test goes on
            self.ssh(name, "true", timeout=30)

    @property
    def tmp(self) -> str:
        """The temporary folder the notebook's cluster folders go in, here and on the hosts
        (each host's own)."""
        return os.path.realpath(tempfile.gettempdir())

    def leftovers(self, host: str) -> list[str]:
        """What the project left on ``host``: its ``spmd-`` folders and files in /tmp and in
        the temporary folder, but the hosts' own folder."""
        found = []
        for folder in dict.fromkeys(["/tmp", self.tmp]):
            found += [os.path.join(folder, e) for e in self.ssh(host, f"ls -A {folder}").split()
                      if e.startswith("spmd-")]
        return [f for f in found if f != os.path.realpath(self.folder)]

    def private_folders(self) -> list[str]:
        """The folders each host has its own of: /tmp, and the temporary folder where that
        is not under /tmp."""
        return ["/tmp"] + ([self.tmp] if not (self.tmp + "/").startswith("/tmp/") else [])

    def shared_under(self, tmp: str) -> list[str]:
        """The folders in ``tmp`` that the hosts share with this machine: this checkout, its
        Python environment, the hosts' folder (parents before children)."""
        here = [
            str(Path(__file__).resolve().parents[1]), sys.prefix, self.folder,
            *os.environ.get("PYTHONPATH", "").split(os.pathsep),
        ]
        found = {os.path.realpath(p) for p in here if p}
        return sorted(p for p in found if p.startswith(tmp + "/"))

    def cut(self, host: str) -> None:
        """Take ``host``'s link down: it stops answering, as a crashed node or a pulled
        cable would."""
        ns = self._namespaces[self.names.index(host)]
        _run("ip", "-n", ns, "link", "set", "eth0", "down")

    def ssh(self, host: str, command: str, timeout: float = 30) -> str:
        for attempt in range(50):
            done = subprocess.run(
                ["ssh", *self.ssh_args, host, command],
                capture_output=True, text=True, timeout=timeout,
            )
            if done.returncode != 255 or attempt == 49:  # 255: ssh itself failed
                break
            time.sleep(0.1)
        done.check_returncode()
        return done.stdout

    def pids(self) -> list[int]:
        """Every process running in these hosts' namespaces now, sshd included."""
        found = []
        for ns in self._namespaces:
            out = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout
            found += [int(p) for p in out.split()]
        return found

    def close(self) -> None:
        for sshd in self._sshd:
            sshd.kill()
            sshd.wait(10)
        # What still runs in a namespace (a rank on a host that was cut off) would outlive
        # ``ip netns del``: it ends here, by its handle.
        left = []
        for pid in self.pids():
            try:
                left.append(psutil.Process(pid))
                left[-1].kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)
        for outer in self._outer:
            shutil.rmtree(outer, ignore_errors=True)
        for ns in self._namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self._bridge:
            subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)
        shutil.rmtree(self.folder, ignore_errors=True)
