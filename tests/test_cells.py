"""Cells on two real ranks: lockstep, grouping, errors, auto mode, %%local, status, stop."""

from __future__ import annotations

import re
import time

import psutil
import pytest
from conftest import (
    client_connection,
    controller_socket,
    fanout_answers,
    ready_cluster,
    run,
    session,
    wait_until_gone,
)

from spmd.magics.render import RankErrors

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(module_shell):
    return ready_cluster(module_shell, "start -n 2 -d 2", "import jax")


def test_start_prints_one_summary_line(fresh):
    out = run(fresh, "%spmd start -n 2 -d 2")
    assert out.error is None, out.stderr
    # (the progress line is rewritten in place while it starts, then gives way to this)
    assert re.fullmatch(
        r"Started 2 processes, 2 devices per process, 4 global devices \(jax\) in \d+\.\d+ s\. "
        r"Auto mode on: every cell now runs on all ranks[^\n]*\n",
        out.stdout,
    ), out.stdout
    session = fresh.magics_manager.registry["SpmdMagics"].session
    assert [r.rank for r in session.ranks] == [0, 1]
    assert all(r.local_devices == 2 and r.global_devices == 4 for r in session.ranks)


def test_same_output_shown_once_and_different_output_per_rank(cluster):
    out = run(cluster, "import jax\nprint(jax.device_count(), jax.local_device_count())")
    assert out.error is None
    assert out.stdout == "[ranks 0-1] 4 2\n"
    out = run(cluster, "print(jax.process_index())")
    assert out.stdout == "[rank 0] 0\n[rank 1] 1\n"


def test_cross_process_psum_gives_the_global_sum(cluster):
    out = run(
        cluster,
        "xs = jax.numpy.ones(jax.local_device_count())\n"
        "jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs)",
    )
    assert out.error is None
    assert out.texts == ["Array([4., 4.], dtype=float32)"]
    assert out.stdout == ""  # (every rank returned it: the value alone, as in one process)


def test_cells_run_in_lockstep(cluster):
    # rank 1 finishes a second later; the next cell must not start on rank 0 before that
    run(cluster, "import time\nif jax.process_index() == 1: time.sleep(1.0)\nt_end = time.time()")
    run(cluster, "t_next = time.time()")
    assert run(cluster, "%spmd gather t_end -o ends").error is None
    assert run(cluster, "%spmd gather t_next -o nexts").error is None
    ends, nexts = cluster.user_ns["ends"], cluster.user_ns["nexts"]
    assert ends[1] - ends[0] > 0.9  # rank 1 did finish later (one clock: one machine)
    assert min(nexts) >= max(ends)


def test_hundreds_of_quick_cells_all_come_back(cluster):
    # Regression: requests sent on the raw socket behind ipyparallel's ZMQStream lost replies
    # after a few cells, and the notebook waited forever.
    for i in range(300):
        out = run(cluster, f"%%spmd --timeout 20\nx = {i}")
        assert out.error is None, f"cell {i}: {out.error}"
    assert run(cluster, "print(x)").stdout == "[ranks 0-1] 299\n"


def test_a_failing_rank_fails_the_cell_and_keeps_the_others_output(cluster):
    out = run(
        cluster,
        "print('before', jax.process_index())\n"
        "if jax.process_index() == 1:\n"
        "    raise ValueError('rank one is unhappy')\n"
        "print('after')",
    )
    assert isinstance(out.error, RankErrors)
    assert out.error.failed_ranks == [1]
    assert "[rank 0] before 0\nafter\n" in out.stdout or "[rank 0]\nbefore 0\nafter\n" in out.stdout
    rendered = "\n".join(out.error._render_traceback_())
    assert "Error on 1 of 2 ranks (1); rank 0 did not raise." in rendered
    assert "[rank 1] ValueError: rank one is unhappy" in rendered
    # the cluster is still usable after an ordinary exception
    assert run(cluster, "print('fine')").stdout == "[ranks 0-1] fine\n"


def test_a_cell_that_sets_up_jax_again_is_told_what_the_ranks_have(cluster):
    """The first line of JAX's tutorials, and jax.distributed.initialize, in a cell of a
    2 x 2 cluster: where what was asked matches, one line and the cell carries on; where it
    does not, one sentence with the start that gives it (before: a ~40-line RuntimeError on
    every rank)."""
    out = run(cluster, "jax.config.update('jax_num_cpu_devices', 4)\nprint('on')")
    assert out.error is None, out.error
    assert out.stdout == ("[ranks 0-1]\njax_num_cpu_devices: each of the 2 processes already "
                          "has its 2 CPU devices, 4 in all: carrying on.\non\n"), out.stdout
    out = run(cluster, "jax.config.update('jax_num_cpu_devices', 8)")
    assert isinstance(out.error, RankErrors), out.error
    rendered = "\n".join(out.error._render_traceback_())
    assert ("[ranks 0-1] AlreadyStarted: Each process already has its 2 CPU devices (4 in all), "
            "made when the cluster started: %spmd start -n 2 -d 4 gives 8 in all.") in rendered
    assert "RuntimeError" not in rendered and len(rendered.splitlines()) < 6, rendered
    out = run(cluster, "jax.distributed.initialize()\nprint(jax.device_count())")
    assert out.error is None, out.error
    assert out.stdout == ("[rank 0]\njax.distributed is already initialized: %spmd start "
                          "joined this process, 0 of 2: carrying on.\n4\n[rank 1]\n"
                          "jax.distributed is already initialized: %spmd start joined this "
                          "process, 1 of 2: carrying on.\n4\n"), out.stdout


