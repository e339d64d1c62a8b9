"""The SPMD kernel, driven through the Jupyter protocol as a front end drives it.

Protocol conformance comes from jupyter_kernel_test against the installed kernelspec (2 ranks,
installed by conftest into this test run's own Jupyter folder). Interrupt, restart, shutdown
and a killed kernel each get a kernel of their own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import jupyter_kernel_test
import pytest
from conftest import SPMD_KERNEL, kernel_stream, spmd_kernel, spmd_processes, wait_until_gone
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager, start_new_kernel
from jupyter_kernel_test.msgspec_v5 import validate_message

from spmd.wire import RANKS_DATA_MIME

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("spmd_kernelspec")]

jupyter_kernel_test.TIMEOUT = 60  # a cell waits for the ranks to start when it comes first


class TestSpmdKernelProtocol(jupyter_kernel_test.KernelTests):
    kernel_name = SPMD_KERNEL
    language_name = "python"
    file_extension = ".py"

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        # Waits for the kernel's own cluster, and defines a name on the ranks only.
        reply = cls.kc.execute_interactive("only_on_ranks = 12345", timeout=120)
        assert reply["content"]["status"] == "ok"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    code_execute_result = [
        # (the stock samples: every rank returned the same, so the result is the value)
        {"code": "6*7", "result": "42"},
        {"code": "import os; os.getpid() > 0", "result": "True"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>x</b>'))",
            "mime": "text/html",
        },
    ]
    # (completion is tested below: the stock test asks once, and rank 0 may miss its 2 s)
    completion_samples = []

    def execute_helper(self, *args, **kwargs):
        # The stock tests, on the outputs a person sees: every cell on the ranks also shows its
        # per-rank data, a display output of its own MIME type with an empty text, last
        # (before an error), for programs (tests/test_ranks_data.py reads it).
        reply, output_msgs = super().execute_helper(*args, **kwargs)
        return reply, [m for m in output_msgs if not (
            m["msg_type"] == "display_data" and RANKS_DATA_MIME in m["content"]["data"])]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_inspect_sample = "only_on_ranks"
    supported_history_operations = ("tail", "search")  # "range": IPython numbers the
    # current session 0 in a tail and by its number in a range, in any kernel
    code_history_pattern = "6[*]7"  # (only the sample: the history file outlives a run)
    code_clear_output = "from IPython.display import clear_output; clear_output()"
    code_generate_error = "raise ValueError('boom')"

    def test_every_cell_runs_on_every_rank(self) -> None:
        self.flush_channels()
        reply, outputs = self.execute_helper("import os; print(os.environ['SPMD_RANK'])")
        assert reply["content"]["status"] == "ok"
        text = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        assert text == "[rank 0] 0\n[rank 1] 1\n"

    def _from_rank_0(self, ask, answered) -> dict:
        """The reply to ``ask()`` once rank 0 answered it. Rank 0 has ``answer_seconds`` (2 s);
        on a loaded machine it can miss them, and the notebook answers from its own names
        instead (as it should): a person's Tab would simply be pressed again."""
        for _ in range(3):
            reply = ask()
            if answered(reply["content"]):
                break
        return reply

    def test_completion_answers_from_rank_0(self) -> None:
        reply = self._from_rank_0(
            lambda: self.kc.complete("only_on_ran", reply=True, timeout=30),
            lambda c: c["matches"])
        validate_message(reply, "complete_reply", reply["parent_header"]["msg_id"])
        assert reply["content"]["matches"] == ["only_on_ranks"]

    def test_inspection_answers_from_rank_0(self) -> None:
        reply = self._from_rank_0(
            lambda: self.kc.inspect("only_on_ranks", 5, reply=True, timeout=30),
            lambda c: c["found"])
        assert reply["content"]["found"]
        assert "12345" in reply["content"]["data"]["text/plain"]

    def test_local_cells_and_their_names_stay_in_the_notebook(self) -> None:
        self.flush_channels()
        reply, outputs = self.execute_helper("%%local\nnotebook_only = 7\nnotebook_only")
        assert reply["content"]["status"] == "ok"
        (result,) = [m for m in outputs if m["msg_type"] == "execute_result"]
        assert result["content"]["data"]["text/plain"] == "7"
        # rank 0 does not have it, so the notebook's own namespace answers
        reply = self.kc.complete("notebook_on", reply=True, timeout=30)
        assert reply["content"]["matches"] == ["notebook_only"]


