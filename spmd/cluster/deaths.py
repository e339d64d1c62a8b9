"""The death watch: which ranks ended or vanished, and what is known of how.

A part of the face (session.py), given what it needs: the launch (its client and cluster),
the ranks' logs, the text of recent cells (a crash's stack shows their lines), and the
face's ``collect_late``; each question names the generation it is about (the caller reads the
face's once: start, restart and stop replace it). It keeps no state of its own beyond the
generation's ``vanished`` table: it reads the generation and what the launch runs, on
whichever thread asks (cells' waits and reports on the main thread; the debugger's control thread asks
``dead_ranks``, which copies the watched table in one step). Ending the others after a death
is Session's (it changes the cluster's life).
"""

from __future__ import annotations

import os
import time

from spmd.cluster.launchers import processes, remote
from spmd.cluster.launchers.forks import ForkedEngineLauncher, ForkedSSHEngineLauncher
from spmd.cluster.launchers.launch import RankedEngineLauncher
from spmd.cluster.lockstep import where
from spmd.cluster.lockstep.logs import last_lines
from spmd.cluster.records import Death
from spmd.words import with_hint


class DeathWatch:
    """Which ranks died (see the module's opening comment)."""

    def __init__(self, launch, logs, sources, collect_late) -> None:
        self.launch, self.logs = launch, logs
        self._sources, self._collect_late = sources, collect_late

    def any(self, gen) -> bool:
        """Whether a rank of ``gen`` has ended or vanished (every poll of every cell asks)."""
        return any(ln.exited_at is not None for ln in _watched(gen).values()) or bool(
            self._vanished(gen)
        )

    def dead_ranks(self, gen) -> set[int]:
        """Ranks whose process has ended, or that the controller lost. (Any thread: the
        debugger's control thread asks too, so the table is copied in one step.)"""
        ended = {r for r, ln in list(_watched(gen).items()) if ln.exited_at is not None}
        return ended | set(self._vanished(gen))

    def _vanished(self, gen) -> dict[int, float]:
        """Ranks with no process handle here (other hosts, mpiexec, srun) that the controller
        lost: their engine missed its heartbeats and was unregistered. (A rank over ssh is
        watched by its wait on the host too; a host cut off answers neither.)"""
        running = self.launch
        unwatched = [r for r in gen.ranks if r.rank not in gen.launchers and r.rank not in gen.ssh]
        far = unwatched + [
            r for r in gen.ranks if r.rank in gen.ssh and gen.ssh[r.rank].exited_at is None
        ]
        if running.client is None or not far:  # (every poll of every cell comes here)
            return gen.vanished
        registered = set(running.client.ids)
        for r in far:
            if r.engine_id not in registered:
                gen.vanished.setdefault(r.rank, time.monotonic())
        # mpiexec ends every rank when one fails: all of them are gone with it
        whole = running.cluster.launcher_process() if running.cluster is not None else None
        if whole is not None and processes.exited(whole.process):
            for r in unwatched:
                gen.vanished.setdefault(r.rank, time.monotonic())
        return gen.vanished

    def deaths(self, gen) -> list[Death]:
        """Ranks of ``gen`` whose processes ended while the cluster runs, first to die first."""
        self._collect_late()  # (what a rank's threads printed last belongs in its log)
        ranks, cluster = gen.ranks, self.launch.cluster
        gone = [ln for ln in _watched(gen).values() if ln.exited_at is not None]
        deaths = [
            Death(
                ln.rank,
                ranks[ln.rank].pid,
                ln.exit_code,
                ln.exited_at,
                last_lines(cluster.output_of(ln.rank)),
                self._crash_stack(gen, ln) if ln.rank in gen.launchers else None,
                host=ranks[ln.rank].host,
                cause=self._cause(ln),
            )
            for ln in gone
        ]
        culprit = None
        ended = {d.rank for d in deaths}
        for rank, at in self._vanished(gen).items():
            if rank in ended:
                continue
            row = ranks[rank]
            output = cluster.output_of(rank) if cluster is not None else ""
            death = Death(
                rank, row.pid, None, at, last_lines(output), host=row.host,
                cause=(
                    "it stopped answering (its host, or the network to it, may be down)"
                    if rank in gen.ssh
                    else "it stopped answering the controller's heartbeat"
                ),
            )
            culprit = culprit or remote.mpi_culprit(output)
            if culprit and culprit[0] == row.pid:
                # mpiexec kills every rank when one dies, and names the first end it saw:
                # almost always the rank that died, but not always. Say whose word it is.
                code = culprit[1]
                how = ("an error" if code is None
                       else processes.how_it_ended(code).removeprefix("killed by "))
                death.cause, death.at = f"mpiexec says it ended by {how}", at - 1.0
            deaths.append(death)
        deaths.sort(key=lambda d: d.at)
        for d in deaths:  # (every line it printed stays there until the next %spmd start)
            path = self.logs.path(d.rank)
            d.log = path if path is not None and os.path.exists(path) else ""
        return deaths

    def mark_lost(self, gen, death: Death) -> None:
        """A rank over ssh that stopped answering the controller, whose host's wait saw no
        end: the host is cut off, and the stop sends it no command (each would wait for
        ssh's connect timeout). (A forked one's rank server knows.)"""
        far = gen.ssh.get(death.rank)
        if (
            far is not None and death.exit_code is None and far.exited_at is None
            and not isinstance(far, ForkedSSHEngineLauncher)
        ):
            far.lost = True

    def _cause(self, launcher) -> str:
        """What is known of why a rank's process ended, beyond its exit code."""
        if getattr(launcher, "lost", False):
            return "its host stopped answering"
        if isinstance(launcher, (ForkedEngineLauncher, ForkedSSHEngineLauncher)) and (
            self.launch.rank_server is not None and launcher.exit_code is None
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

    def _crash_stack(self, gen, launcher: RankedEngineLauncher) -> where.Stack | None:
        """Where a rank was when it crashed, from faulthandler's dump in its stack file."""
        try:
            with open(launcher.stack_file, errors="replace") as f:
                text = f.read()
        except OSError:
            return None
        at = text.rfind("Fatal Python error")
        if at < 0:
            return None
        frames = where.parse_dump(text[at:], gen.ranks[launcher.rank].main_thread)
        return where.cell_stack(launcher.rank, frames, self._sources) if frames else None


def _watched(gen) -> dict:
    """Ranks whose launcher sees their process end (a local handle, a wait over ssh)."""
    return {**gen.ssh, **gen.launchers}
