"""Ranks beyond this process: over SSH into hosts made on this machine (network namespaces on
a bridge, each with its own sshd), and through mpiexec. Each test starts its own cluster and
checks that nothing is left on any host after it."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    controller_socket,
    fanout_answers,
    kernel_stream,
    report,
    run,
    spmd_kernel,
    spmd_processes,
    started_since,
    wait_until_gone,
)
from hosts import Hosts, why_not
from IPython.core.error import UsageError
from jobs import write_job

pytestmark = pytest.mark.timeout(240)

SETUP = (
    "import os, socket, time, jax, jax.numpy as jnp\n"
    "rank = jax.process_index()\n"
    "psum = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
)
PSUM = "print(psum(jnp.ones(jax.local_device_count())))"


@pytest.fixture(scope="module")
def hosts():
    reason = why_not()
    if reason:
        pytest.skip(f"no hosts in network namespaces here: {reason}")
    with Hosts(2) as made:
        yield made
        # (what a test left on a host would end with the namespaces, unseen: seen here)
        assert nothing_left_on(made) == []


def hub_answers(info: dict, curve: bool, wait: float = 3.0) -> bool:
    """Whether the controller answers a signed connection request on its query port within
    ``wait`` seconds."""
    import zmq
    from jupyter_client.session import Session as Signer

    signer = Signer(key=info["key"].encode(), signature_scheme=info["signature_scheme"])
    with controller_socket(info, info["registration"], curve) as sock:
        try:
            signer.send(sock, "connection_request")
        except zmq.Again:
            return False
        return bool(sock.poll(int(wait * 1000)))


def magics(shell):
    return shell.magics_manager.registry["SpmdMagics"]


def ssh_start(hosts: Hosts, n: int = 2, extra: str = "") -> str:
    return (
        f"%spmd start -n {n} --hosts {','.join(hosts.names)} --python {hosts.python} "
        f"{hosts.launcher_arg} {extra}"
    )


def running_on(hosts: Hosts) -> list[int]:
    """Processes running in the hosts' namespaces now, other than their sshd."""
    sshd = {p.pid for p in hosts._sshd}
    return [pid for pid in hosts.pids() if pid not in sshd]


def nothing_left_on(hosts: Hosts) -> list[int]:
    """Processes still running in the hosts' namespaces after 10 s, other than their sshd."""
    left = running_on(hosts)
    return [p.pid for p in wait_until_gone([psutil.Process(pid) for pid in left if
                                            psutil.pid_exists(pid)], timeout=10)]


def restart_psum_and_stop(shell, hosts: Hosts) -> None:
    """One %spmd restart has each host's rank server fork new ranks there, where a psum
    works; stop leaves nothing there."""
    before = [r.pid for r in magics(shell).session.ranks]
    out = run(shell, "%spmd restart")
    assert out.error is None, out.stderr
    assert "forked by the rank server" in out.stdout, out.stdout
    ranks = magics(shell).session.ranks
    assert [r.host for r in ranks] == ["node1", "node2"]
    assert [r.pid for r in ranks] != before
    assert run(shell, SETUP).error is None
    assert run(shell, PSUM).stdout == "[ranks 0-1] [2.]\n"
    run(shell, "%spmd stop")
    assert nothing_left_on(hosts) == []


# -- ssh --------------------------------------------------------------------------------------


def test_ssh_psum_across_two_hosts_on_an_encrypted_signed_channel(fresh, hosts):
    out = run(fresh, ssh_start(hosts))
    assert out.error is None, out.stdout + out.stderr
    assert out.stdout.startswith("Started 2 processes")
    status = run(fresh, "%spmd status").stdout
    assert re.search(r"^0\s+node1\s", status, re.M) and re.search(r"^1\s+node2\s", status, re.M)
    assert run(fresh, SETUP).error is None
    out = run(fresh, "print(socket.gethostname(), jax.process_count())")
    assert out.stdout == "[rank 0] node1 2\n[rank 1] node2 2\n", out.stdout + out.stderr
    out = run(fresh, PSUM)
    assert out.stdout == "[ranks 0-1] [2.]\n", out.stdout + out.stderr

    session = magics(fresh).session
    # The controller listens for ranks on the bridge's address only, not on all interfaces.
    bridge = session.record().address
    assert bridge not in ("127.0.0.1", "0.0.0.0") and bridge.rsplit(".", 1)[0] in hosts.addresses[0]
    controller = psutil.Process(session.record().cluster.controller.process.pid)
    listening = {c.laddr.ip for c in controller.net_connections() if c.status == "LISTEN"}
    # (its schedulers talk to each other on the loopback, which no other host reaches)
    assert listening - {"127.0.0.1"} == {bridge}
    # CurveZMQ encrypts, and the key still signs every message.
    security = os.path.join(session.record().cluster.profile_dir, "security")
    client_file = next(n for n in os.listdir(security) if n.endswith("-client.json"))
    with open(os.path.join(security, client_file)) as f:
        info = json.load(f)
    assert info["curve_serverkey"] and info["key"]
    # A client with the signing key but without the server's curve key gets no answer; with
    # it, the same request is answered (so the silence is the encryption's doing; the
    # answer, when it comes, comes in milliseconds).
    assert not hub_answers(info, curve=False, wait=1)
    assert hub_answers(info, curve=True)
    # So does the fan-out that sends a cell to the ranks.
    rank_0 = session.record().client._engines[session.ranks[0].engine_id]
    assert not fanout_answers(info, rank_0, "pass", curve=False, wait=1)
    assert fanout_answers(info, rank_0, "pass", curve=True)

    out = run(fresh, "%spmd stop")
    assert out.error is None
    assert nothing_left_on(hosts) == []