def test_a_value_from_one_rank_is_its_value(cluster):
    """A cell that ran on one rank only (%%spmd --ranks 0) and ended in a value: that value,
    under its rank (no other rank sent a part of it to put together)."""
    out = run(cluster, "%%spmd --ranks 0\n6 * 7")
    assert out.error is None, out.error
    assert out.texts == ["42"], out.texts


def test_identical_tracebacks_are_shown_once(cluster):
    out = run(cluster, "1 / 0")
    assert isinstance(out.error, RankErrors)
    assert [ranks for ranks, _ in out.error.errors] == [[0, 1]]
    assert "[ranks 0-1] ZeroDivisionError: division by zero" in out.error._render_traceback_()


def test_rich_outputs_keep_their_mime_bundle_with_a_rank_label(cluster):
    out = run(cluster, "from IPython.display import HTML\nHTML(f'<b>{jax.process_index()}</b>')")
    assert out.error is None
    assert [o["text/html"] for o in out.outputs] == ["<b>0</b>", "<b>1</b>"]
    assert out.stdout == "[rank 0]\n[rank 1]\n"
    assert all("text/plain" in o for o in out.outputs)


def test_matplotlib_figure_from_each_rank(cluster):
    out = run(
        cluster,
        "%matplotlib inline\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([0, 1], [0, jax.process_index() + 1])\n"
        "plt.title(f'rank {jax.process_index()}')\n"
        "plt.show()",
    )
    assert out.error is None, out.error
    pngs = [o for o in out.outputs if "image/png" in o]
    assert len(pngs) == 2 and pngs[0]["image/png"] != pngs[1]["image/png"]
    assert all(o["text/plain"].startswith("<Figure") for o in pngs)


def test_auto_mode_off_keeps_cells_local_and_spmd_cell_magic_still_works(cluster):
    run(cluster, "%spmd off")
    local = run(cluster, "import os\nos.getpid()")
    assert local.error is None
    assert cluster.user_ns["_"] == psutil.Process().pid
    remote = run(cluster, "%%spmd\nimport os\nprint(os.getpid() != 0)")
    assert remote.stdout == "[ranks 0-1] True\n"
    run(cluster, "%spmd on")
    assert run(cluster, "%%local\nnotebook_only = 41 + 1\nnotebook_only").error is None
    assert cluster.user_ns["notebook_only"] == 42
    out = run(cluster, "print('notebook_only' in globals())")
    assert out.stdout == "[ranks 0-1] False\n"


def test_a_subset_of_ranks_warns_that_collectives_would_hang(cluster):
    out = run(cluster, "%%spmd --ranks 1\nprint(jax.process_index())")
    assert out.stdout == "[rank 1] 1\n"
    assert "Running on ranks 1 only: a collective in this cell would hang" in out.stderr


def test_cells_can_import_debugpy_which_start_up_hides(cluster):
    out = run(cluster, "import debugpy\nprint(debugpy.__name__)")
    assert out.error is None, out.stderr
    assert out.stdout == "[ranks 0-1] debugpy\n"


def test_status_lists_every_rank(cluster):
    out = run(cluster, "%spmd status")
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["rank", "host", "pid", "state", "devices", "last", "cell"]
    assert [ln.split()[0] for ln in lines[1:3]] == ["0", "1"]
    assert all(ln.split()[3] == "idle" and ln.split()[4] == "2" for ln in lines[1:3])


def test_stop_ends_every_process_fast_and_turns_auto_mode_off(cluster):
    magics = cluster.magics_manager.registry["SpmdMagics"]
    session = magics.session
    pids = [r.pid for r in session.ranks] + [session.cluster.controller.process.pid]
    out = run(cluster, "%spmd stop")
    assert out.error is None and "Stopped 2 processes" in out.stdout
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert magics.auto.on is False
    # a plain cell now runs in the notebook again
    assert run(cluster, "x_local = 1").error is None and cluster.user_ns["x_local"] == 1