def rank_engines(procs) -> list:
    """The engines among ``procs`` that are ranks: not the rank server that forks them and
    whose command line they keep (see %spmd status), and not a process a rank forked a moment
    ago to run a command, which has its rank's name and command line until it execs."""
    engines = [
        p
        for p in procs
        if "spmd.engine" in " ".join(p.cmdline())
        and (p.name().startswith("spmd-rank") or "spmd.engine.server" not in p.cmdline())
    ]
    pids = {p.pid for p in engines}
    return [p for p in engines if p.ppid() not in pids]


def test_a_first_cell_with_spmd_start_gets_that_cluster_never_two():
    with spmd_kernel() as (km, kc):
        kernel_pid = km.provisioner.process.pid
        reply, text = kernel_stream(kc, "%spmd start -n 3 --backend none")
        assert reply["content"]["status"] == "ok"
        timeline, summary = text.splitlines()
        assert re.match(r"3 engines registered in \d+\.\d s; 3 ranks joined in", timeline)
        assert summary.startswith("Started 3 processes (none)")
        engines = rank_engines(spmd_processes(kernel_pid))
        assert len(engines) == 3  # the kernelspec's 2 ranks were cancelled or stopped
        reply, text = kernel_stream(kc, "import os; print(os.environ['SPMD_NUM_PROCESSES'])")
        assert text == "[ranks 0-2] 3\n"
    assert not wait_until_gone(spmd_processes(kernel_pid))


def test_a_config_file_that_changes_the_kernelspecs_settings_gets_its_own_cluster(tmp_path):
    # The kernel starts the kernelspec's cluster before ipykernel is up; a setting from
    # ipython_kernel_config.py (one the kernelspec's argv does not give), read later,
    # replaces that start, and only its ranks remain.
    profile = tmp_path / "profile_default"
    profile.mkdir()
    (profile / "ipython_kernel_config.py").write_text("c.SpmdKernel.devices_per_process = 3\n")
    with spmd_kernel(env=dict(os.environ, IPYTHONDIR=str(tmp_path))) as (km, kc):
        kernel_pid = km.provisioner.process.pid
        reply, text = kernel_stream(kc, "import jax; print(jax.local_device_count())")
        assert reply["content"]["status"] == "ok", text
        assert text.splitlines()[-1] == "[ranks 0-1] 3", text
        assert len(rank_engines(spmd_processes(kernel_pid))) == 2
    assert not wait_until_gone(spmd_processes(kernel_pid))


def test_spmd_start_with_the_kernelspecs_settings_reuses_its_cluster():
    with spmd_kernel() as (km, kc):
        kernel_pid = km.provisioner.process.pid
        # the kernel's own cluster, started in the background before any cell
        deadline = time.monotonic() + 60
        while len(kernels_own := rank_engines(spmd_processes(kernel_pid))) < 2:
            assert time.monotonic() < deadline, "the kernel started no ranks"
            time.sleep(0.1)
        reply, text = kernel_stream(kc, "%spmd start -n 2")
        assert reply["content"]["status"] == "ok", text
        assert text.splitlines()[-1].startswith("Started 2 processes, 1 device per process")
        first = {p.pid for p in rank_engines(spmd_processes(kernel_pid))}
        assert first == {p.pid for p in kernels_own}  # taken, not started again
        reply, text = kernel_stream(kc, "%spmd start -n 2")  # now it has been used: refused
        assert reply["content"]["status"] == "error"
        assert "already running" in text
        assert {p.pid for p in rank_engines(spmd_processes(kernel_pid))} == first


def test_exit_asks_the_front_end_to_shut_the_kernel_down_and_spares_the_ranks():
    with spmd_kernel() as (km, kc):
        reply, said = kernel_stream(kc, "import jax")
        assert reply["content"]["status"] == "ok", said
        engines = rank_engines(spmd_processes(km.provisioner.process.pid))
        assert len(engines) == 2
        for word in ("exit", "quit()"):
            reply, text = kernel_stream(kc, word)
            assert reply["content"]["status"] == "ok", text
            # (what every IPython kernel does: the front end asks, then shuts the kernel down)
            assert [p["source"] for p in reply["content"]["payload"]] == ["ask_exit"]
        reply, text = kernel_stream(kc, "print(jax.process_count())")
        assert text == "[ranks 0-1] 2\n"  # the ranks did not run it
        assert all(p.is_running() for p in engines)
    assert not wait_until_gone(engines)  # the shutdown stopped them


