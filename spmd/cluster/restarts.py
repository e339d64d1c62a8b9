"""``%spmd restart`` with rank servers, in steps Session runs with its lock held: the old
ranks end, and the servers (this machine's, or one per ssh host) fork new ones that register
with the same controller; the notebook's connection stays. Without a server (mpi, slurm,
--rank-server off) a restart starts afresh."""

from __future__ import annotations

import os
import signal
import time

import psutil

from spmd.cluster.launchers import processes, servers
from spmd.cluster.records import StartError
from spmd.cluster.startup import Launch, import_time_env, loopback_ports
from spmd.engine import bootstrap as engine
from spmd.words import rank_words


def keep_rank_env(client, ranks: list) -> str:
    """The variables jax reads at import that cells changed on the ranks (``%env
    JAX_ENABLE_X64=1`` in auto mode) become the notebook's, which every rank of this
    restart, forked or afresh, starts with (engine/join/import_env.py); only those that every one
    of ``ranks`` (rank rows) changed alike: the restart starts them all with one environment.
    One sentence on those left out ('' when none)."""
    engine_ids = [r.engine_id for r in ranks]
    routes = getattr(client, "cells", None)
    by_engine = routes.rank_env if routes is not None else {}
    if not by_engine:
        return ""
    routes.rank_env = {}
    unchanged = object()
    left_out: dict[str, list[int]] = {}  # name -> the ranks that changed it
    for name in sorted({name for changes in by_engine.values() for name in changes}):
        values = [by_engine.get(e, {}).get(name, unchanged) for e in engine_ids]
        if any(v is unchanged for v in values) or len(set(values)) > 1:
            left_out[name] = [r for r, v in enumerate(values) if v is not unchanged]
            continue
        if values[0] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = values[0]
    if not left_out:
        return ""
    said = "; ".join(
        f"{name} on {rank_words(ranks)} only" if len(ranks) < len(engine_ids)
        else f"{name} to different values on different ranks"
        for name, ranks in left_out.items())
    them = "it" if len(left_out) == 1 else "them"
    return (f"A cell changed {said}: the restart starts every rank with one environment, so "
            f"it leaves {them} as before (set {them} on every rank alike, or with %%local "
            f"%env, to keep {them}).")


def why_afresh(launch: Launch) -> str:
    """Why the rank server cannot fork this restart's ranks ('' when it can): what jax and
    XLA read once, at import, changed since it imported them."""
    now = import_time_env()
    changed = sorted(k for k in now.keys() | launch.server_env.keys()
                     if now.get(k) != launch.server_env.get(k))
    if not changed:
        return ""
    return (f"{', '.join(changed)} changed since the rank server imported jax, which reads it "
            "only then")


def refork(launch: Launch) -> tuple[range, dict[str, str]]:
    """The old ranks end and the rank servers fork new ones: their engine ids (not yet
    registered) and the coordinators they were given."""
    cluster, n = launch.cluster, launch.settings.n
    # The old ranks end: SIGTERM, and SIGKILL soon for those stuck in a collective
    # (ipyparallel's own kill comes after a whole second), with what their cells started.
    started_in_ranks = processes.started_by_ranks(cluster)
    old = list(cluster.rank_launchers().values())
    far = list(cluster.ssh_launchers().values())
    for launcher in old + far:
        launcher.signal(signal.SIGTERM)
    processes.kill_now(old, after=0.2)
    _kill_far(far, after=0.2)
    processes.end(started_in_ranks)
    # New engine ids (the controller never gives one twice), the same ranks, a new
    # coordinator (the old one's port may linger). Over ssh, rank 0 proposes its own
    # once it runs, as at the start.
    launch.engine_sets += 1
    offset = launch.engine_sets * n
    local = launch.settings.where.launcher == "local"
    coordinators = loopback_ports(launch.settings.backend) if local else {}
    environment = dict(
        cluster.engine_environment(),
        **{
            engine.ENGINE_ID_OFFSET_ENV: str(offset),
            engine.COORDINATOR_ENV: coordinators.get("jax", ""),
            engine.TORCH_MASTER_ENV: coordinators.get("torch", ""),
            engine.TORCH_INIT_ENV: launch.torch_init(),  # (a file left from before: removed)
        },
    )
    try:
        cluster._in_thread(cluster.replace_ranks, n, environment)
    except (OSError, servers.ServerUnavailable, servers.ServerSlow, psutil.Error) as exc:
        raise StartError(
            f"The rank server could not fork the new ranks ({exc}): the restart was given "
            "up and no rank runs now; %spmd restart starts them afresh."
        ) from None
    if not isinstance(launch.rank_server, servers.SSHRankServers):
        # (a server found gone before the fork: a Python each. Over ssh the fallback's
        # engines run through the servers' master connections, which stay until the stop)
        launch.note_fallback()
    return range(offset, offset + n), coordinators


def _kill_far(launchers, after: float) -> None:
    """SIGKILL (with its process group) each rank on another host that has not ended
    ``after`` seconds from now, as its rank server reported."""
    deadline = time.monotonic() + after
    for launcher in launchers:
        if launcher.lost or launcher.state != "running":
            continue
        ended, _ = launcher.server.exit_code(launcher.pid, max(0.0, deadline - time.monotonic()))
        if not ended:
            launcher.kill_now()
