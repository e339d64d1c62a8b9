"""Ending a cluster's processes, in steps Session runs with its lock held: the ranks with no
process handle here (on their control channel), the ranks alone after a death (the
controller and the rank servers stay, for a fast restart), and everything at a stop, from the
frozen record of what ran (records.Running)."""

from __future__ import annotations

import signal
import threading

from spmd.cluster.channel import control
from spmd.cluster.generation import Generation
from spmd.cluster.launchers import processes, servers, ssh
from spmd.cluster.records import Running, Settings


def end_far_ranks(running: Running, gen: Generation) -> None:
    """Ranks with no process handle here end at once on their control channel; the
    launcher's own stop (over ssh, mpiexec or scancel) then only confirms it."""
    engine_ids = [
        r.engine_id
        for r in gen.ranks
        if r.rank not in gen.launchers and r.state not in ("died", "stopped")
    ]
    launchers = {
        gen.ranks[rank].engine_id: ln for rank, ln in running.cluster.ssh_launchers().items()
        if rank < len(gen.ranks)
    }
    if not engine_ids or running.client is None:
        return
    ended = control.signal(running.client, engine_ids, signal.SIGTERM, timeout=0.5)
    for engine_id, launcher in launchers.items():
        launcher.ended_by_control = engine_id in ended


def end_ranks(running: Running, gen: Generation) -> None:
    """End the ranks' engines (and what their cells started), keeping the rest."""
    cluster = running.cluster
    started_in_ranks = processes.started_by_ranks(cluster)
    end_far_ranks(running, gen)
    if cluster.rank_set in cluster.engines:
        cluster._in_thread(cluster.stop_engines, cluster.rank_set)
    processes.end(started_in_ranks)


def end_all(running: Running, settings: Settings, end_loop: bool = True) -> None:
    """Every process of the cluster ends: the client closes, the engines and the controller
    stop, what the ranks' cells started ends, the rank servers close (over ssh, each removes
    the cluster's files on its host), and the cluster's event loop ends (``end_loop``)."""
    cluster, client, server = running.cluster, running.client, running.rank_server
    if client is not None:
        client.close(linger=0)
    if cluster is None:
        if server is not None:  # (a start that failed before its cluster)
            server.close()
        return
    started_in_ranks = processes.started_by_ranks(cluster)
    far = list(cluster.ssh_launchers().values())
    lost = {ln.location for ln in far if ln.lost}
    # (where the hosts keep it: relative to their home, when it is under ours)
    remote_dir = next(
        (ln.remote_profile_dir for ln in far if getattr(ln, "remote_profile_dir", "")),
        running.profile_dir,
    )
    controller = getattr(cluster.controller, "process", None)  # (a psutil handle)
    removed: set[str] = set()
    try:
        # Engines exit on SIGTERM at once (engine.initialize installs that); one that is
        # stuck in C++ is killed after LocalProcessLauncher.stop_seconds_until_kill.
        cluster._in_thread(cluster.stop_cluster)
    finally:  # (whatever ipyparallel's stop raised, the rest ends all the same)
        # ipyparallel stops the controller beside the engines: where the engines' stop
        # raised first, the controller's may not have finished
        processes.end_within([controller] if controller is not None else [], 2.0)
        processes.end(started_in_ranks)
        where = settings.where
        # The rank servers kill any rank still there as they end; over ssh, each removes
        # the cluster's files on its host.
        if isinstance(server, servers.SSHRankServers):
            lost |= {host for host in server.servers if server.lost(host)}
            removed = server.close()
        elif server is not None:
            server.close()
        if where.launcher == "ssh" and running.profile_dir:  # (their files, their disks)
            hosts = [h for h, _ in where.hosts if h not in lost and h not in removed]
            ssh.remove_folder(hosts, where.ssh_cmd, where.ssh_args, remote_dir)
    if end_loop:
        end_event_loop(cluster)


def end_event_loop(cluster) -> None:
    """The cluster's event-loop thread ends: every restart makes a new Cluster."""
    loop = getattr(cluster, "_thread_loop", None)
    if loop is None:
        return
    loop.add_callback(loop.stop)
    # (closed once its thread has left it: an open one keeps its selector and self-pipe,
    # three descriptors a start and stop)
    thread = getattr(cluster, "_async_thread", None)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
