"""Cell requests to the controller's fan-out on two real ranks (``--backend none``), sent
straight to its socket: one not signed with the cluster's key, or one it has run before (a
replay, also after a flood of new ones), runs on no rank; a cluster configured without a key
still runs cell after cell."""

from __future__ import annotations

import time

import pytest
from conftest import client_connection, controller_socket, fanout_answers, run, session

pytestmark = pytest.mark.timeout(120)


def test_a_cell_request_not_signed_with_the_clusters_key_runs_on_no_rank(fresh):
    """The controller's fan-out sends one cell to many ranks: a request it cannot verify is
    dropped, and one signed with the cluster's key runs (so the silence is the key's doing)."""
    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    info = client_connection(s)
    assert info["interface"] == "tcp://127.0.0.1"  # (a local cluster: the loopback only)
    rank_0 = s.record().client._engines[s.ranks[0].engine_id]
    assert not fanout_answers(info, rank_0, "forged = True", key="0" * 64, wait=1)
    # (the fan-out's own word that it dropped it: no reply can follow, however late)
    assert logged(s, BAD_SIGNATURE, 1) == 1
    assert run(fresh, "print('forged' in globals())").stdout == "[ranks 0-1] False\n"
    assert fanout_answers(info, rank_0, "signed = True")
    out = run(fresh, "print('signed' in globals())")
    assert out.stdout == "[rank 0] True\n[rank 1] False\n", out.stdout
    assert run(fresh, "%spmd stop").error is None


def signer_of(info: dict):
    """A jupyter_client Session that signs with the cluster's key (made once: making one
    costs far more than signing a message, and a flood signs tens of thousands)."""
    from jupyter_client.session import Session as Signer

    return Signer(key=info["key"].encode(), signature_scheme=info["signature_scheme"])


def signed_request(signer, targets: list, code: str = "") -> list[bytes]:
    """The frames of one cell request to the fan-out, signed by ``signer`` (``signer_of``)
    (``targets``: [engine identity, the id its request gets] for each rank); each request
    has an id and a date of its own."""
    from spmd.wire import CELL_REQUEST

    request = {"request": {"code": code, "silent": False, "user_expressions": {}},
               "metadata": {}, "targets": targets}
    return signer.serialize(signer.msg(CELL_REQUEST, content=request))


COUNT_RUNS = "runs = globals().get('runs', 0) + 1"


BAD_SIGNATURE = "a message with a bad signature was dropped"
REPLAY = "(a replay) was dropped"


def logged(s, warning: str, expected: int, within: float = 30.0) -> int:
    """How many times the controller's log has ``warning`` (the fan-out's word that it dropped
    a request), once there are ``expected`` or ``within`` seconds have passed (only a fan-out
    that hangs, or never drops it, takes that long)."""
    deadline = time.monotonic() + within
    while True:
        with open(s.record().cluster.controller.output_file) as f:
            found = f.read().count(warning)
        if found >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def replays_dropped(s, expected: int) -> int:
    """How many requests the controller's fan-out has refused as replays (its log's warnings),
    once there are ``expected`` or 5 s have passed."""
    return logged(s, REPLAY, expected, within=5)


@pytest.mark.timeout(180)
def test_a_replayed_cell_request_runs_on_no_rank_even_after_a_flood(fresh):
    """A cell request the fan-out has run is refused when it comes again, byte for byte; and
    still after more new requests than the fan-out remembers (a flood cannot make it forget
    one that could then be replayed)."""
    from spmd.controller.fanout import SEEN
    from spmd.wire import CELLS_PORT

    assert run(fresh, "%spmd start -n 2 --backend none").error is None
    s = session(fresh)
    info = client_connection(s)
    rank_0 = s.record().client._engines[s.ranks[0].engine_id]
    signer = signer_of(info)
    cell = signed_request(signer, [[rank_0, f"probe-{time.time()}"]], COUNT_RUNS)
    with controller_socket(info, info[CELLS_PORT], curve=False) as sock:
        sock.send_multipart(cell)
        assert sock.poll(30_000), "the fan-out did not run the request once"
        sock.recv_multipart()
        sock.send_multipart(cell)  # (the same bytes: a replay)
        # (the fan-out's word that it dropped it first, then no reply: the request ran above
        # and answered in well under the second waited here)
        assert logged(s, REPLAY, 1) == 1
        assert not sock.poll(1000)
        # (requests for no rank: each is remembered, and runs nowhere)
        for _ in range(SEEN):
            sock.send_multipart(signed_request(signer, []))
        sock.send_multipart(cell)
        # (the whole flood read, in order, before the replay behind it; the socket still open)
        assert logged(s, REPLAY, 2) == 2
        assert not sock.poll(1000)
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
