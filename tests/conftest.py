"""Fixtures: a real IPython shell with the extension loaded, real engines, real jax.

Every test that starts a cluster ends it; ``no_leftover_processes`` checks after each test
module that no process this test run started (kernel, controller, engine) is still alive.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from spmd.wire import RANKS_DATA_MIME

# A ^C reaches what the tests start, as it would from a terminal: a test run launched in the
# background of a shell, and each of pytest-xdist's workers, begins with SIGINT ignored, which
# every process it starts inherits (and bash cannot trap a signal ignored at its start: an
# exported job's ^C would not end it). Python's own handler is not inherited past exec.
signal.signal(signal.SIGINT, signal.default_int_handler)


# The files that take longest, longest first (seconds in one run: 225 to 18). make test hands
# whole files to its two workers in collection order (--dist loadfile --no-loadscope-reorder):
# started first, the long ones no longer leave one worker alone at the end with a 50 s file
# while the other has finished.
LONGEST_FILES = (
    "test_clusters.py", "test_linger.py", "test_notebooks.py", "test_faults.py",
    "test_kernel.py", "test_rank_server.py", "test_export_launch.py", "test_visual_debugger.py",
    "test_life.py", "test_browser_debugger.py", "test_debugging.py", "test_export.py",
    "test_arrays.py", "test_browser.py", "test_printed.py", "test_torch.py",
    "test_torch_starts.py", "test_outputs.py", "test_export_torch.py", "test_browser_sidebar.py",
)


def pytest_collection_modifyitems(items) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest as is)


@dataclass
class CellResult:
    stdout: str
    stderr: str
    outputs: list = field(default_factory=list)  # rich display bundles (dicts)
    error: BaseException | None = None

    @property
    def texts(self) -> list[str]:
        return [o.get("text/plain", "") for o in self.outputs]


def run(shell: InteractiveShell, code: str) -> CellResult:
    """Run one notebook cell in ``shell`` and return what it showed.

    The cell's result (what a front end shows as ``Out[n]``, an execute_result) comes last in
    ``outputs``, as its MIME bundle; the terminal shell's displayhook does not print it.
    """
    with capture_output() as cap:
        result = shell.run_cell(code, store_history=True)
        # (what a person sees: a cell's per-rank data shows nothing; tests/test_ranks_data.py)
        shown = [o.data for o in cap.outputs if RANKS_DATA_MIME not in o.data]
        if result.result is not None:
            shown.append(shell.display_formatter.format(result.result)[0])
    error = result.error_before_exec or result.error_in_exec
    # clear_output: the terminal gets an escape sequence, a notebook drops what came before
    # (the captured displays are dropped already); keep what a notebook would show
    stdout, stderr = (text.rsplit(CLEAR, 1)[-1] for text in (cap.stdout, cap.stderr))
    # a line rewritten in place (the start's progress): what a terminal shows of it
    stdout = "\n".join(line.rsplit("\r", 1)[-1] for line in stdout.split("\n"))
    return CellResult(stdout, stderr, shown, error)


@contextlib.contextmanager
def displays():
    """Every display and display update that cells publish in this block, in order: what a
    front end receives (``run``'s outputs lose what a clear_output cleared)."""
    from IPython.core.displaypub import CapturingDisplayPublisher

    seen: list[dict] = []
    original = CapturingDisplayPublisher.publish

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
        if RANKS_DATA_MIME not in data:  # (a cell's per-rank data: for programs)
            seen.append(data)
        return original(
            self, data, metadata=metadata, source=source, transient=transient, update=update
        )

    CapturingDisplayPublisher.publish = publish
    try:
        yield seen
    finally:
        CapturingDisplayPublisher.publish = original


def session(shell: InteractiveShell):
    """The shell's SPMD session (None before the first start)."""
    return shell.magics_manager.registry["SpmdMagics"].session


def report(result: CellResult) -> str:
    """The text a notebook shows for a cell that failed on the ranks."""
    from spmd.magics.cells.render import RankErrors

    assert isinstance(result.error, RankErrors), result.error
    return "\n".join(result.error._render_traceback_())


def restart_and_run(shell: InteractiveShell, setup: str, cell: str) -> str:
    """One %spmd restart, ``setup`` again, then ``cell``: what it printed (nothing fails)."""
    restarted = run(shell, "%spmd restart")
    assert restarted.error is None, restarted.stderr
    assert run(shell, setup).error is None
    out = run(shell, cell)
    assert out.error is None, report(out)
    return out.stdout


CLEAR = "\x1b[2K\r"  # what IPython's clear_output writes to a terminal


# Each pytest-xdist worker has a temporary folder and a Jupyter runtime folder of its own:
# what a test leaves there for its next step (a dead notebook's folders, which the next
# start removes; a lingering cluster's record, which `%spmd attach` and `spmd stop --all`
# read) is never another worker's to remove, attach to or stop. Made here, before anything
# asks tempfile for its folder (it keeps the first answer).
if os.environ.get("PYTEST_XDIST_WORKER"):
    WORKER_TMP = tempfile.mkdtemp(prefix=f"tests-{os.environ['PYTEST_XDIST_WORKER']}-",
                                  dir=os.environ.get("SPMD_TESTS_TMP") or None)
    os.environ["TMPDIR"] = WORKER_TMP
    tempfile.tempdir = None
    atexit.register(shutil.rmtree, WORKER_TMP, True)
else:
    # (the workers' own folders go where this one would have; they nest nothing)
    os.environ.setdefault("SPMD_TESTS_TMP", tempfile.gettempdir())
os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tests-runtime-")
atexit.register(shutil.rmtree, os.environ["JUPYTER_RUNTIME_DIR"], True)

# The SPMD kernelspec, installed where Jupyter looks for this test run only, never in the
# user's own folders: every test that starts a kernel named "spmd" (directly or through a
# notebook's metadata) gets this one, with 2 ranks.
JUPYTER_DIR = tempfile.mkdtemp(prefix="spmd-test-jupyter-")
atexit.register(shutil.rmtree, JUPYTER_DIR, True)  # (xdist's main process makes one too)
os.environ["JUPYTER_DATA_DIR"] = JUPYTER_DIR
os.environ["JUPYTER_PATH"] = JUPYTER_DIR
SPMD_KERNEL = "spmd"


@contextlib.contextmanager
def spmd_kernel(name: str = SPMD_KERNEL, env: dict | None = None):
    """A kernel of the kernelspec ``name`` and its client, shut down as Jupyter does."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name=name, **({"env": env} if env else {}))
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def kernel_stream(
    kc, code: str, timeout: float = 120, stdin=None
) -> tuple[dict, str]:
    """Run ``code``; its reply and everything it printed or showed as text, as a front end
    shows it at the end (an update replaces its display; clear_output clears). ``stdin``:
    called with each input_request's content (its prompt), as a front end with stdin."""
    shown: list[str] = []
    displays: dict[str, int] = {}  # display id: where it is in ``shown``
    clear_next = False

    def keep(msg):
        nonlocal clear_next
        content, kind = msg["content"], msg["msg_type"]
        if kind == "clear_output":
            if content.get("wait"):
                clear_next = True
            else:
                shown.clear()
                displays.clear()
            return
        if kind not in ("stream", "display_data", "update_display_data", "execute_result"):
            return
        if clear_next and kind != "update_display_data":
            shown.clear()
            displays.clear()
            clear_next = False
        display_id = content.get("transient", {}).get("display_id")
        if kind == "stream":
            shown.append(content["text"])
        else:
            # (an empty text shows nothing: a cell's per-rank data, an emptied live view)
            text = content["data"].get("text/plain", "")
            text = text + "\n" if text else ""
            if kind == "update_display_data" and display_id in displays:
                shown[displays[display_id]] = text
            else:
                if display_id:
                    displays[display_id] = len(shown)
                shown.append(text)

    reply = kc.execute_interactive(
        code,
        timeout=timeout,
        output_hook=keep,
        allow_stdin=stdin is not None,
        stdin_hook=(lambda msg: stdin(msg["content"])) if stdin is not None else None,
    )
    return reply, "".join(shown)


@pytest.fixture(scope="session", autouse=True)
def spmd_kernelspec():
    from spmd.kernel.kernelspec import install

    install(SPMD_KERNEL, user=True, processes=2)
    yield SPMD_KERNEL
    shutil.rmtree(JUPYTER_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def shell():
    ip = InteractiveShell.instance()
    # A notebook shows a cell's result as an output, not as 'Out[n]:' text: run() collects it.
    ip.displayhook.write_output_prompt = lambda: None
    ip.displayhook.write_format_data = lambda *args, **kwargs: None
    ip.run_line_magic("load_ext", "spmd")
    yield ip
    ip.run_line_magic("unload_ext", "spmd")


def ready_cluster(shell: InteractiveShell, start: str, setup: str = "",
                  once: bool = False) -> InteractiveShell:
    """``shell`` with a running, in-step cluster from ``%spmd {start}``, auto mode on, and
    ``setup`` run on it. Whatever an earlier test left (a stopped cluster, ranks out of step or
    still busy, another size, auto mode off) is repaired first, so that every test passes alone
    and in any order, and one failure does not spread to the tests after it. ``once``: the
    setup is not run again on the same rank processes (for a module whose tests only read
    what it defines; a restart gives new processes, and it runs again)."""
    magics = shell.magics_manager.registry["SpmdMagics"]
    s = magics.session
    healthy = (
        s is not None
        and s.running
        and not s.out_of_step
        and getattr(s, "started_by", None) == start
        and not s.busy_ranks()
    )
    if not healthy and s is not None and s.running and getattr(s, "started_by", None) == start:
        # (the right cluster, out of step or still busy: a restart, well under a second with
        # the rank server, makes it as new as a start does)
        restarted = run(shell, "%spmd restart").error is None
        s = magics.session
        healthy = restarted and s is not None and s.running and not (
            s.out_of_step or s.busy_ranks())
        if healthy:  # (the same start line, whether the ranks were forked again or started)
            s.started_by = start
    if not healthy:
        if s is not None:  # (stop is idempotent; a died cluster may keep its controller and rank server)
            s.stop()
        # (within the test's timeout: a rank that hangs in its join then says where it is)
        timeout = "" if "--start-timeout" in start else " --start-timeout 60"
        out = run(shell, f"%spmd {start}{timeout}")
        assert out.error is None, out.stdout + out.stderr
        magics.session.started_by = start
    magics.auto.on = True
    seeded = (setup, tuple(r.pid for r in magics.session.ranks))
    if setup and not (once and getattr(magics.session, "seeded", None) == seeded):
        magics.session.seeded = None
        out = run(shell, setup)
        assert out.error is None, out.stdout + out.stderr
        magics.session.seeded = seeded
    return shell


@pytest.fixture
def fresh(shell):
    """The shell with no cluster; whatever a test starts is stopped after it."""
    magics = shell.magics_manager.registry["SpmdMagics"]
    if magics.session is not None:
        magics.session.stop()
    yield shell
    if magics.session is not None:
        magics.session.stop()
    magics.auto.on = False


@pytest.fixture(scope="module")
def module_shell(shell):
    """The shared shell; the module's cluster is stopped when the module ends."""
    yield shell
    session = shell.magics_manager.registry["SpmdMagics"].session
    if session is not None:
        session.stop()


# Every process this test run starts (kernels, controllers, engines, what cells start in a
# rank) inherits this marker, so a leftover is found wherever it was reparented: a process
# whose notebook died belongs to PID 1, not to pytest.
RUN_MARKER = "SPMD_TEST_RUN"
os.environ[RUN_MARKER] = f"{os.getpid()}-{time.time_ns()}"


def spmd_processes(parent_pid: int | None = None) -> list[psutil.Process]:
    """Live processes started by this test run (by the notebook process ``parent_pid`` only,
    when given), found by their environment wherever they were reparented."""
    marker, me = os.environ[RUN_MARKER], os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if env.get(RUN_MARKER) != marker or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if parent_pid is not None and env.get("SPMD_PARENT_PID") != str(parent_pid):
                continue
        except psutil.Error:
            continue
        found.append(proc)
    return found


def started_since(before: set[int]) -> list[psutil.Process]:
    """This test run's live processes that were not among the pids ``before`` (taken with
    ``{p.pid for p in spmd_processes()}``): what one test started, whatever carries
    SPMD_PARENT_PID (mpiexec's ranks do not), leaving out a module's own daemons."""
    return [p for p in spmd_processes() if p.pid not in before]


def wait_until_gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """The processes of ``procs`` still running after up to ``timeout`` seconds (a zombie
    has ended: psutil.wait_procs waits on for one that nothing here reaps)."""
    def running(proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def described(proc: psutil.Process) -> str:
    """A leftover process in one line: what it runs, who started it, in which network
    namespace (a test's host, or this machine's), so that a failure names its source."""
    try:
        with proc.oneshot():
            env = proc.environ()
            chain = []
            parent = proc.parent()
            while parent is not None and len(chain) < 4:
                chain.append(f"{parent.pid}:{parent.name()}")
                parent = parent.parent()
            netns = os.readlink(f"/proc/{proc.pid}/ns/net")
            ours = os.readlink("/proc/self/ns/net")
            keys = ("SPMD_PARENT_PID", "SPMD_RANK", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMI_RANK")
            said = {k: env[k] for k in keys if k in env}
            return (f"{proc.pid} {' '.join(proc.cmdline())[:200]!r} parents={chain} "
                    f"netns={'ours' if netns == ours else netns} env={said}")
    except (psutil.Error, OSError) as exc:
        return f"{proc.pid} ({type(exc).__name__})"


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    yield
    left = wait_until_gone(spmd_processes(), timeout=5)
    said = [described(p) for p in left]
    for proc in left:  # (one module's leftover fails that module only, not every later one)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not left, "processes left running after the module:\n" + "\n".join(said)


def client_connection(session) -> dict:
    """The cluster's client connection file (its key, its ports)."""
    import json

    security = os.path.join(session.record().cluster.profile_dir, "security")
    name = next(n for n in os.listdir(security) if n.endswith("-client.json"))
    with open(os.path.join(security, name)) as f:
        return json.load(f)


@contextlib.contextmanager
def controller_socket(info: dict, port: int, curve: bool):
    """A DEALER connected to one of the controller's client ports (``curve``: with a key of
    its own and the server's, as a client of an encrypting controller)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    # (a DEALER whose only peer dropped it, as a failed CurveZMQ handshake does, blocks in
    # send for ever: seen once in a CI run; a send not taken in 3 s is no answer)
    sock.sndtimeo = 3000
    if curve:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = info["curve_serverkey"].encode()
    try:
        sock.connect(f"{info['interface']}:{port}")
        yield sock
    finally:
        sock.close()


def fanout_answers(info: dict, engine_ident: str, code: str, curve: bool = False,
                   key: str | None = None, wait: float = 30.0) -> bool:
    """Whether the controller's cell fan-out runs ``code`` on one engine for a request signed
    with ``key`` (the cluster's own by default) and sends back its gathered reply within
    ``wait`` seconds."""
    import zmq
    from jupyter_client.session import Session as Signer

    from spmd.wire import CELL_REPLIES, CELL_REQUEST, CELLS_PORT

    signer = Signer(key=(key or info["key"]).encode(), signature_scheme=info["signature_scheme"])
    request = {"request": {"code": code, "silent": False, "user_expressions": {}},
               "metadata": {}, "targets": [[engine_ident, f"probe-{time.time()}"]]}
    with controller_socket(info, info[CELLS_PORT], curve) as sock:
        try:
            signer.send(sock, CELL_REQUEST, content=request)
        except zmq.Again:
            return False
        if not sock.poll(int(wait * 1000)):
            return False
        _idents, msg = signer.recv(sock)
        return msg["header"]["msg_type"] == CELL_REPLIES and len(msg["content"]["replies"]) == 1
