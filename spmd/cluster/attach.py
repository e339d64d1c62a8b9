"""Attaching a new notebook process to a lingering cluster (linger.py has its record), and
ending one from its record alone (``python -m spmd stop``).

The cluster's processes are found again by pid: ipyparallel rebuilds its launchers from the
state they saved (``from_dict``: each watches its process, and stops it by signal), and a new
client connects with the cluster's key from its connection file. The rank server was started
by the notebook process that died, so nothing has a pipe to it any more: it is ended by
SIGTERM, and a restart starts afresh.

Threads: the main thread attaches and ends; ipyparallel's event-loop thread rebuilds the
launchers (it owns them).
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from spmd.cluster import linger, stopping
from spmd.cluster.adopted import Adopted
from spmd.cluster.launchers import processes, profiles
from spmd.cluster.linger import AttachError, Record, check, give_back, remove, take, taken
from spmd.engine.life.orphans import started_at


def _same(record: Record, pid: int) -> bool:
    """Whether ``pid`` is still the process the record lists (not a pid reused since)."""
    return bool(pid) and started_at(pid) == record.started_at.get(str(pid))


def _still_there(record: Record) -> None:
    """AttachError where a process of the cluster on this machine has ended (its linger
    ended as this notebook took it: orphans.Linger.confirm_over)."""
    ranks_here = [int(e.get("pid") or 0) for e in record.engines.get("engines", {}).values()]
    if not record.alive() or not all(
            _same(record, pid) for pid in ranks_here + [record.rank_server] if pid):
        raise AttachError(f"Cluster {record.id}'s linger ended as it was attached: end the "
                          f"rest with python -m spmd stop {record.id}.")


def adopt(launch, record: Record) -> list[int]:
    """Make the launch hold the record's running cluster: its controller and ranks by pid
    (ipyparallel's launchers, rebuilt from their state), a new client with the cluster's
    key, the rank server by pid. The engine ids, by rank."""
    from ipyparallel.cluster.launcher import LocalControllerLauncher
    from traitlets.config import Config

    from spmd.cluster.launchers import servers
    from spmd.cluster.launchers.launch import RankedEngineSetLauncher, SpmdCluster, cluster_log

    ranks_here = [int(e.get("pid") or 0) for e in record.engines.get("engines", {}).values()]
    if not all(_same(record, pid) for pid in ranks_here + [record.rank_server] if pid):
        raise AttachError(f"Cluster {record.id}'s ranks have ended: end the rest with "
                          f"python -m spmd stop {record.id}.")
    config = Config()
    config.LocalProcessLauncher.stop_seconds_until_kill = 1
    cluster = SpmdCluster(
        n=record.n(), profile_dir=record.profile_dir, cluster_id=record.cluster_id,
        config=config, log=cluster_log(), shutdown_atexit=False,
    )

    async def rebuild() -> None:  # (on the cluster's event-loop thread, which owns launchers)
        cluster.controller = LocalControllerLauncher.from_dict(record.controller, parent=cluster)
        if record.engines:  # (ranks on this machine: by pid)
            cluster.engines[record.engine_set] = RankedEngineSetLauncher.from_dict(
                record.engines, engine_set_id=record.engine_set, parent=cluster)

    try:
        cluster._in_thread(rebuild)
    except Exception as exc:  # (ipyparallel's NotRunning: a process of it ended)
        stopping.end_event_loop(cluster)
        raise AttachError(f"Cluster {record.id} has ended ({exc}): start one with "
                          "%spmd start.") from None
    cluster.rank_set = record.engine_set
    launch.cluster = cluster
    launch.profile_dir, launch.cache_dir = record.profile_dir, record.cache_dir
    launch.address, launch.hash_seed = record.address, record.hash_seed
    launch.coordinator, launch.torch_method = record.coordinator, record.torch_method
    if record.rank_server:
        launch.rank_server = servers.LingeringServer(record.rank_server)
        cluster.rank_server = launch.rank_server
    launch.client = cluster._in_thread(cluster.connect_client)
    engine_ids = [row["engine_id"] for row in record.ranks]
    deadline = time.monotonic() + 10
    while set(engine_ids) - set(launch.client.ids):
        if time.monotonic() > deadline:
            missing = sorted(set(engine_ids) - set(launch.client.ids))
            raise AttachError(f"Cluster {record.id}'s engines {missing} no longer answer: "
                              f"end it with python -m spmd stop {record.id}.")
        launch.client.sync_engines()
        time.sleep(0.05)
    return engine_ids


def attach(session, record: Record):
    """Make the new ``session`` hold the cluster of ``record``, or leave everything as it
    was (AttachError): the cluster lingers on, for another try.

    The new client connects before the owner files name this process: a rank copies what
    it prints to its log until it finds a notebook back (or, for the cell that ran when the
    notebook died, until that cell ends: engine/life/unattended.py), and the client hears it from
    its connection on, so nothing printed between is lost. The cell the ranks still run
    becomes this session's (adopted.py)."""
    import atexit

    with taken(record):
        check(record)  # (the refusals, before anything is done)
        with session.life:
            before: dict = {}
            try:
                engine_ids = adopt(session.launch, record)
                adopted = Adopted.find(session.launch.client, engine_ids)
                adopted.gone_at = linger.gone_at(record)  # (gone once this process holds it)
                session.launch.client.adopted = adopted
                # (a process whose linger ended as this one took it: looked for before the
                # owner files name this process, or the others would linger anew)
                before = take(record, still_there=lambda: _still_there(record))
            except BaseException as exc:
                running = session.launch.hand_over()
                if running.client is not None:
                    running.client.close(linger=0)
                if running.cluster is not None:
                    stopping.end_event_loop(running.cluster)
                give_back(record, before)
                if isinstance(exc, (AttachError, KeyboardInterrupt)):
                    raise
                raise AttachError(
                    f"Cluster {record.id} could not be attached ({type(exc).__name__}: {exc}): "
                    f"try again, or end it with python -m spmd stop {record.id}.") from None
            session.launch.record_id = record.id
            # (it lingers again should this notebook die; a stop disarms it: linger.disarm)
            session.launch.linger_env = linger.process_env(session.settings, record.profile_dir)
            session._new_generation(engine_ids)
            session.gen.adopted = adopted
            for row, kept in zip(session.gen.ranks, record.rows()):
                row.pid, row.host, row.gpus = kept.pid, kept.host, kept.gpus
                row.local_devices, row.global_devices = kept.local_devices, kept.global_devices
                row.main_thread = kept.main_thread
            atexit.register(session.stop)
    return session


def end(record: Record) -> None:
    """End a cluster from its record alone (``python -m spmd stop``): its rank server and
    controller by SIGTERM (the server kills its ranks), every rank it lists, then its
    folders and its record."""
    import shutil

    handles = []
    known = {str(record.controller_pid()): record.controller_started, **record.started_at}
    for pid, started in known.items():
        try:
            if started is not None and started_at(int(pid)) == started:  # (not a pid reused)
                handles.append(psutil.Process(int(pid)))
        except (psutil.Error, ValueError):
            continue
    for process in handles:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    alive = processes.wait_gone(handles, 5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    processes.wait_gone(alive, 5)
    own_cache = record.cache_dir if record.cache_dir != record.settings.get("cache_dir") else None
    for folder in (record.profile_dir, own_cache):  # (only folders the cluster made)
        if folder and os.path.isfile(os.path.join(folder, profiles.OWNER_FILE)):
            shutil.rmtree(folder, ignore_errors=True)
    remove(record)