def test_interrupt_reaches_every_rank_and_restart_recovers(tmp_path):
    with spmd_kernel() as (km, kc):
        reply, said = kernel_stream(kc, "import jax, time")
        assert reply["content"]["status"] == "ok", said
        # (each rank says it runs the cell with a file, the line before its sleep)
        msg_id = kc.execute(f"open({str(tmp_path)!r} + '/began-' + str(jax.process_index()), "
                            "'w').close()\ntime.sleep(120)")
        # wait until the cell is running on the ranks
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("began-*"))) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # (into the sleep)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        text = "\n".join(reply["content"]["traceback"])
        assert "Interrupted: ranks 0-1 are running" in text
        assert "at cell line 2: time.sleep(120)" in text
        # (ipykernel answers "aborted" to a request that comes while it still aborts the ones
        # queued behind the failed cell: on a busy machine that lasts a while; again then)
        for _ in range(50):
            reply, text = kernel_stream(kc, "print('refused?')")
            if reply["content"]["status"] != "aborted":
                break
            time.sleep(0.1)
        assert reply["content"]["status"] == "error" and "%spmd restart" in text
        reply, text = kernel_stream(kc, "%spmd restart")
        assert reply["content"]["status"] == "ok" and text.splitlines()[-1].startswith("Started 2 processes")
        reply, text = kernel_stream(kc, "import jax; print(jax.process_count())")
        assert text == "[ranks 0-1] 2\n"


def test_restart_and_shutdown_of_the_kernel_leave_no_process():
    km = KernelManager(kernel_name=SPMD_KERNEL)
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        first_pid = km.provisioner.process.pid
        reply, _ = kernel_stream(kc, "x = 1")  # the cluster is up
        assert reply["content"]["status"] == "ok"
        first = spmd_processes(first_pid)
        assert len(rank_engines(first)) == 2
        km.restart_kernel(now=False)  # Kernel > Restart
        assert not wait_until_gone(first)
        kc.wait_for_ready(timeout=60)
        second_pid = km.provisioner.process.pid
        reply, said = kernel_stream(kc, "x = 2")
        assert reply["content"]["status"] == "ok", said
        second = spmd_processes(second_pid)
        assert second
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)  # Kernel > Shut Down
    assert not wait_until_gone(second)


def test_a_killed_spmd_kernel_restarted_by_jupyter_attaches_to_its_lingering_ranks(tmp_path):
    """Jupyter's restarter kills a kernel that died and starts it again with the same
    notebook: the new kernel attaches to the cluster the old one left (the same processes,
    with what they hold), its first cell says so, and a shutdown then ends everything."""
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JPY_SESSION_NAME=str(tmp_path / "restarted.ipynb"))
    km, kc = start_new_kernel(kernel_name=SPMD_KERNEL, env=env)
    started = []
    try:
        reply, said = kernel_stream(kc, "import jax\nx = 10 + jax.process_index()")
        assert reply["content"]["status"] == "ok", said
        started = spmd_processes(km.provisioner.process.pid)
        assert len(rank_engines(started)) == 2
        km.restart_kernel(now=True)  # (SIGKILL, then the same command: the restarter's way)
        kc.wait_for_ready(timeout=60)
        reply, text = kernel_stream(kc, "print(x)")
        assert reply["content"]["status"] == "ok", text
        assert text.startswith("Attached to cluster"), text
        assert text.endswith("[rank 0] 10\n[rank 1] 11\n"), text
        assert all(p.is_running() for p in started)  # (the same processes)
    except BaseException:  # (a failure half-way leaves nothing lingering)
        subprocess.run([sys.executable, "-m", "spmd", "stop", "--all"], capture_output=True,
                       env=env, timeout=60)
        raise
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert not wait_until_gone(started)


# -- the kernelspec command line ---------------------------------------------------------


def spmd_kernel_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd.kernel", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_install_list_and_remove_a_kernelspec(tmp_path):
    env = dict(
        os.environ, JUPYTER_DATA_DIR=str(tmp_path / "user"), JUPYTER_PATH=str(tmp_path / "user")
    )
    done = spmd_kernel_cli("install", "--user", "--name", "spmd-8", "-n", "8", "-d", "2", env=env)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "user/kernels/spmd-8/kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (SPMD, 8 processes)"
    assert spec["argv"][:3] == [sys.executable, "-m", "spmd.kernel.app"]
    assert {"--SpmdKernel.processes=8", "--SpmdKernel.devices_per_process=2"} <= set(spec["argv"])
    assert spec["interrupt_mode"] == "signal"
    listed = spmd_kernel_cli("list", env=env).stdout
    assert "spmd-8  Python 3 (SPMD, 8 processes)" in listed
    done = spmd_kernel_cli(
        "install", "--prefix", str(tmp_path / "env"), "--display-name", "Teaching", env=env
    )
    assert done.returncode == 0
    assert (tmp_path / "env/share/jupyter/kernels/spmd/kernel.json").exists()
    assert spmd_kernel_cli("remove", "spmd-8", env=env).returncode == 0
    assert "spmd-8" not in spmd_kernel_cli("list", env=env).stdout