def test_printing_an_array_of_several_processes_points_to_gather(cluster):
    made = run(
        cluster,
        "import jax, numpy as np\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "mesh = jax.make_mesh((4,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))\n"
        "spread = jax.make_array_from_callback(\n"
        "    (8,), NamedSharding(mesh, P('x')), lambda index: np.arange(8.0)[index])",
    )
    assert made.error is None, made.stdout
    out = run(cluster, "n = 1\nnp.asarray(spread * n)")
    assert isinstance(out.error, RankErrors)
    text = "\n".join(out.error._render_traceback_())
    assert "spans non-addressable (non process local) devices" in text
    assert "%spmd gather spread puts it together in the notebook" in text
    # the message is still the error itself
    assert "non-addressable" in str(out.error)


def test_shell_commands_on_ranks_run_without_fork(cluster):
    out = run(cluster, "import jax\n!echo from the shell\nprint(_exit_code)")
    assert out.error is None, out.stdout
    assert out.stdout == "[ranks 0-1]\nfrom the shell\n0\n"
    assert "fork" not in out.stderr  # JAX's "os.fork() was called" warning
    out = run(cluster, "name = 'x' + str(jax.process_index())\n!echo $name")
    assert out.stdout == "[rank 0] x0\n[rank 1] x1\n"


def test_a_cells_result_is_one_out_and_clear_output_reaches_the_notebook(cluster):
    out = run(cluster, "jax.process_index() * 10")
    assert out.texts == ["[rank 0] 0\n[rank 1] 10"]
    out = run(
        cluster,
        "from IPython.display import clear_output\nprint('50%')\nclear_output()\nprint('done')",
    )
    assert out.stdout == "[ranks 0-1] done\n"  # as a notebook shows it: 50% was cleared


def test_processes_a_cell_started_on_the_ranks_end_with_the_cluster(cluster):
    out = run(
        cluster,
        "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nprint(child.pid)",
    )
    assert out.error is None, out.stdout
    children = [psutil.Process(int(line.split()[-1])) for line in out.stdout.splitlines()]
    assert len(children) == 2 and all(c.is_running() for c in children)
    assert run(cluster, "%spmd stop").error is None
    assert not wait_until_gone(children)


def test_a_display_the_same_on_every_rank_is_the_ranks_own_bundle(cluster):
    # (its ranks on a line of their own above it, never inside the bundle)
    out = run(cluster, "from IPython.display import display\ndisplay({'lr': 0.5})")
    assert out.error is None
    assert out.outputs == [{"text/plain": "{'lr': 0.5}"}]
    assert out.stdout == "[ranks 0-1]\n"
    out = run(cluster, "display(jax.process_index())")
    assert out.outputs == [{"text/plain": "0"}, {"text/plain": "1"}]
    assert out.stdout == "[rank 0]\n[rank 1]\n"


def test_a_cell_request_not_signed_with_the_clusters_key_runs_on_no_rank(fresh):
    """The controller's fan-out sends one cell to many ranks: a request it cannot verify is
    dropped, and one signed with the cluster's key runs (so the silence is the key's doing)."""
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    info = client_connection(s)
    assert info["interface"] == "tcp://127.0.0.1"  # (a local cluster: the loopback only)
    rank_0 = s.client._engines[s.ranks[0].engine_id]
    assert not fanout_answers(info, rank_0, "forged = True", key="0" * 64, wait=3)
    assert run(fresh, "print('forged' in globals())").stdout == "[ranks 0-1] False\n"
    assert fanout_answers(info, rank_0, "signed = True")
    out = run(fresh, "print('signed' in globals())")
    assert out.stdout == "[rank 0] True\n[rank 1] False\n", out.stdout
    assert run(fresh, "%spmd stop").error is None


def signed_request(info: dict, targets: list, code: str = "") -> list[bytes]:
    """The frames of one cell request to the fan-out, signed with the cluster's key
    (``targets``: [engine identity, the id its request gets] for each rank)."""
    from jupyter_client.session import Session as Signer

    from spmd.controller.fanout import REQUEST

    signer = Signer(key=info["key"].encode(), signature_scheme=info["signature_scheme"])
    request = {"request": {"code": code, "silent": False, "user_expressions": {}},
               "metadata": {}, "targets": targets}
    return signer.serialize(signer.msg(REQUEST, content=request))


COUNT_RUNS = "runs = globals().get('runs', 0) + 1"


def replays_dropped(s, expected: int) -> int:
    """How many requests the controller's fan-out has refused as replays (its log's warnings),
    once there are ``expected`` or 5 s have passed."""
    deadline = time.monotonic() + 5
    while True:
        with open(s.cluster.controller.output_file) as f:
            found = f.read().count("(a replay) was dropped")
        if found >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.timeout(180)
