"""Real notebooks, executed headlessly by nbclient in a real kernel."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import spmd_processes, wait_until_gone
from jupyter_client.manager import start_new_kernel
from nbclient.exceptions import CellExecutionError

from spmd.demo import cell_text, execute
from spmd.wire import RANKS_DATA_MIME

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
from spmd_docs.executed import executed_copy  # noqa: E402


def ran(name: str):
    """notebooks/<name>.ipynb with its outputs: as the site's build ran it (`make docs`, the
    first half of CI: each notebook runs once per CI run), or run here where no build of
    this checkout's sources did (spmd_docs/executed.py)."""
    return executed_copy(name) or execute(NOTEBOOKS / f"{name}.ipynb")


def new_notebook(tmp_path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "test.ipynb"
    nbformat.write(nb, str(path))
    return path


def seen(outputs) -> list:
    """The outputs a person sees: not a cell's per-rank data (tests/test_ranks_data.py)."""
    return [o for o in outputs if RANKS_DATA_MIME not in o.get("data", {})]


def started(text: str) -> str:
    """A start cell's summary line, after the start's timeline (what its progress became)."""
    timeline, summary = text.rstrip("\n").split("\n")
    assert re.match(r"\d+ engines registered in \d+\.\d s; \d+ ranks joined in \d+\.\d s", timeline)
    return summary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_prints_what_the_guide_prints():
    nb = ran("quickstart")
    assert_saved_without_empty_outputs(nb)
    shown = {c.source: cell_text(c) for c in nb.cells if c.cell_type == "code"}
    start = started(shown["%spmd start -n 4 --devices-per-process 2"])
    assert start.startswith(
        "Started 4 processes, 2 devices per process, 8 global devices (jax) in "
    )
    assert shown["import jax\nprint(jax.device_count(), jax.local_device_count())"] == (
        "[ranks 0-3] 8 2\n"
    )
    assert shown["print(jax.process_index())"] == (
        "[rank 0] 0\n[rank 1] 1\n[rank 2] 2\n[rank 3] 3\n"
    )
    psum = next(v for k, v in shown.items() if "psum" in k)
    assert psum == "Array([8., 8.], dtype=float32)\n"  # (the value, as one process shows it)
    assert shown["%spmd stop"].startswith("Stopped 4 processes in ")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_three_pitfalls_end_in_divergence_reports_and_their_fixes_run(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # a fixed seed would fix pitfall 3
    nb = ran("pitfalls")
    assert_saved_without_empty_outputs(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    shown = [cell_text(c) for c in code]
    failing = [i for i, c in enumerate(code) if "raises-exception" in c.metadata.get("tags", [])]
    shapes, last_batch, order = (shown[i] for i in failing)
    assert shapes.startswith("[rank 0] (2, 4) [8. 8. 8.]\n")  # a wrong answer on rank 0
    assert (
        "The ranks diverged: ranks 1-3 are waiting in a collective that rank 0 never reached"
        in shapes
    )
    assert (
        "The ranks diverged: ranks 0-1 are waiting in a collective that ranks 2-3 never "
        "reached: ranks 2-3 finished the cell without it" in last_batch
    )
    assert "[ranks 2-3] steps 2 total 8.0\n" in last_batch
    # the census says why: the shapes each rank gave, the launches each made
    assert ("The ranks' 1st cross-process program, pmap(<lambda>), had different shapes: rank "
            "0 float64[2,4]; rank 1 float64[2,5]; rank 2 float64[2,6]; rank 3 float64[2,7]."
            in shapes), shapes
    assert "Hint: Pad every process's input to a size agreed by every process" in shapes
    assert ("The ranks launched different numbers of cross-process programs: ranks 0-1 "
            "launched 3, ranks 2-3 launched 2. Ranks 2-3 had no 3rd; ranks 0-1 are at their "
            "3rd, pmap(<lambda>) float32[2]." in last_batch), last_batch
    assert "The ranks launched different numbers of cross-process programs: " in order
    assert "iterate in an order every process agrees on (sorted" in order
    positions = re.findall(r"(\d+) stages before save", order)
    # each process salts string hashes its own way: with 32 stages, four processes agree on
    # where 'save' is about once in 30,000 runs
    assert len(set(positions)) > 1, order
    assert "The ranks diverged: " in order and "%spmd restart" in order
    for i in failing:
        # the restart after each (afresh: the notebook starts its ranks without the rank
        # server, so each has its own string-hash salt, as a job's processes do)
        assert "\nStarted 4 processes" in "\n" + shown[i + 1], shown[i + 1]
    fixes = [shown[i + 2] for i in failing]
    assert fixes == [
        "[ranks 0-3] (2, 8) [8. 8. 8.]\n",
        "[ranks 0-3] steps 2 total 8.0\n",
        "[ranks 0-3] [32768. 32768.]\n",
    ]
    assert shown[-1].startswith("Stopped 4 processes")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_parallel_programming_guide_gives_one_picture_per_array_and_the_guides_numbers():
    nb = ran("02-parallel-programming")
    assert_saved_without_empty_outputs(nb)
    cells = [c for c in nb.cells if c.cell_type == "code"]  # sources repeat: keep them all
    code = {c.source: c for c in cells}
    shown = {src: cell_text(c) for src, c in code.items()}
    pictures = [
        o
        for c in cells
        if c.source.startswith("%spmd sharding")
        for o in c.outputs
        if o.output_type == "display_data"
    ]
    assert len(pictures) == 4 and all({"image/png", "text/plain"} <= set(o.data) for o in pictures)
    gathered = [cell_text(c) for c in cells if c.source.startswith("%spmd gather")]
    assert gathered[0].startswith("array([[ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.],")
    assert (
        gathered[1]
        == gathered[2]
        == ("array([48., 52., 56., 60., 64., 68., 72., 76.], dtype=float32)\n")
    )
    assert gathered[-2] == "array([  6,  22,  38,  54,  70,  86, 102, 118], dtype=int32)\n"
    assert gathered[-1] == "array(496, dtype=int32)\n"
    # jax's own picture: once, for all four ranks
    builtin = code["jax.debug.visualize_array_sharding(arr_sharded)"].outputs
    assert cell_text(code["jax.debug.visualize_array_sharding(arr_sharded)"]).startswith(
        "[ranks 0-3]\n"
    )
    assert sum(o.output_type == "display_data" for o in seen(builtin)) == 1
    traced = next(v for k, v in shown.items() if k.startswith("x = jnp.arange(32)"))
    assert traced == (
        "[ranks 0-3]\nglobal shape: x.shape=(32,)\ndevice local shape: x.shape=(4,)\n"
    )
    # the deprecation warning names each rank's cell file; it is still shown once
    imports = next(v for k, v in shown.items() if k.startswith("from jax.experimental"))
    assert imports.count("[ranks 0-3]") == 1 and "[rank 1]" not in imports
    # the guide's three ways of writing one layer agree, on every process, with the guide
    layers = [
        v
        for k, v in shown.items()
        if k.endswith(
            (
                "print(layer(x, weights, bias))",
                "print(layer(x_sharded, weights_sharded, bias))",
                "# pass in unsharded inputs",
                "print(layer_sharded(x, weights, bias))",
            )
        )
    ]
    assert len(layers) == 4 and len(set(layers)) == 1
    printed = [float(v) for v in layers[0].removeprefix("[ranks 0-3] [").split("]")[0].split()]
    assert printed == pytest.approx([0.02138912, 0.893112, 0.59892005, 0.97742504], abs=1e-6)
    assert shown[next(k for k in shown if k.startswith("guide = "))] == (
        "[ranks 0-3] all four match the guide to 6 decimal places\n"
    )


def assert_saved_without_empty_outputs(nb) -> None:
    """No output of the saved notebook shows nothing (a live view's leftover, say). Stream
    pieces in a row of one name are one output, as a front end shows them: a busy kernel may
    flush a print's text and its newline apart."""
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            if (out.output_type == "stream" and outputs and outputs[-1].output_type == "stream"
                    and outputs[-1].name == out.name):
                outputs[-1] = nbformat.from_dict({**outputs[-1], "text": outputs[-1].text + out.text})
                continue
            outputs.append(out)
        for out in outputs:
            shown = cell_text({"outputs": [out]})
            assert shown.strip() or set(out.get("data", {})) - {"text/plain"}, (
                f"an empty {out.output_type} in {cell.source!r}"
            )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_multi_process_guide_prints_its_32s_in_the_spmd_kernel():
    nb = ran("01-multi-process")
    assert nb.metadata.kernelspec.name == "spmd"
    assert_saved_without_empty_outputs(nb)
    shown = {c.source: cell_text(c) for c in nb.cells if c.cell_type == "code"}
    assert started(shown["%spmd start -n 4 --devices-per-process 8"]).startswith(
        "Started 4 processes, 8 devices per process, 32 global devices (jax) in "
    )
    assert shown["import jax\njax.distributed.is_initialized()"] == "True\n"
    assert shown["print(jax.device_count(), jax.local_device_count())"] == "[ranks 0-3] 32 8\n"
    local = shown["print(jax.process_index(), [d.id for d in jax.local_devices()])"]
    assert [line.split("] ", 1)[1].split()[0] for line in local.splitlines()] == list("0123")
    assert shown["print(set(jax.local_devices()) <= set(jax.devices()))"] == "[ranks 0-3] True\n"
    psum = next(v for k, v in shown.items() if "psum" in k)
    assert psum == "Array([32., 32., 32., 32., 32., 32., 32., 32.], dtype=float32)\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_initialize_reference_reads_back_each_ranks_arguments(spmd_kernelspec):
    # no %spmd start: the kernelspec's cluster runs every cell (4 ranks where the site's
    # build ran it, 2 where this test runs it, with the tests' own kernelspec)
    nb = ran("03-distributed-initialize")
    assert_saved_without_empty_outputs(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    args, jax_record, devices, twice, listening = (cell_text(c) for c in code)
    n = int(re.match(r"Started (\d+) processes", args).group(1))
    assert n >= 2, args
    common, *each = args.split("[rank ")
    assert common.startswith(
        f"Started {n} processes, 1 device per process, {n} global devices (jax)")
    address = re.search(r"coordinator_address = '(127\.0\.0\.1:\d+)'", common).group(1)
    assert f"coordinator_bind_address = '{address}'" in common
    assert f"num_processes = {n}\n" in common and "initialization_timeout = 120\n" in common
    assert each == [f"{r}] process_id = {r}\n" for r in range(n)]
    assert jax_record == f"[ranks 0-{n - 1}]\n{address} {n}\nTrue\n"
    assert "heartbeat_timeout_seconds = 100" in devices
    # (in a rank it ran at the start: said in a line per rank, and the cell goes on)
    assert twice == "".join(
        f"[rank {r}] jax.distributed is already initialized: %spmd start joined this "
        f"process, {r} of {n}: carrying on.\n" for r in range(n)), twice
    others = "[rank 1]" if n == 2 else f"[ranks 1-{n - 1}]"
    assert listening == (
        f"[rank 0]\ncoordinator service: ['{address}']\n"
        "every socket this process listens on is on the loopback: True\n"
        f"{others}\ncoordinator service: not in this process\n"
        "every socket this process listens on is on the loopback: True\n"
    )


# a different bar on each rank: two pictures, each under its rank
BAR_CHART = (
    "%matplotlib inline\nimport jax, matplotlib.pyplot as plt\n"
    "plt.bar([0], [jax.process_index() + 1]); plt.show()"
)


FAILING_CELL = "if jax.process_index() == 1:\n    raise RuntimeError('only rank 1 fails')\nprint('ok')"


@pytest.mark.timeout(300)
def test_a_failing_rank_stops_run_all_and_figures_come_back(tmp_path):
    path = new_notebook(
        tmp_path,
        "%load_ext spmd\n%spmd start -n 2",
        BAR_CHART,
        FAILING_CELL,
        "print('never runs')",
    )
    with pytest.raises(CellExecutionError) as failure:
        execute(path)
    # what the notebook shows (nbclient's message also repeats the cell's source)
    assert failure.value.ename == "RankErrors"
    assert failure.value.evalue == "[rank 1] RuntimeError: only rank 1 fails"
    # nbclient's text repeats the cell's source first: look only at what came after it
    text = failure.value.traceback
    shown = text[text.index(FAILING_CELL) + len(FAILING_CELL) :]
    assert "\nError on 1 of 2 ranks (1); rank 0 did not raise.\n" in shown
    assert "[rank 1] RuntimeError: only rank 1 fails" in shown
    # the kernel has shut down, and with it every process the cluster had
    assert not wait_until_gone(spmd_processes())


@pytest.mark.timeout(120)
def test_figures_are_saved_with_png_and_text(tmp_path):
    path = new_notebook(
        tmp_path,
        "%load_ext spmd\n%spmd start -n 2",
        BAR_CHART,
        "%spmd stop",
    )
    nb = execute(path)
    outputs = nb.cells[1].outputs
    pictures = [o for o in seen(outputs) if o.output_type == "display_data"]
    assert len(pictures) == 2
    assert all({"image/png", "text/plain"} <= set(o.data) for o in pictures)
    assert cell_text(nb.cells[1]).startswith("[rank 0]\n<Figure")


@pytest.mark.timeout(120)
def test_a_long_cell_streams_live_and_is_saved_grouped_with_nothing_empty(tmp_path):
    path = new_notebook(
        tmp_path,
        "%load_ext spmd\n%spmd start -n 2 --backend none",
        "import time\nprint('working', flush=True)\ntime.sleep(2.5)\nprint('done')",
        "%%spmd --ranks 0\ntime.sleep(1.5)\nprint('rank 0 only', flush=True)\ntime.sleep(1)",
    )
    nb = execute(path)
    assert_saved_without_empty_outputs(nb)
    long, subset = nb.cells[1], nb.cells[2]
    assert [o.output_type for o in seen(long.outputs)] == ["stream"]
    assert cell_text(long) == "[ranks 0-1]\nworking\ndone\n"
    # a line printed before the live view (the subset warning) is printed again after it
    assert cell_text(subset) == (
        "Running on ranks 0 only: a collective in this cell would hang, waiting for the other "
        "ranks.\n[rank 0] rank 0 only\n"
    )


@pytest.mark.timeout(120)
def test_a_killed_notebook_kernel_leaves_no_engine_behind():
    km, kc = start_new_kernel(kernel_name="python3")
    outputs: list = []
    try:
        reply = kc.execute_interactive(
            "%load_ext spmd\n%spmd start -n 2 --backend none --linger 0\n"
            "pids = [r.pid for r in get_ipython().magics_manager.registry['SpmdMagics'].session.ranks]\n"
            "print(pids)",
            timeout=60,
            output_hook=lambda msg: outputs.append(msg),
        )
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
    text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
    pids = [int(p) for p in text.strip().splitlines()[-1].strip("[]").split(",")]
    kernel_pid = km.provisioner.process.pid
    started = spmd_processes(kernel_pid)
    # the engines, the controller and its heartbeat process
    assert set(pids) < {p.pid for p in started}
    os.kill(kernel_pid, signal.SIGKILL)  # no atexit runs
    left = wait_until_gone(started)
    km.cleanup_resources()
    assert not left


@pytest.mark.timeout(120)
def test_kernel_interrupt_reaches_blocked_ranks_and_comes_back_within_seconds():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        reply = kc.execute_interactive("%load_ext spmd\n%spmd start -n 2", timeout=60)
        assert reply["content"]["status"] == "ok"
        # rank 1 sleeps, rank 0 waits for it in a psum; the watchdog is off, so only the
        # user's interrupt can end this cell
        msg_id = kc.execute(
            "%%spmd --grace off\nimport time, jax\nif jax.process_index() == 1:\n"
            "    time.sleep(120)\n"
            "print(jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')("
            "jax.numpy.ones(jax.local_device_count())))"
        )
        time.sleep(3)
        t0 = time.monotonic()
        km.interrupt_kernel()  # Kernel > Interrupt: SIGINT to the notebook's kernel
        reply = kc.get_shell_msg(timeout=30)
        back = time.monotonic() - t0
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        text = "\n".join(reply["content"]["traceback"])
        assert (
            "Interrupted: ranks 0-1 are running; rank 0 is waiting in a collective for rank 1"
            in text
        )
        assert "[rank 1] was running at cell line 3: time.sleep(120)" in text
        assert back < 10  # about 1 s
        after = kc.execute_interactive("%spmd restart\n%spmd stop", timeout=60)
        assert after["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_torch_distributed_document_runs_on_4_ranks_and_prints_what_it_explains():
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    nb = ran("04-torch-distributed")
    assert_saved_without_empty_outputs(nb)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    shown = [cell_text(c) for c in cells]

    def output(start: str) -> str:
        return next(s for c, s in zip(cells, shown) if c.source.startswith(start))

    starts = [s for c, s in zip(cells, shown) if c.source.startswith("%spmd start")]
    assert len(starts) == 3
    assert all(started(s).startswith("Started 4 processes, 1 device per process, 4 global devices (torch)") for s in starts)
    assert output("import os\nimport torch") == "[ranks 0-3]\nTrue True False False\nTrue gloo 4\n"
    assert output("rank = dist.get_rank()") == "".join(f"[rank {r}] {r} {r} {r}\n" for r in range(4))
    assert output("args = ") == (
        "[ranks 0-3] gloo tcp://127.0.0.1 4\n"
        + "".join(f"[rank {r}] rank {r}\n" for r in range(4))
    )
    # the collectives: one answer, shown once for all four ranks
    assert output("t = torch.tensor([rank + 1.0])\ndist.all_reduce(t, op") == "[ranks 0-3] tensor([10.])\n"
    assert output("x = torch.arange") == "[ranks 0-3] tensor([0., 1., 2., 3.])\n"
    assert output("parts = ") == "[ranks 0-3] tensor([ 0., 10., 20., 30.])\n"
    assert output("%spmd gather mine").startswith("[array([0., 0.], dtype=float32),\n array([1., 1.]")
    picture = next(c for c in cells if c.source == "%spmd sharding weights").outputs
    assert len(picture) == 1 and "image/png" in picture[0]["data"]
    assert output("%spmd sharding weights").splitlines()[1:] == [
        "  [0:4, 0:2]  CPU 0 (process 0)",
        "  [0:4, 2:4]  CPU 1 (process 1)",
        "  [4:8, 0:2]  CPU 2 (process 2)",
        "  [4:8, 2:4]  CPU 3 (process 3)",
    ]
    assert output("%spmd gather weights").startswith("array([[ 0.,  1.,  2.,  3.],")
    assert output("store = dist.TCPStore") == (
        "[ranks 0-3]\n['hello from rank 0', 'hello from rank 1', 'hello from rank 2', "
        "'hello from rank 3']\n4 ranks arrived\n"
    )
    assert output("import tempfile") == "[ranks 0-3]\n[0, 1, 4, 9]\nb'here'\n"
    env = output("import os, torch, torch.distributed as dist, spmd\nrank = dist.get_rank()\nprint(spmd")
    assert env.startswith("[ranks 0-3] {'backend': 'gloo', 'init_method': 'env://'} 127.0.0.1 4\n")
    assert output("import os, torch, torch.distributed as dist, spmd\nrank = dist.get_rank()\ninit_file") == (
        "[ranks 0-3]\ntorch-init True\ntensor([10.])\n"
    )
    losses = output("torch.manual_seed(0)").splitlines()
    assert [line.split("]")[0] for line in losses] == [f"[rank {r}" for r in range(4)]
    assert len({line.split(": ")[-1] for line in losses}) == 4  # each rank its own batch
    weights = output("print(model.weight.data")
    assert weights.startswith("[ranks 0-3] tensor([[") and weights.count("[rank") == 1
    assert output("%%local") == "[False, False, False, False]\n"  # stop removed the init file


@pytest.mark.timeout(120)
def test_rank_widgets_are_saved_as_they_read_when_the_cell_ended(tmp_path):
    path = new_notebook(
        tmp_path,
        "%load_ext spmd\n%spmd start -n 2 --backend none",
        "from tqdm.auto import tqdm\nimport time\n"
        "for i in tqdm(range(30), desc='work'):\n    time.sleep(0.02)",
        "import ipywidgets\nslider = ipywidgets.IntSlider(value=3, description='x')\n"
        "slider.value = 7\nslider",
        "%spmd stop",
    )
    nb = execute(path)
    # the start's progress, saved as its timeline
    assert re.match(
        r"2 engines registered in \d+\.\d s; 2 ranks joined in \d+\.\d s\nStarted 2 processes",
        cell_text(nb.cells[0]),
    )
    # one bar per rank, saved at 100% (its display was made at 0%)
    bars = cell_text(nb.cells[1])
    assert re.fullmatch(
        r"(\[rank [01]\]\nwork: 100%\|██████████\| 30/30 \[[^\]]+\]\n){2}", bars
    ), bars
    assert "[rank 0]" in bars and "[rank 1]" in bars
    sliders = cell_text(nb.cells[2])
    assert sliders.count("IntSlider(value=7, description='x')") == 2, sliders
    # the widgets' models were relayed: nbclient saved their final state too
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    values = [m["state"].get("value") for m in state.values() if m["model_name"] == "IntSliderModel"]
    assert values == [7, 7]


@pytest.mark.timeout(120)
def test_input_on_the_ranks_fails_at_once_where_nbclient_has_no_stdin(tmp_path):
    path = new_notebook(
        tmp_path,
        "%load_ext spmd\n%spmd start -n 2 --backend none",
        "name = input('your name? ')",
        "%spmd stop",
    )
    t0 = time.monotonic()
    with pytest.raises(CellExecutionError) as failed:
        execute(path)
    assert time.monotonic() - t0 < 60
    text = str(failed.value)
    assert "Error on 2 of 2 ranks" in text
    assert "StdinNotImplementedError" in text and "does not support input requests" in text
