"""Deaths: which ranks ended or vanished, what is known of how, and ending the others."""

from __future__ import annotations

import os
import signal
import time

from spmd.cluster import interrupts
from spmd.cluster.launchers import processes, remote
from spmd.cluster.launchers.forks import ForkedEngineLauncher, ForkedSSHEngineLauncher
from spmd.cluster.launchers.launch import RankedEngineLauncher
from spmd.cluster.channel import control
from spmd.cluster.lockstep import where
from spmd.cluster.lockstep.watchdog import Death, last_lines, with_hint
from spmd.cluster.ranks import OutOfStep


class Deaths:
    """Session's deaths (a mixin: the state is Session's, see session.py)."""

    def _any_death(self) -> bool:
        return any(ln.exited_at is not None for ln in self._watched.values()) or bool(
            self._vanished_ranks()
        )

    @property
    def _watched(self) -> dict:
        """Ranks whose launcher sees their process end (a local handle, a wait over ssh)."""
        return {**self.gen.ssh, **self.gen.launchers}

    def dead_ranks(self) -> set[int]:
        """Ranks whose process has ended, or that the controller lost. (Any thread: the
        debugger's control thread asks too, so the table is copied in one step.)"""
        ended = {r for r, ln in list(self._watched.items()) if ln.exited_at is not None}
        return ended | set(self._vanished_ranks())

    def local_ranks(self) -> set[int]:
        """Ranks with a process on this machine that the notebook started."""
        return set(self.gen.launchers)

    def _vanished_ranks(self) -> dict[int, float]:
        """Ranks with no process handle here (other hosts, mpiexec, srun) that the controller
        lost: their engine missed its heartbeats and was unregistered. (A rank over ssh is
        watched by its wait on the host too; a host cut off answers neither.)"""
        gen = self.gen
        unwatched = [r for r in gen.ranks if r.rank not in gen.launchers and r.rank not in gen.ssh]
        far = unwatched + [
            r for r in gen.ranks if r.rank in gen.ssh and gen.ssh[r.rank].exited_at is None
        ]
        if self.client is None or not far:  # (every poll of every cell comes here)
            return gen.vanished
        registered = set(self.client.ids)
        for r in far:
            if r.engine_id not in registered:
                gen.vanished.setdefault(r.rank, time.monotonic())
        # mpiexec ends every rank when one fails: all of them are gone with it
        whole = self.cluster.launcher_process() if self.cluster is not None else None
        if whole is not None and processes.exited(whole.process):
            for r in unwatched:
                gen.vanished.setdefault(r.rank, time.monotonic())
        return gen.vanished

    def _deaths(self) -> list[Death]:
        """Ranks whose processes ended while the cluster runs, first to die first."""
        self.collect_late()  # (what a rank's threads printed last belongs in its log)
        gone = [ln for ln in self._watched.values() if ln.exited_at is not None]
        deaths = [
            Death(
                ln.rank,
                self.ranks[ln.rank].pid,
                ln.exit_code,
                ln.exited_at,
                last_lines(self.cluster.output_of(ln.rank)),
                self._crash_stack(ln) if ln.rank in self.gen.launchers else None,
                host=self.ranks[ln.rank].host,
                cause=self._cause(ln),
            )
            for ln in gone
        ]
        culprit = None
        ended = {d.rank for d in deaths}
        for rank, at in self._vanished_ranks().items():
            if rank in ended:
                continue
            row = self.ranks[rank]
            output = self.cluster.output_of(rank) if self.cluster is not None else ""
            death = Death(
                rank, row.pid, None, at, last_lines(output), host=row.host,
                cause=(
                    "it stopped answering (its host, or the network to it, may be down)"
                    if rank in self.gen.ssh
                    else "it stopped answering the controller's heartbeat"
                ),
            )
            culprit = culprit or remote.mpi_culprit(output)
            if culprit and culprit[0] == row.pid:
                # mpiexec kills every rank when one dies, and names the first end it saw:
                # almost always the rank that died, but not always. Say whose word it is.
                code = culprit[1]
                if code is None:
                    how = "an error"
                elif code >= 0:
                    how = f"exit code {code}"
                else:
                    how = signal.Signals(-code).name if -code in signal.valid_signals() else (
                        f"signal {-code}"
                    )
                death.cause, death.at = f"mpiexec says it ended by {how}", at - 1.0
            deaths.append(death)
        deaths.sort(key=lambda d: d.at)
        for d in deaths:  # (every line it printed stays there until the next %spmd start)
            path = self.logs.path(d.rank)
            d.log = path if path is not None and os.path.exists(path) else ""
        return deaths

    def _cause(self, launcher) -> str:
        """What is known of why a rank's process ended, beyond its exit code."""
        if getattr(launcher, "lost", False):
            return "its host stopped answering"
        if isinstance(launcher, (ForkedEngineLauncher, ForkedSSHEngineLauncher)) and (
            self._server is not None and launcher.exit_code is None
        ):
            server = launcher.server
            if server.ended_how():
                # (over ssh, how its ssh command ended: a server killed on its host makes
                # ssh end with 255, as a dropped connection would)
                on = f" on {launcher.location}" if hasattr(launcher, "location") else ""
                return (
                    f"its rank server (pid {server.pid}{on}) ended: "
                    f"{with_hint(server.ended_how())}; every rank it forked ended with it"
                )
        return "its process ended"

    def _crash_stack(self, launcher: RankedEngineLauncher) -> where.Stack | None:
        """Where a rank was when it crashed, from faulthandler's dump in its stack file."""
        try:
            with open(launcher.stack_file, errors="replace") as f:
                text = f.read()
        except OSError:
            return None
        at = text.rfind("Fatal Python error")
        if at < 0:
            return None
        frames = where.parse_dump(text[at:], self.ranks[launcher.rank].main_thread)
        return self._stack(launcher.rank, frames) if frames else None

    def _stack(self, rank: int, frames: list[where.Frame]) -> where.Stack:
        """A rank's frames from the cell on, with the lines of the cells this session sent."""
        return where.Stack(rank, where.with_sources(where.from_cell_on(frames), self._cells))

    def notice_deaths(self) -> None:
        """If a rank died since the last look, stop the others and say so from now on."""
        with self._life:
            if self.cluster is not None and self.gen.death is None and self._any_death():
                self._end_after_death(self._deaths())

    def check_alive(self) -> None:
        """Raise OutOfStep if a rank died (now, or earlier) and the cluster is stopped."""
        self.notice_deaths()
        if self.death is not None:
            raise OutOfStep(self.out_of_step)

    def _end_after_death(self, deaths: list[Death]) -> None:
        """The ranks end (their report is made); the generation keeps the death."""
        first = deaths[0]
        with self._life, interrupts.held("the stop after a death"):
            self.gen.death = first
            self.gen.out_of_step = (
                f"rank {first.rank} died ({first.how}) and the cluster was stopped: "
                "%spmd restart starts a fresh one."
            )
            for d in deaths:
                self.ranks[d.rank].state = "died"
                far = self.gen.ssh.get(d.rank)
                if (
                    far is not None and d.exit_code is None and far.exited_at is None
                    and not isinstance(far, ForkedSSHEngineLauncher)  # (its server knows)
                ):
                    # it stopped answering the controller, and its host's wait saw no end:
                    # the host is cut off, and the stop sends it no command (each would
                    # wait for ssh's connect timeout)
                    far.lost = True
            if self._server is not None:
                # the controller and the rank server stay, for a fast restart
                self._end_ranks()
            else:
                self.stop(keep_cache=True)

    def _end_far_ranks(self) -> None:
        """Ranks with no process handle here end at once on their control channel; the
        launcher's own stop (over ssh, mpiexec or scancel) then only confirms it."""
        engine_ids = [
            r.engine_id
            for r in self.ranks
            if r.rank not in self.gen.launchers and r.state not in ("died", "stopped")
        ]
        launchers = {
            self.ranks[rank].engine_id: ln for rank, ln in self.cluster.ssh_launchers().items()
            if rank < len(self.ranks)
        }
        if not engine_ids or self.client is None:
            return
        ended = control.signal(self.client, engine_ids, signal.SIGTERM, timeout=0.5)
        for engine_id, launcher in launchers.items():
            launcher.ended_by_control = engine_id in ended

    def _end_ranks(self) -> None:
        """End the ranks' engines (and what their cells started), keeping the rest."""
        cluster = self.cluster
        started_in_ranks = processes.started_by_ranks(cluster)
        self._end_far_ranks()
        if cluster.rank_set in cluster.engines:
            cluster._in_thread(cluster.stop_engines, cluster.rank_set)
        processes.end(started_in_ranks)
        self.gen = self.gen.ended()