def test_a_cluster_kernelspec_says_where_its_ranks_run(tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path), JUPYTER_PATH=str(tmp_path))
    done = spmd_kernel_cli(
        "install", "--user", "--name", "slurm-8", "-n", "8", "--launcher", "slurm",
        "--launcher-arg", "partition=gpu", "--launcher-arg", "time=10", "--start-timeout", "600",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "kernels/slurm-8/kernel.json").read_text())
    cluster = "--launcher slurm --launcher-arg partition=gpu --launcher-arg time=10 --start-timeout 600"
    assert f"--SpmdKernel.cluster={cluster}" in spec["argv"]
    assert spec["display_name"] == "Python 3 (SPMD, 8 ranks on Slurm)"
    listed = spmd_kernel_cli("list", env=env).stdout.splitlines()
    assert listed[0].startswith("slurm-8  Python 3 (SPMD, 8 ranks on Slurm)"), listed
    assert listed[1].strip() == cluster, listed
    # the kernel reads its cluster back as %spmd start would (the early start adopts it)
    from spmd.kernel.app import settings_from_argv

    settings = settings_from_argv(spec["argv"])
    assert settings.n == 8 and settings.where.launcher == "slurm" and settings.start_timeout == 600
    assert dict(settings.where.launcher_args) == {"partition": "gpu", "time": "10"}


def test_a_torch_kernelspec_keeps_torchs_collective_check(tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path), JUPYTER_PATH=str(tmp_path))
    done = spmd_kernel_cli("install", "--user", "--name", "t2", "-n", "2", "--backend", "torch",
                           "--check-collectives", env=env)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "kernels/t2/kernel.json").read_text())
    assert spec["display_name"] == "Python 3 (SPMD, 2 processes)"
    from spmd.kernel.app import settings_from_argv

    settings = settings_from_argv(spec["argv"])
    assert settings.check_collectives and settings.backend == "torch", settings


@pytest.mark.parametrize(
    "args, says",
    [
        (["install", "-n", "0"], "-n must be a whole number of at least 1, like -n 4, not '0'"),
        (["install", "--backend", "tensorflow"], "--backend takes jax, torch, jax,torch or none, not 'tensorflow'"),
        (["install", "--user", "--sys-prefix"], "not allowed with argument"),
        (["install", "--name", "has space"], "--name takes letters"),
        (["remove", "python3"], "there is no SPMD kernelspec named 'python3'"),
        (["install", "--prefix", "/dev/null/nowhere"], "cannot write /dev/null"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        # the cluster's options, refused as %spmd start refuses them, in its words
        (["install", "--launcher", "ssh"], "--launcher ssh needs --hosts, like --hosts node1,node2"),
        (["install", "-n", "2", "--hosts", "a:1,b:2"], "the counts in --hosts a:1,b:2 add up to 3"),
        (["install", "--launcher-arg", "partition=gpu"], "--launcher-arg is for ranks on other hosts"),
        (["install", "--launcher", "slurm", "--launcher-arg", "nonsense"], "--launcher-arg takes KEY=VALUE"),
        (["install", "--check-collectives"], "--check-collectives turns on torch's own check"),
        # this machine's GPUs, checked as the start checks them (here it shows none)
        (["install", "--gpus-per-process", "3"], "--gpus-per-process 3 was given, but this machine has no GPUs"),
    ],
)
def test_bad_kernelspec_arguments_are_one_sentence_and_exit_2(args, says, tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path), JUPYTER_PATH=str(tmp_path),
               CUDA_VISIBLE_DEVICES="")
    done = spmd_kernel_cli(*args, env=env)
    assert done.returncode == 2
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(("cluster", "why"), [
    ("--launcher ssh", "--launcher ssh needs --hosts, like --hosts node1,node2"),
    # (before, the kernel died at its start: the split ran outside the refusal's try)
    ("--hosts 'a", "No closing quotation in --hosts 'a: close the quote in the kernel's "
                   "cluster setting (kernel.json or the config file)"),
])
def test_a_kernel_whose_cluster_options_cannot_be_used_says_why_and_starts_another(
        cluster, why, tmp_path):
    # (written by hand: an install refuses these options; a config file could give them)
    from spmd.kernel.kernelspec import write_kernel_spec

    spec = write_kernel_spec(tmp_path / "spmd-refused", processes=2)
    kernel_json = json.loads((spec / "kernel.json").read_text())
    kernel_json["argv"].append(f"--SpmdKernel.cluster={cluster}")
    (spec / "kernel.json").write_text(json.dumps(kernel_json))
    KernelSpecManager().install_kernel_spec(str(spec), "spmd-refused", user=True)
    with spmd_kernel("spmd-refused") as (km, kc):
        kernel_pid = km.provisioner.process.pid
        reply, text = kernel_stream(kc, "print('hello')")
        assert reply["content"]["status"] == "error"
        assert (
            f"The kernel's cluster options cannot be used ({why}): %spmd start with other "
            "options starts a cluster here."
        ) in text, text
        assert not spmd_processes(kernel_pid)  # (nothing was started)
        reply, text = kernel_stream(kc, "%spmd start -n 2 --backend none")
        assert reply["content"]["status"] == "ok", text
        reply, text = kernel_stream(kc, "print('hello')")
        assert text == "[ranks 0-1] hello\n"
    KernelSpecManager().remove_kernel_spec("spmd-refused")