def test_a_replayed_cell_request_runs_on_no_rank_even_after_a_flood(fresh):
    """A cell request the fan-out has run is refused when it comes again, byte for byte; and
    still after more new requests than the fan-out remembers (a flood cannot make it forget
    one that could then be replayed)."""
    from spmd.controller.fanout import PORT_KEY, SEEN

    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    info = client_connection(s)
    rank_0 = s.client._engines[s.ranks[0].engine_id]
    cell = signed_request(info, [[rank_0, f"probe-{time.time()}"]], COUNT_RUNS)
    with controller_socket(info, info[PORT_KEY], curve=False) as sock:
        sock.send_multipart(cell)
        assert sock.poll(30_000), "the fan-out did not run the request once"
        sock.recv_multipart()
        sock.send_multipart(cell)  # (the same bytes: a replay)
        assert not sock.poll(3000)
        # (requests for no rank: each is remembered, and runs nowhere)
        for _ in range(SEEN):
            sock.send_multipart(signed_request(info, []))
        sock.send_multipart(cell)
        assert not sock.poll(3000)
    out = run(fresh, "print(globals().get('runs', 0))")
    assert out.stdout == "[rank 0] 1\n[rank 1] 0\n", out.stdout
    # (the fan-out's own refusal both times, not only the rank's: a rank drops a message whose
    # signature it has seen, but a restarted rank, or one without a key, would run it)
    assert replays_dropped(s, 2) == 2
    assert run(fresh, "%spmd stop").error is None


def test_a_cluster_whose_key_is_empty_runs_cell_after_cell(fresh, monkeypatch):
    """ipyparallel runs a cluster without a key when one is configured empty (nothing is
    signed): the fan-out's replay guard must not take every cell after the first for a replay
    (every signature is the same empty one)."""
    from spmd.cluster import startup

    made = startup.cluster_config

    def without_key(*args, **kwargs):
        config = made(*args, **kwargs)
        config.Cluster.controller_args = [*config.Cluster.controller_args, "--Session.key="]
        return config

    monkeypatch.setattr(startup, "cluster_config", without_key)
    out = run(fresh, "%spmd start -n 2 --backend none")
    assert out.error is None, out.stdout + out.stderr
    assert client_connection(session(fresh))["key"] == ""  # (the cluster really has none)
    for i in range(3):
        out = run(fresh, f"print({i})")
        assert out.error is None and out.stdout == f"[ranks 0-1] {i}\n", out.stdout
    assert run(fresh, "%spmd stop").error is None


def no_routes_within(routes: dict, seconds: float = 10.0) -> bool:
    """Whether the client's table of cell routes (written on its IO thread) is empty within
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while routes and time.monotonic() < deadline:
        time.sleep(0.05)
    return not routes


STUBBORN = (  # (a cell that ignores the interrupt: the notebook stops waiting, it runs on)
    "%%spmd --timeout 1\nimport time\nwhile True:\n    try:\n        time.sleep(100)\n"
    "    except KeyboardInterrupt:\n        pass"
)


@pytest.mark.timeout(180)
def test_a_cell_that_ends_early_leaves_no_routes_behind(fresh):
    """A cell's routes (where each rank's outputs go) end with the cell, however it ends:
    interrupted on a timeout, given up on with its ranks still in it and then restarted,
    a rank that died in it."""
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    routes = s.client.cells.routes
    out = run(fresh, "%%spmd --timeout 1\nimport time\ntime.sleep(100)")
    assert isinstance(out.error, RankErrors)
    assert no_routes_within(routes)
    assert run(fresh, "%spmd restart").error is None
    out = run(fresh, STUBBORN)
    assert isinstance(out.error, RankErrors)
    # (its ranks still run it: a later poll, %spmd status, hears them finish)
    assert s.unfinished is not None and all(i in routes for i in s.unfinished.requests.values())
    assert run(fresh, "%spmd restart").error is None
    assert no_routes_within(routes)
    out = run(fresh, "import os, time\nif os.environ['SPMD_RANK'] == '1':\n    os._exit(3)\n"
                     "time.sleep(100)")
    assert isinstance(out.error, RankErrors)
    assert no_routes_within(routes)
    assert run(fresh, "%spmd stop").error is None


def test_processes_a_cell_started_end_at_a_restart_with_their_own_children(fresh):
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    out = run(fresh, "import subprocess\n"
                     "child = subprocess.Popen(['bash', '-c', 'sleep 1000 & wait'])\n"
                     "print(child.pid)")
    assert out.error is None, out.stdout
    children = [psutil.Process(int(line.split()[-1])) for line in out.stdout.splitlines()]
    deadline = time.monotonic() + 10
    while not all(c.children() for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # (bash starts its sleep)
    started = children + [g for c in children for g in c.children()]
    assert len(started) == 4
    assert run(fresh, "%spmd restart").error is None
    assert not wait_until_gone(started)
    assert run(fresh, "%spmd stop").error is None
