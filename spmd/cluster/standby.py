"""Standby engines: a second set of engines behind the ranks, promoted by a restart."""

from __future__ import annotations

import signal
import time

from spmd.cluster import interrupts, processes
from spmd.cluster.ranks import Generation, Rank
from spmd.cluster.startup import _loopback_ports
from spmd.engine import bootstrap as engine

# Where a standby set can start beside the ranks: mpiexec and srun start one job step,
# whose ranks all come and go together.
STANDBY_LAUNCHERS = ("local", "ssh")


class Standbys:
    """Session's standby set (a mixin: the state is Session's, see session.py)."""

    def _standby_wanted(self) -> bool:
        s = self.settings
        if self._server is not None:  # (the rank server forks new ranks at a restart)
            return False
        if s.standby is False or s.where.launcher not in STANDBY_LAUNCHERS:
            return False
        if not s.where.on_this_machine:
            # Other hosts: standbys hold no GPU memory (jax and torch only start their
            # devices when a rank joins), and the hosts' memory is theirs to judge.
            return True
        # on by default where both sets fit; asked for (True), where the one more set fits
        return processes.max_local_ranks() >= (2 * s.n if s.standby is None else s.n)

    def _start_standby(self) -> None:
        """Start a set of standby engines behind the ranks: jax (or torch) imported at low
        priority, waiting to be promoted by a restart. Returns once the processes are
        started (locally), or at once (over ssh); they import alone."""
        if self.cluster is None or not self._standby_wanted():
            return
        self._engine_sets += 1
        environment = dict(
            self.cluster.engine_environment(),
            **{
                engine.STANDBY_ENV: "1",
                engine.ENGINE_ID_OFFSET_ENV: str(self._engine_sets * self.settings.n),
                # their coordinators come with the promotion
                engine.COORDINATOR_ENV: "",
                engine.TORCH_MASTER_ENV: "",
            },
        )
        self._settling = {}
        self._standby_start = self.cluster.in_background(
            self.cluster.start_standby, self.settings.n, environment
        )
        if self.settings.where.launcher == "local":
            # Local processes start in milliseconds: a start returns with every process it
            # began. Over ssh that takes a second or more, which a restart does not wait for.
            self._standby_started(self.settings.start_timeout)

    def _standby_started(self, seconds: float) -> bool:
        """Wait until the standby set's start returned; whether it started."""
        starting, self._standby_start = self._standby_start, None
        if starting is None:
            return True
        try:
            starting.result(timeout=seconds)
        except BaseException as exc:  # a host refused, it did not finish in time, or ^C
            self._standby_start = starting if not starting.done() else None  # (for stop)
            if not isinstance(exc, Exception):
                raise
            return False
        return True

    def standbys(self) -> list[Rank]:
        """The standby engines, as rows (rank = the rank each would become); [] if none.
        state: ready (backends imported), starting, or failed (exited, or its import did)."""
        if self.cluster is None:
            return []
        rows = []
        offset = self._engine_sets * self.settings.n
        registered = set(self.client.ids) if self.client is not None else set()
        for rank, launcher in sorted(self.cluster.standby_launchers().items()):
            engine_id = offset + rank
            settling = self._settling.get(engine_id)
            if settling is None and engine_id in registered:
                settling = self._settling[engine_id] = self.client[engine_id].apply_async(
                    engine.settle
                )
            done = settling is not None and settling.ready()
            settled = settling.get() if done and settling.successful() else {}
            if processes.launcher_ended(launcher):
                state = "failed"
            elif not done:
                state = "starting"
            else:
                state = "ready" if settled else "failed"
            rows.append(
                Rank(
                    rank=rank, engine_id=engine_id, pid=launcher.pid or 0, state=state,
                    host=self.ranks[rank].host if rank < len(self.ranks) else "",
                    memory=settled.get("memory", 0),
                )
            )
        return rows

    def _standbys_ready(self, seconds: float = 60.0) -> list[Rank]:
        """The standbys once all are ready (waiting while they start); [] if one failed, or
        the wait was cancelled (a shutdown)."""
        deadline = time.monotonic() + seconds
        if not self._standby_started(seconds):
            return []
        while not self._stopping.is_set():
            standbys = self.standbys()
            states = {r.state for r in standbys}
            if len(standbys) != self.settings.n or "failed" in states:
                return []
            if states == {"ready"}:
                return standbys
            if time.monotonic() > deadline:
                return []
            time.sleep(0.02)
        return []

    def _restart_from_standbys(self) -> bool:
        """Promote the standbys to ranks and start new standbys behind them: the controller
        and the client stay. False (nothing done) where no standby set is ready: the caller
        then stops and starts afresh. Raises StartError if the promoted ranks fail to join.

        The wait for the standbys can be interrupted (nothing has changed yet); from the
        first old rank ended to the new ranks joined, a SIGINT waits."""
        t0 = time.perf_counter()
        with interrupts.interruptible():
            standbys = self._standbys_ready()
        if not standbys:
            return False
        with self._life, interrupts.held("the restart"):
            if self.cluster is None or self._stopping.is_set():  # stopped meanwhile
                return False
            self._promote(standbys)
        self.start_seconds = time.perf_counter() - t0
        return True

    def _promote(self, standbys: list[Rank]) -> None:
        cluster = self.cluster
        started_in_ranks = processes.started_by_ranks(cluster)
        # The old ranks end: SIGTERM, and SIGKILL soon for those stuck in a collective
        # (ipyparallel's own kill comes after a whole second) ...
        old = list(cluster.rank_launchers().values())
        for launcher in old:
            launcher.signal(signal.SIGTERM)
        self._end_far_ranks()  # (ranks on other hosts end on their control channel)
        processes.kill_now(old, after=0.2)
        cluster._in_thread(cluster.promote_standby)
        processes.end(started_in_ranks)
        self._remove_torch_file()
        # ... and the standbys join a new job, as the same ranks: a new generation, whole.
        self.gen = Generation(
            ranks=[Rank(rank=r.rank, engine_id=r.engine_id) for r in standbys],
            launchers=cluster.rank_launchers(),
            ssh=cluster.ssh_launchers(),
        )
        self._engine_rank.update({r.engine_id: r.rank for r in self.gen.ranks})
        self._cells.clear()
        local = self.settings.where.launcher == "local"
        try:
            # (on other hosts the new rank 0 proposes its own addresses)
            self._init_distributed(
                coordinators=_loopback_ports(self.settings.backend) if local else None
            )
        except BaseException:
            self.stop(keep_cache=True)
            raise
        self._start_standby()