def test_a_kernel_whose_cluster_cannot_start_says_why_in_the_first_cell(tmp_path):
    # a kernelspec whose ranks cannot import jax (a broken jax earlier on the path)
    from spmd.kernel.kernelspec import write_kernel_spec

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "jax.py").write_text("raise ImportError('this jax is broken')\n")
    spec = write_kernel_spec(tmp_path / "spmd-broken", processes=2)
    kernel_json = json.loads((spec / "kernel.json").read_text())
    kernel_json["env"] = {"PYTHONPATH": str(broken)}
    (spec / "kernel.json").write_text(json.dumps(kernel_json))
    KernelSpecManager().install_kernel_spec(str(spec), "spmd-broken", user=True)
    with spmd_kernel("spmd-broken") as (km, kc):
        kernel_pid = km.provisioner.process.pid
        reply, text = kernel_stream(kc, "print('hello')")
        assert reply["content"]["status"] == "error"  # a UsageError: shown as one stderr line
        assert "The kernel's processes did not start.\n" in text
        assert "jax cannot be imported in the engines' Python" in text
        assert "this jax is broken" in text
        assert "install it there, or start with --backend none" in text
        assert not wait_until_gone(spmd_processes(kernel_pid))  # nothing left of that start
        # with no cluster, completion answers from the notebook at once, never hangs
        kernel_stream(kc, "%%local\nnotebook_name = 1")
        t0 = time.monotonic()
        reply = kc.complete("notebook_na", reply=True, timeout=30)
        assert reply["content"]["matches"] == ["notebook_name"]
        assert time.monotonic() - t0 < 5
        reply, text = kernel_stream(kc, "%spmd start -n 2 --backend none")
        assert reply["content"]["status"] == "ok" and text.splitlines()[-1].startswith("Started 2 processes")
        reply, text = kernel_stream(kc, "print('hello')")
        assert text == "[ranks 0-1] hello\n"


def test_a_torch_kernelspec_starts_torch_ranks_that_all_reduce():
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    done = spmd_kernel_cli(
        "install", "--user", "--name", "spmd-torch", "-n", "2", "--backend", "torch",
        "--torch-backend", "gloo",
    )
    assert done.returncode == 0, done.stderr
    spec = KernelSpecManager().get_kernel_spec("spmd-torch")
    assert "--SpmdKernel.backend=torch" in spec.argv
    assert "--SpmdKernel.torch_backend=gloo" in spec.argv
    try:
        with spmd_kernel("spmd-torch") as (km, kc):
            kernel_pid = km.provisioner.process.pid
            reply, text = kernel_stream(
                kc,
                "import torch, torch.distributed as dist\n"
                "t = torch.tensor([dist.get_rank() + 1.0])\n"
                "dist.all_reduce(t)\n"
                "print(dist.get_backend(), t.item())",
            )
            assert reply["content"]["status"] == "ok", text
            assert text.endswith("[ranks 0-1] gloo 3.0\n"), text
        assert not wait_until_gone(spmd_processes(kernel_pid))
    finally:
        spmd_kernel_cli("remove", "spmd-torch")