def test_ssh_export_runs_over_ssh_on_the_same_hosts(fresh, hosts):
    # (the hosts share this machine's files, but not its /tmp: the script goes in theirs)
    # node1 is named by an alias of this machine's ssh config, which the hosts cannot
    # resolve: the job's ranks reach rank 0 at the address they reached it at in the notebook
    alias = os.path.join(hosts.folder, "alias_config")
    with open(alias, "w") as f:
        f.write(f"Include {hosts.ssh_config}\nHost first\n  HostName {hosts.addresses[0]}\n")
    out = run(fresh, f"%spmd start -n 4 --hosts first,node2 --python {hosts.python} "
                     f'--launcher-arg "ssh_args=-F {alias}"')
    assert out.error is None, out.stdout + out.stderr
    assert run(fresh, SETUP).error is None
    assert run(fresh, "print('export', socket.gethostname(), rank, psum(jnp.ones(1)))").error is None
    printed = sorted(line for r in range(4) for line in magics(fresh).session.logs.read(r)[0]
                     .splitlines() if line.startswith("export "))
    linger = f"{hosts.folder}/linger"  # (the job waits there once this file exists)
    assert run(fresh, f"time.sleep(600 if os.path.exists({linger!r}) else 0)").error is None
    out = run(fresh, f"%spmd export {hosts.folder}/job.py")
    assert out.error is None, out.error
    assert "Run it with: bash job.sh" in out.stdout and "for host_count in first:2 node2:2" in out.stdout
    assert f"export MASTER_ADDR={hosts.addresses[0]} " in out.stdout
    run(fresh, "%spmd stop")
    job = subprocess.run(["bash", "job.sh"], cwd=hosts.folder, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONUNBUFFERED=""))
    assert job.returncode == 0, job.stdout + job.stderr
    # (each line begins with its rank: the rank the line itself prints)
    lines = [re.match(r"\[rank (\d+)\] (.*)", line).groups() for line in job.stdout.splitlines()
             if " export " in line]
    assert all(line.split()[2] == rank for rank, line in lines), lines
    assert sorted(line for _, line in lines) == printed
    assert printed[0] == "export node1 0 [4.]" and printed[-1] == "export node2 3 [4.]"
    assert nothing_left_on(hosts) == []
    # ^C in the terminal that runs the job (SIGINT to its process group) ends the processes
    # on the hosts too, though ssh gave them no terminal.
    open(linger, "w").close()
    job = subprocess.Popen(["bash", "job.sh"], cwd=hosts.folder, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(ranks := job_processes_on(hosts)) < 4:
            assert time.monotonic() < deadline and job.poll() is None, ranks
            time.sleep(0.1)
        time.sleep(1)  # (into their start, or their wait)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert nothing_left_on(hosts) == []


@pytest.mark.parametrize("how", ["rank 1 fails", "two ^C at once"])
def test_an_ssh_job_ends_on_every_host(how, hosts):
    """The exported job over ssh, one process on each namespace host, rank 0 waiting for rank 1
    in a collective: when rank 1 exits with code 3, or at two ^C at once, the launch ends
    within 10 s with that status (3, or ^C's 130) and nothing is left on either host."""
    folder = os.path.join(hosts.folder, f"ends-{how[0]}")
    os.makedirs(folder, exist_ok=True)
    cells = ["import sys, time\nfrom jax.experimental import multihost_utils\n"
             "print('job ready', rank, flush=True)\n"
             f"if rank == 1:\n    time.sleep({1 if how.startswith('rank') else 120})\n"
             "    sys.exit(3)\n"
             "multihost_utils.sync_global_devices('rank 0 waits')"]
    launch = write_job(folder, cells, launcher="ssh", python=hosts.python,
                       hosts=(("node1", 1), ("node2", 1)),
                       launcher_args=(("ssh_args", f"-F {hosts.ssh_config}"),))
    job = subprocess.Popen(["bash", launch], cwd=folder, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        said = b""
        while said.count(b"job ready") < 2:
            chunk = job.stdout.read1(65536)
            assert chunk, said.decode()
            said += chunk
        if how == "two ^C at once":
            os.killpg(job.pid, signal.SIGINT)
            os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=10) == (3 if how.startswith("rank") else 130)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    assert nothing_left_on(hosts) == []


def job_processes_on(hosts: Hosts) -> list[int]:
    """The exported job's processes running in the hosts' namespaces."""
    found = []
    for pid in running_on(hosts):
        with contextlib.suppress(psutil.Error):
            if any(arg.endswith("job.py") for arg in psutil.Process(pid).cmdline()):
                found.append(pid)
    return found


def test_ssh_rank_killed_in_a_collective_gives_the_death_report(fresh, hosts):
    assert run(fresh, ssh_start(hosts)).error is None
    assert run(fresh, SETUP).error is None
    out = run(
        fresh,
        "if rank == 1:\n    os.kill(os.getpid(), 9)\n" + PSUM,
    )
    text = report(out)
    # (its host's rank server is its parent there, and says how it ended)
    assert text.startswith("Rank 1 on node2 died: killed by SIGKILL"), text
    status = run(fresh, "%spmd status").stdout
    assert "died" in status
    restart_psum_and_stop(fresh, hosts)


def test_ssh_ranks_run_the_notebooks_python_or_a_python_under_the_hosts_home(fresh, hosts):
    """Without --python, the ranks run the notebook's own interpreter (its path), as the README
    says, not the host's python3; --python ~/... is the home folder's there (quoted whole,
    the ~ was not expanded, and the start failed)."""
    out = run(fresh, f"%spmd start -n 2 --backend none --hosts {','.join(hosts.names)} "
                     f"{hosts.launcher_arg}")
    assert out.error is None, out.stdout + out.stderr
    out = run(fresh, "import sys\nprint(sys.executable)")
    assert out.stdout == f"[ranks 0-1] {sys.executable}\n", out.stdout + out.stderr
    assert run(fresh, "%spmd stop").error is None
    folder = os.path.expanduser(f"~/.spmd-test-python-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    try:
        with open(f"{folder}/python", "w") as f:  # (a Python of the home folder's)
            f.write(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        os.chmod(f"{folder}/python", 0o755)
        python = f"~/{os.path.basename(folder)}/python"
        out = run(fresh, f"%spmd start -n 2 --backend none --hosts {','.join(hosts.names)} "
                         f"--python {python} {hosts.launcher_arg}")
        assert out.error is None, out.stdout + out.stderr
        assert "rank servers: node1 pid" in run(fresh, "%spmd status").stdout
        assert run(fresh, "print('ran')").stdout == "[ranks 0-1] ran\n"
        assert run(fresh, "%spmd stop").error is None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert nothing_left_on(hosts) == []


def test_ssh_ranks_are_forked_by_one_rank_server_per_host(fresh, hosts):
    """Each host runs one rank server (which imported the ranks' modules, and --preload's)
    and the ranks it forked there: no Python per rank."""
    out = run(fresh, ssh_start(hosts, n=4, extra="--backend none --preload colorsys"))
    assert out.error is None, out.stdout + out.stderr
    servers = magics(fresh).session.record().rank_server.servers
    pids = {host: server.pid for host, server in servers.items()}
    status = run(fresh, "%spmd status").stdout
    assert f"rank servers: node1 pid {pids['node1']}, node2 pid {pids['node2']}" in status, status
    out = run(
        fresh,
        "import os, socket, sys\n"
        "print(socket.gethostname(), os.getppid(), open('/proc/self/comm').read().strip(),\n"
        "      'colorsys' in sys.modules, os.getpgid(0) == os.getpid())",
    )
    assert out.stdout.splitlines() == [
        f"[rank {r}] {host} {pids[host]} spmd-rank{r} True True"
        for r, host in enumerate(["node1", "node1", "node2", "node2"])
    ], out.stdout
    # one string-hash secret for the whole cluster, on every host: a set's order is the same
    out = run(fresh, "print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon'}))")
    assert out.stdout.startswith("[ranks 0-3] ["), out.stdout
    pythons = [p for p in map(psutil.Process, hosts.pids()) if "python" in p.name().lower()
               or p.name().startswith("spmd-rank")]
    assert sorted(p.ppid() for p in pythons if p.pid not in pids.values()) == sorted(
        [pids["node1"]] * 2 + [pids["node2"]] * 2
    ), [(p.pid, p.ppid(), p.name()) for p in pythons]
    assert run(fresh, "%spmd stop").error is None
    assert nothing_left_on(hosts) == []


def test_ssh_a_rank_server_killed_on_its_host_is_named_and_restart_starts_afresh(fresh, hosts):
    assert run(fresh, ssh_start(hosts)).error is None
    assert run(fresh, SETUP).error is None
    server = magics(fresh).session.record().rank_server.of("node2")
    hosts.ssh("node2", f"kill -KILL {server.pid}")
    out = run(fresh, "time.sleep(3)\n" + PSUM)
    text = report(out)
    assert text.startswith(
        f"Rank 1 on node2 died: its rank server (pid {server.pid} on node2) ended"
    ), text
    assert "every rank it forked ended with it" in text, text
    restarted = run(fresh, "%spmd restart")  # (afresh: new servers)
    assert restarted.error is None, restarted.stdout + restarted.stderr
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    assert run(fresh, "%spmd stop").error is None
    assert nothing_left_on(hosts) == []


def test_ssh_a_rank_server_that_cannot_import_falls_back_with_one_line(fresh, hosts):
    out = run(fresh, ssh_start(hosts, extra="--backend none --preload no_such_module_for_spmd"))
    assert out.error is None, out.stdout + out.stderr
    said = [line for line in out.stdout.split("\r")[-1].splitlines() if "rank server" in line]
    assert said == [
        "The rank server could not be used (on node1, ModuleNotFoundError: No module named "
        "'no_such_module_for_spmd'): each rank started its own Python."
    ], out.stdout
    assert magics(fresh).session.record().rank_server is None
    out = run(fresh, "import socket\nprint(socket.gethostname())")
    assert out.stdout == "[rank 0] node1\n[rank 1] node2\n", out.stdout
    assert run(fresh, "%spmd stop").error is None
    assert nothing_left_on(hosts) == []


KILLED_NOTEBOOK = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "spmd")
for cell in sys.argv[1:]:
    shell.run_cell(cell)
s = shell.magics_manager.registry["SpmdMagics"].session
print("STARTED", s is not None and s.running, flush=True)
import time
time.sleep(600)
"""


def test_ssh_a_notebook_killed_leaves_nothing_here_or_on_the_hosts(fresh, hosts, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(KILLED_NOTEBOOK)
    notebook = subprocess.Popen(
        [sys.executable, str(script), ssh_start(hosts, extra="--linger 0")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = next((ln for ln in notebook.stdout if ln.startswith("STARTED")), "")
        assert line.strip() == "STARTED True", line
        assert len(running_on(hosts)) >= 4  # (a server and a rank on each host)
        here = psutil.Process(notebook.pid).children(recursive=True)
        assert here  # (its controller, the ssh connections)
    finally:
        notebook.kill()  # no atexit, no stop
        notebook.wait()
        notebook.stdout.close()
    assert not wait_until_gone(here, 15)
    assert nothing_left_on(hosts) == []
    for name in hosts.names:  # (each host's server removed the cluster's folder there)
        assert hosts.leftovers(name) == [], name


def killed_notebook(tmp_path, *cells: str) -> list[psutil.Process]:
    """A notebook process that runs ``cells``, then is killed (no atexit, no stop): what it
    had started here."""
    script = tmp_path / "notebook.py"
    script.write_text(KILLED_NOTEBOOK)
    notebook = subprocess.Popen([sys.executable, str(script), *cells], stdout=subprocess.PIPE,
                                text=True)
    try:
        line = next((ln for ln in notebook.stdout if ln.startswith("STARTED")), "")
        assert line.strip() == "STARTED True", line
        return psutil.Process(notebook.pid).children(recursive=True)
    finally:
        notebook.kill()
        notebook.wait()
        notebook.stdout.close()


def stop_every_cluster() -> None:
    subprocess.run([sys.executable, "-m", "spmd", "stop", "--all"], capture_output=True,
                   timeout=60)


def test_ssh_ranks_linger_after_their_notebook_died_and_a_new_one_attaches(
        fresh, hosts, tmp_path, monkeypatch, request):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    here = killed_notebook(tmp_path, ssh_start(hosts, extra="--linger 2m"), SETUP,
                           "x = 10 + rank")
    request.addfinalizer(stop_every_cluster)  # (a failure half-way leaves nothing lingering)
    time.sleep(3)  # (past every watch's period: nothing ended with the notebook)
    assert len(running_on(hosts)) >= 4  # (a server and a rank on each host)
    out = run(fresh, "%spmd attach")
    assert out.error is None, out.stdout + out.stderr
    assert out.stdout.startswith("Attached to cluster"), out.stdout
    assert run(fresh, "print(socket.gethostname(), x)").stdout == (
        "[rank 0] node1 10\n[rank 1] node2 11\n")
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    assert run(fresh, "%spmd stop").error is None
    assert not wait_until_gone(here, 15)
    assert nothing_left_on(hosts) == []
    for name in hosts.names:  # (each host's server removed the cluster's folder there)
        assert hosts.leftovers(name) == [], name


def test_ssh_a_linger_never_attached_ends_here_and_on_the_hosts(hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    here = killed_notebook(tmp_path, ssh_start(hosts, extra="--backend none --linger 2s"))
    assert len(running_on(hosts)) >= 4
    # The controller ends when the linger is over; the ranks on the hosts when their server
    # finds it gone (a few seconds: spmd/engine/server.py) or they miss its heartbeats, and
    # each host's server with them.
    assert not wait_until_gone(here, 2 + 15)
    deadline = time.monotonic() + 40
    while running_on(hosts) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert nothing_left_on(hosts) == []
    for name in hosts.names:
        assert hosts.leftovers(name) == [], name
    assert not [r for r in os.listdir(tmp_path / "runtime") if r.startswith("spmd-cluster-")]


def test_ssh_a_kernelspec_for_the_hosts_starts_its_ranks_there(hosts):
    """A kernel made with --launcher ssh --hosts ... (what a person picks from the launcher)
    starts its ranks on those hosts, driven here through jupyter_client."""
    from spmd.kernel.kernelspec import install, remove

    install(
        "spmd-hosts-test", user=True, processes=2,
        cluster=f"--launcher ssh --hosts {','.join(hosts.names)} --python {hosts.python} "
                f"--launcher-arg 'ssh_args=-F {hosts.ssh_config}'",
    )
    try:
        with spmd_kernel("spmd-hosts-test") as (km, kc):
            reply, shown = kernel_stream(kc, "import socket\nprint(socket.gethostname())")
            assert reply["content"]["status"] == "ok", shown
            assert shown.endswith("[rank 0] node1\n[rank 1] node2\n"), shown
    finally:
        remove("spmd-hosts-test")
    assert nothing_left_on(hosts) == []


def test_ssh_blocked_rank_shows_where_it_is_and_takes_the_interrupt(fresh, hosts):
    assert run(fresh, ssh_start(hosts)).error is None
    assert run(fresh, SETUP).error is None
    out = run(fresh, "%%spmd --timeout 1\nif rank == 1:\n    time.sleep(60)\n")
    text = report(out)
    # rank 1's stack came over its control channel, from node2
    assert "[rank 1] was running at cell line 2: time.sleep(60)" in text
    # ... and the interrupt reached it there: it is idle, nobody is left busy
    assert "did not respond" not in text
    assert magics(fresh).session.busy_ranks() == []
    restart_psum_and_stop(fresh, hosts)


def test_ssh_processes_a_remote_cell_started_end_with_the_cluster(fresh, hosts):
    assert run(fresh, ssh_start(hosts, extra="--backend none")).error is None
    out = run(fresh, "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nchild.pid")
    assert out.error is None
    assert len(running_on(hosts)) >= 4  # two engines, two sleeps
    assert run(fresh, "%spmd stop").error is None
    assert nothing_left_on(hosts) == []


def test_torch_over_ssh_all_reduces_with_gloo_on_the_hosts_own_interface(fresh, hosts):
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    out = run(fresh, ssh_start(hosts, extra="--backend torch"))
    assert out.error is None, out.stdout + out.stderr
    out = run(
        fresh,
        "import os, socket, torch, torch.distributed as dist\n"
        "t = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print(socket.gethostname(), os.environ['MASTER_ADDR'], t.item())",
    )
    node1 = hosts.addresses[0].split("/")[0]
    assert out.stdout == f"[rank 0] node1 {node1} 3.0\n[rank 1] node2 {node1} 3.0\n", (
        out.stdout + out.stderr
    )
    # gloo and rank 0's TCPStore listen on the address toward the notebook, not everywhere
    out = run(
        fresh,
        "import psutil\n"
        "print(sorted({c.laddr.ip for c in psutil.Process().net_connections('tcp') "
        "if c.status == 'LISTEN'} - {'127.0.0.1'}), os.environ['GLOO_SOCKET_IFNAME'] != 'lo')",
    )
    assert "0.0.0.0" not in out.stdout and "::" not in out.stdout, out.stdout
    assert f"[rank 0] ['{node1}'] True" in out.stdout, out.stdout
    run(fresh, "%spmd stop")
    assert nothing_left_on(hosts) == []


def test_ssh_four_ranks_fill_the_hosts_in_order(fresh, hosts):
    # (a host named with its login, user@host, is the same host)
    start = ssh_start(hosts, n=4, extra="--backend none").replace(
        "--hosts node1,node2 ", f"--hosts {getpass.getuser()}@node1:2,node2:2 "
    )
    out = run(fresh, start)
    assert out.error is None, out.stdout + out.stderr
    status = run(fresh, "%spmd status").stdout
    placed = re.findall(r"^(\d)\s+(node\d)\s", status, re.M)
    assert placed == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")]
    out = run(fresh, "import os\nprint(os.environ['LOCAL_RANK'])")
    assert out.stdout == "[ranks 0,2] 0\n[ranks 1,3] 1\n"
    run(fresh, "%spmd stop")
    assert nothing_left_on(hosts) == []


def test_ssh_bad_hosts_give_one_sentence_and_leave_nothing(fresh, hosts, tmp_path):
    with pytest.raises(UsageError, match=r"the host nosuchhost cannot be found: check its name"):
        fresh.run_line_magic("spmd", f"start -n 2 --hosts nosuchhost,node2 {hosts.launcher_arg}")
    # a key the hosts do not know: ssh refuses, and says so
    config = tmp_path / "ssh_config"
    with open(hosts.ssh_config) as f:
        config.write_text(f.read().replace("IdentityFile", "IdentityFile /nonexistent #"))
    with pytest.raises(UsageError, match=r"ssh on node1, node2 failed \(.*Permission denied"):
        fresh.run_line_magic(
            "spmd", f'start -n 2 --hosts node1,node2 --launcher-arg "ssh_args=-F {config}"'
        )
    # a --python that is not there
    with pytest.raises(UsageError, match=r"--python names a Python with jupyter-spmd"):
        fresh.run_line_magic("spmd", ssh_start(hosts, extra="").replace(
            f"--python {hosts.python}", "--python /nonexistent/python3"
        ).removeprefix("%spmd "))
    assert nothing_left_on(hosts) == []
    assert magics(fresh).session is None or not magics(fresh).session.running


def test_ssh_jax_missing_on_the_hosts_says_so(fresh, hosts):
    # A Python on the hosts where jax cannot be imported (in the folder the hosts share).
    tmp_path = Path(hosts.folder)
    fake = tmp_path / "nojax" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'jax'\")\n")
    python = tmp_path / "python-without-jax"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    with pytest.raises(UsageError, match=r"jax cannot be imported in the engines' Python"):
        fresh.run_line_magic(
            "spmd", ssh_start(hosts).replace(hosts.python, str(python)).removeprefix("%spmd ")
        )
    assert nothing_left_on(hosts) == []


def test_ssh_hosts_slower_than_the_start_timeout_are_named(fresh, hosts):
    # A Python that takes 60 s to start an engine there (and no time for anything else).
    python = Path(hosts.folder) / "slow-python"
    python.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *spmd.engine*) exec {sys.executable} -c '
        f'"import os, sys, time; time.sleep(60); os.execv(sys.executable, sys.argv)" "$@";; '
        f'esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=(
        r"Only 0 of 2 engines registered within 1 s; ranks 0-1 \(on node1, node2\) did not: "
        r"check the engines' Python environment there, or give them more time with "
        r"--start-timeout"
    )):
        fresh.run_line_magic("spmd", ssh_start(hosts, extra="--start-timeout 1").replace(
            hosts.python, str(python)).removeprefix("%spmd "))
    assert time.monotonic() - t0 < 30
    assert nothing_left_on(hosts) == []


# on: each host's rank server makes its folder; off: the first rank's ssh command of each host
@pytest.mark.parametrize("rank_server", ["on", "off"])
def test_ssh_stop_leaves_no_file_on_the_hosts_and_their_files_are_private(
    fresh, hosts, rank_server
):
    # (each host has its own /tmp, as on a cluster: the notebook's clean-up cannot reach it)
    out = run(fresh, ssh_start(hosts, extra=f"--rank-server {rank_server}"))
    assert out.error is None, out.stdout + out.stderr
    profile = magics(fresh).session.record().profile_dir
    for name in hosts.names:
        assert hosts.ssh(name, f"stat -c %a {profile}").strip() == "700"
        assert hosts.ssh(name, f"ls {profile}/log").count("ipengine-") == 1
    assert run(fresh, "%spmd stop").error is None
    for name in hosts.names:
        assert hosts.leftovers(name) == [], name
    assert nothing_left_on(hosts) == []


def test_ssh_python_paths_are_quoted_on_the_hosts(fresh, hosts):
    spaced = os.path.join(hosts.folder, "a python")
    os.makedirs(spaced, exist_ok=True)
    python = os.path.join(spaced, "python3")  # (this environment's Python, by another path)
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    os.chmod(python, 0o755)
    out = run(fresh, ssh_start(hosts, extra="").replace(
        f"--python {hosts.python}", f"--python '{python}'"))
    assert out.error is None, out.stdout + out.stderr
    assert run(fresh, "%spmd stop").error is None
    # a ; in it is part of the name, not a second command
    marker = os.path.join(hosts.folder, "ran")
    with pytest.raises(UsageError, match="--python names a Python with jupyter-spmd"):
        fresh.run_line_magic("spmd", ssh_start(hosts).replace(
            f"--python {hosts.python}", f"--python '{sys.executable}; touch {marker}'"
        ).removeprefix("%spmd "))
    assert not os.path.exists(marker)
    assert nothing_left_on(hosts) == []


def test_ssh_every_command_goes_through_the_ssh_command_given(fresh, hosts):
    # --launcher-arg ssh_cmd=...: a wrapper that notes each call, then runs ssh with -v (whose
    # chatter on the master connection's stderr once went to a pipe nobody read)
    calls = os.path.join(hosts.folder, "ssh-calls")
    wrapper = os.path.join(hosts.folder, "noted-ssh")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\necho "$*" >> {calls}\nexec ssh -v "$@"\n')
    os.chmod(wrapper, 0o755)
    out = run(fresh, ssh_start(hosts, extra=f"--launcher-arg ssh_cmd={wrapper}"))
    assert out.error is None, out.stdout + out.stderr
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    assert run(fresh, "%spmd stop").error is None
    with open(calls) as f:
        noted = f.read().splitlines()
    os.remove(calls)
    # the address lookup, the master connections, and the engines' commands all came here
    assert any(" -G node1" in c for c in noted), noted
    assert sum("ControlMaster=yes" in c for c in noted) == 2, noted
    assert any("ControlMaster=no" in c for c in noted), noted
    assert nothing_left_on(hosts) == []


def node2_cut_off(shell, cut: Hosts, start: str) -> str:
    """Start 2 ranks on node1 and node2 with ``start``, then take node2's link down in the
    middle of a cell: the report comes within seconds (its text is returned), and the stop
    returns within seconds."""
    out = run(shell, start)
    assert out.error is None, out.stdout + out.stderr
    assert run(shell, SETUP).error is None
    assert run(shell, PSUM).stdout == "[ranks 0-1] [2.]\n"
    timer = threading.Timer(1.0, cut.cut, ("node2",))
    timer.start()
    t0 = time.monotonic()
    out = run(shell, "time.sleep(2)\n" + PSUM)
    reported = time.monotonic() - t0
    timer.join()
    assert reported < 20, reported  # the link went down 1 s in
    t0 = time.monotonic()
    assert run(shell, "%spmd stop").error is None
    assert time.monotonic() - t0 < 10
    return report(out)


def test_ssh_a_host_cut_off_is_reported_within_seconds_and_stop_returns(fresh):
    with Hosts(2) as cut:  # (hosts of its own: one of them loses its link)
        text = node2_cut_off(fresh, cut, ssh_start(cut))
        assert re.match(r"Rank 1 on node2 died: it(s host)? stopped answering", text), text
        # node1 still answers: nothing is left there
        sshd = {p.pid for p in cut._sshd}
        node1 = cut._namespaces[0]
        on_node1 = subprocess.run(["ip", "netns", "pids", node1], capture_output=True, text=True)
        left = [int(p) for p in on_node1.stdout.split() if int(p) not in sshd]
        assert not wait_until_gone([psutil.Process(p) for p in left if psutil.pid_exists(p)], 10)


# -- mpi --------------------------------------------------------------------------------------

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="mpiexec is not installed (apt-get install mpich)"
)


@needs_mpiexec
def test_mpi_psum_with_ranks_from_mpiexec(fresh):
    before = {p.pid for p in spmd_processes()}
    out = run(fresh, "%spmd start -n 2 --launcher mpi")
    assert out.error is None, out.stdout + out.stderr
    assert run(fresh, SETUP).error is None
    out = run(fresh, "print(os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK'], rank)")
    assert out.stdout == "[rank 0] 0 0\n[rank 1] 1 1\n"
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    # a rank that dies takes mpiexec's whole job down; the report names the rank mpiexec
    # names (almost always the one that died: which end mpiexec sees first is a race)
    out = run(fresh, "if rank == 1:\n    os.kill(os.getpid(), 9)\n" + PSUM)
    text = report(out)
    assert re.match(r"Rank [01] died: mpiexec says it ended by SIGKILL\.", text), text
    assert run(fresh, "%spmd restart").error is None
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    run(fresh, "%spmd stop")
    assert wait_until_gone(started_since(before)) == []


@needs_mpiexec
def test_mpi_with_a_host_file_listens_where_other_machines_reach_it(fresh, tmp_path):
    # mpiexec may put ranks on any machine of its host file: the controller cannot stay on
    # the loopback (ranks elsewhere would never register), and its traffic is encrypted.
    before = {p.pid for p in spmd_processes()}
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost:2\n")
    out = run(fresh, f'%spmd start -n 2 --launcher mpi --launcher-arg "mpi_args=-f {hostfile}"')
    assert out.error is None, out.stdout + out.stderr
    session = magics(fresh).session
    assert session.record().address != "127.0.0.1"
    assert session.settings.where.leaves_machine  # (so CurveZMQ is on)
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    assert run(fresh, "%spmd stop").error is None
    assert not wait_until_gone(started_since(before), 10)


@needs_mpiexec
def test_mpi_where_and_interrupt_reach_ranks_without_handles(fresh):
    before = {p.pid for p in spmd_processes()}
    assert run(fresh, "%spmd start -n 2 --launcher mpi").error is None
    assert run(fresh, SETUP).error is None
    text = report(run(fresh, "%%spmd --timeout 1\nif rank == 0:\n    time.sleep(60)\n"))
    assert "[rank 0] was running at cell line 2: time.sleep(60)" in text
    assert magics(fresh).session.busy_ranks() == []
    run(fresh, "%spmd stop")
    assert wait_until_gone(started_since(before)) == []


# -- slurm ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    from slurm import Slurm
    from slurm import why_not as slurm_why_not

    reason = slurm_why_not()
    if reason:
        pytest.skip(f"no Slurm here: {reason}")
    with Slurm() as made, made.as_default():  # (sbatch and scancel find this cluster)
        yield made


def test_slurm_psum_with_ranks_from_srun_and_sbatch_options(fresh, slurm):
    out = run(
        fresh,
        "%spmd start -n 2 --launcher slurm --launcher-arg partition=debug "
        "--launcher-arg time=10 --launcher-arg comment=spmd-test",
    )
    assert out.error is None, out.stdout + out.stderr
    session = magics(fresh).session
    with open(f"{session.record().cluster.profile_dir}/engines.sbatch") as f:
        script = f.read()
    # Slurm's own option names reach the batch script
    for line in ("#SBATCH --partition=debug", "#SBATCH --time=10", "#SBATCH --comment=spmd-test"):
        assert line in script, script
    assert "srun " in script and "spmd.engine" in script
    assert len(slurm.jobs().splitlines()) == 1
    assert run(fresh, SETUP).error is None
    out = run(fresh, "print(os.environ['SLURM_PROCID'], rank)")
    assert out.stdout == "[rank 0] 0 0\n[rank 1] 1 1\n"
    assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
    run(fresh, "%spmd stop")
    deadline = time.monotonic() + 30
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm.jobs() == ""


def test_slurm_a_notebook_killed_leaves_no_batch_job(slurm, tmp_path):
    """The notebook killed with SIGKILL (no stop runs): its controller ends with it, the ranks
    miss its heartbeat and exit, and with them the batch job, which frees its nodes."""
    script = tmp_path / "notebook.py"
    script.write_text(KILLED_NOTEBOOK)
    notebook = subprocess.Popen(
        # (ranks that give up after 8 missed checks of the heartbeat, not 20: the same end,
        # 7 s sooner)
        [sys.executable, str(script), "import spmd.cluster.launchers.launch as launch\n"
         "launch.RANK_HEARTBEAT_MISSES = 8", "%spmd start -n 2 --launcher slurm --backend none"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = next((ln for ln in notebook.stdout if ln.startswith("STARTED")), "")
        assert line.strip() == "STARTED True", line
        assert len(slurm.jobs().splitlines()) == 1
    finally:
        notebook.kill()
        notebook.wait()
        notebook.stdout.close()
    killed = time.monotonic()
    while slurm.jobs() and time.monotonic() < killed + 90:
        time.sleep(0.1)
    assert slurm.jobs() == "", "the batch job outlived the notebook"
    assert time.monotonic() - killed < 45  # (~6 s: 8 missed checks of the heartbeat)


def test_slurm_inside_an_allocation_runs_the_ranks_as_steps_of_it(fresh, slurm, monkeypatch):
    """JupyterLab inside an allocation (salloc, then jupyter lab): the ranks are srun steps of
    that job, with no batch job and no queue; a restart is a new step; stop ends the step and
    leaves the allocation (it is the person's)."""
    env = dict(os.environ, **slurm.env)
    granted = subprocess.run(["salloc", "--no-shell", "-n", "2", "--immediate=30"],
                             capture_output=True, text=True, env=env, timeout=60)
    job = re.search(r"Granted job allocation (\d+)", granted.stderr)
    assert job, granted.stderr
    job = job.group(1)
    try:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_NTASKS", "2")  # (what salloc -n 2 tells the shell)
        out = run(fresh, "%spmd start --launcher slurm")  # (-n: the allocation's tasks)
        assert out.error is None, out.stdout + out.stderr
        assert len(slurm.jobs().splitlines()) == 1  # (the allocation: nothing was queued)
        assert run(fresh, SETUP).error is None
        where = "print(os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID'], rank)"
        out = run(fresh, where)
        assert out.stdout == f"[rank 0] {job} 0 0\n[rank 1] {job} 1 1\n", out.stdout
        assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
        step = run(fresh, "print(os.environ['SLURM_STEP_ID'])").stdout
        assert run(fresh, "%spmd restart").error is None  # (a new step of the same job)
        assert run(fresh, SETUP).error is None
        assert run(fresh, PSUM).stdout == "[ranks 0-1] [2.]\n"
        assert run(fresh, "print(os.environ['SLURM_STEP_ID'])").stdout != step
        assert run(fresh, "%spmd stop").error is None
        steps = lambda: subprocess.run(  # noqa: E731
            ["squeue", "-h", "-s", "-j", job], capture_output=True, text=True, env=env
        ).stdout.strip()
        deadline = time.monotonic() + 30
        while steps() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert steps() == ""
        assert len(slurm.jobs().splitlines()) == 1  # (the allocation stays the person's)
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=env)


# -- Slurm on two nodes: the namespace hosts as compute nodes --------------------------------


@pytest.fixture
def nodes(hosts):
    from slurm import HostsSlurm
    from slurm import why_not as slurm_why_not

    reason = slurm_why_not() or (None if shutil.which("nsenter") else "nsenter is missing")
    if reason:
        pytest.skip(f"no Slurm here: {reason}")
    with HostsSlurm(hosts) as made, made.as_default():
        yield made


PLACED = "print(socket.gethostname(), os.environ['SLURM_NODEID'], os.environ['SLURM_PROCID'], rank)"
ON_TWO_NODES = (
    "[rank 0] node1 0 0 0\n[rank 1] node1 0 1 1\n[rank 2] node2 1 2 2\n[rank 3] node2 1 3 3\n"
)


def left_on_nodes(hosts: Hosts, slurm) -> list[int]:
    """What still runs on the hosts after 10 s, but their sshd and slurmd."""
    keep = slurm.daemon_pids()
    left = [pid for pid in running_on(hosts) if pid not in keep]
    return [p.pid for p in wait_until_gone([psutil.Process(pid) for pid in left if
                                            psutil.pid_exists(pid)], timeout=10)]


def test_slurm_on_two_nodes_by_sbatch_places_reports_and_restarts(nodes, hosts, fresh):
    start = ("%spmd start -n 4 --launcher slurm --launcher-arg nodes=2 "
             f"--launcher-arg ntasks-per-node=2 --python {hosts.python}")
    out = run(fresh, start)
    assert out.error is None, out.stdout + out.stderr
    # the controller listens on the bridge, where the nodes reach it
    assert magics(fresh).session.record().address.rsplit(".", 1)[0] in hosts.addresses[0]
    assert run(fresh, SETUP).error is None
    out = run(fresh, PLACED)
    assert out.stdout == ON_TWO_NODES, out.stdout + out.stderr
    assert run(fresh, PSUM).stdout == "[ranks 0-3] [4.]\n"
    # (outside a collective: in one, gloo's error on the rank beside it comes first, and the
    # report says that; srun's ranks have no handle here, so their end is the heartbeat's)
    out = run(fresh, "if rank == 3:\n    os.kill(os.getpid(), 9)\ntime.sleep(8)")
    text = report(out)
    assert text.startswith("Rank 3 on node2 died"), text
    restarted = run(fresh, "%spmd restart")  # (afresh: a new batch job)
    assert restarted.error is None, restarted.stdout + restarted.stderr
    assert run(fresh, SETUP).error is None
    assert run(fresh, PSUM).stdout == "[ranks 0-3] [4.]\n"
    assert run(fresh, "%spmd stop").error is None
    deadline = time.monotonic() + 30
    while nodes.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert nodes.jobs() == ""
    assert left_on_nodes(hosts, nodes) == []


def test_slurm_on_two_nodes_inside_an_allocation(nodes, hosts, fresh, monkeypatch):
    env = dict(os.environ, **nodes.env)
    granted = subprocess.run(["salloc", "--no-shell", "-N", "2", "-n", "4", "--ntasks-per-node=2",
                              "--immediate=30"],
                             capture_output=True, text=True, env=env, timeout=60)
    job = re.search(r"Granted job allocation (\d+)", granted.stderr)
    assert job, granted.stderr
    job = job.group(1)
    try:
        # (what a shell in the allocation has: salloc --no-shell gives none)
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
        out = run(fresh, f"%spmd start -n 4 --launcher slurm --python {hosts.python}")
        assert out.error is None, out.stdout + out.stderr
        assert len(nodes.jobs().splitlines()) == 1  # (the allocation: nothing queued)
        assert run(fresh, SETUP).error is None
        out = run(fresh, PLACED)
        assert out.stdout == ON_TWO_NODES, out.stdout + out.stderr
        assert run(fresh, PSUM).stdout == "[ranks 0-3] [4.]\n"
        assert run(fresh, "%spmd stop").error is None
        assert left_on_nodes(hosts, nodes) == []
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=env)


def test_slurm_a_node_cut_off_inside_an_allocation_is_reported_and_stop_returns(fresh, monkeypatch):
    from slurm import HostsSlurm
    from slurm import why_not as slurm_why_not

    reason = slurm_why_not() or why_not()
    if reason:
        pytest.skip(f"no Slurm on namespace hosts here: {reason}")
    with Hosts(2) as cut, HostsSlurm(cut) as nodes:  # (its own: one node loses its link)
        env = dict(os.environ, **nodes.env)
        monkeypatch.setenv("SLURM_CONF", nodes.conf)
        granted = subprocess.run(
            ["salloc", "--no-shell", "-N", "2", "-n", "2", "--ntasks-per-node=1",
             "--immediate=30"], capture_output=True, text=True, env=env, timeout=60,
        )
        job = re.search(r"Granted job allocation (\d+)", granted.stderr)
        assert job, granted.stderr
        monkeypatch.setenv("SLURM_JOB_ID", job.group(1))
        monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
        start = f"%spmd start -n 2 --launcher slurm --python {cut.python}"
        text = node2_cut_off(fresh, cut, start)
        assert text.startswith("Rank 1 on node2 died"), text
        # (node2's link back up: Slurm ends the allocation there at once, where it would
        # otherwise wait for the node, and the daemons' end with it, 30 s)
        subprocess.run(["ip", "-n", cut._namespaces[1], "link", "set", "eth0", "up"],
                       check=True, capture_output=True)
        subprocess.run(["scancel", job.group(1)], capture_output=True, env=env)
