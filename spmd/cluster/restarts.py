"""``%spmd restart`` with rank servers: the old ranks end, and the servers (this machine's, or
one per ssh host) fork new ones that register with the same controller; the notebook's
connection stays. Without a server (mpi, slurm, --rank-server off) a restart starts afresh."""

from __future__ import annotations

import os
import signal
import time

import psutil

from spmd.cluster import interrupts
from spmd.cluster.launchers import processes, servers
from spmd.cluster.ranks import StartError
from spmd.cluster.startup import _loopback_ports, import_time_env
from spmd.engine import bootstrap as engine


class Restarts:
    """Session's restart (a mixin: the state is Session's, see session.py)."""

    def restart(self) -> bool:
        """Start the ranks again, keeping the controller and the client, forked by the rank
        servers. False (nothing done) where there are none, or they ended: the caller then
        stops and starts afresh. Raises StartError if the new ranks fail to join."""
        self._keep_rank_env()
        if self._server is None:
            return False
        t0 = time.perf_counter()
        with self._life, interrupts.held("the restart"):
            if self.cluster is None or self._stopping.is_set() or not self._server.usable:
                return False  # (a server that ended: the restart starts a new one)
            now = import_time_env()
            changed = sorted(k for k in now.keys() | self._server_env.keys()
                             if now.get(k) != self._server_env.get(k))
            if changed:  # (a new server imports jax with them: the restart starts afresh)
                self.afresh_because = (f"{', '.join(changed)} changed since the rank server "
                                       "imported jax, which reads it only then")
                return False
            try:
                self._refork()
            except BaseException:
                self.stop(keep_cache=True)
                raise
        self.start_seconds = time.perf_counter() - t0
        return True

    def _keep_rank_env(self) -> None:
        """The variables jax reads at import that cells changed on the ranks (``%env
        JAX_ENABLE_X64=1`` in auto mode) become the notebook's, which every rank of this
        restart, forked or afresh, starts with (engine/import_env.py)."""
        routes = getattr(self.client, "cells", None)
        changed = routes.rank_env if routes is not None else {}
        if not changed:
            return
        routes.rank_env = {}
        for name, value in changed.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def _refork(self) -> None:
        cluster, n = self.cluster, self.settings.n
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
        self._engine_sets += 1
        offset = self._engine_sets * n
        local = self.settings.where.launcher == "local"
        coordinators = _loopback_ports(self.settings.backend) if local else {}
        environment = dict(
            cluster.engine_environment(),
            **{
                engine.ENGINE_ID_OFFSET_ENV: str(offset),
                engine.COORDINATOR_ENV: coordinators.get("jax", ""),
                engine.TORCH_MASTER_ENV: coordinators.get("torch", ""),
                engine.TORCH_INIT_ENV: self._torch_init(),  # (a file left from before: removed)
            },
        )
        try:
            cluster._in_thread(cluster.replace_ranks, n, environment)
        except (OSError, servers.ServerUnavailable, servers.ServerSlow, psutil.Error) as exc:
            raise StartError(
                f"The rank server could not fork the new ranks ({exc}): the restart was given "
                "up and no rank runs now; %spmd restart starts them afresh."
            ) from None
        if not isinstance(self._server, servers.SSHRankServers):
            # (a server found gone before the fork: a Python each. Over ssh the fallback's
            # engines run through the servers' master connections, which stay until the stop)
            self._note_fallback()
        self._cells.clear()
        self.ran.clear()  # (what the new ranks have not run, an export leaves out)
        with interrupts.interruptible():  # (a ^C here gives up the restart: the stop follows)
            self._wait_registered(range(offset, offset + n))
            self._new_generation(engine_ids=list(range(offset, offset + n)))
            self._tell_coordinator(coordinators)
            self._init_distributed(coordinators=None)  # (given at the fork)


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
