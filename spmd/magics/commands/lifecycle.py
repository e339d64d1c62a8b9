"""The cluster's life from the notebook: ``%spmd start``, ``stop`` and ``restart``, and the
SPMD kernel's own start, begun in the background and taken by the first cell that needs it."""

from __future__ import annotations

import dataclasses
import sys
import time

from IPython.core.error import UsageError

from spmd.cluster import interrupts, linger
from spmd.cluster.session import RankLogs, Session, Settings, StartError
from spmd.magics.commands.say import say
from spmd.magics.start import away
from spmd.magics.start.arguments import start_settings
from spmd.magics.start.background import BackgroundStart, attached_line
from spmd.magics.start.progress import StartProgress
from spmd.magics.start.status import summary


class Lifecycle:
    """SpmdMagics' life commands (a mixin: the state is SpmdMagics', see magics.py)."""

    def start_in_background(
        self, settings: Settings, started: BackgroundStart | None = None, refused: str = ""
    ) -> None:
        """Start the kernel's cluster on a thread (or take one ``started`` already); the
        first use of the cluster waits for it. ``refused``: why its options cannot be used
        (nothing starts; the first cell says so)."""
        self.always_on = self.auto.on = True
        self.pending = started or BackgroundStart(
            settings, refused=refused, attach_to=None if refused else linger.mine())

    def _take_pending(self) -> str:
        """Wait for the kernel's cluster (one progress line) and make it this notebook's;
        the line shown, if one was."""
        pending = self.pending
        if pending is None:
            return ""
        s = pending.settings
        # (an interrupt while waiting leaves the start pending, for the next cell to take)
        shown = pending.wait(
            "Attaching to this notebook's cluster..." if pending.attaching
            else f"Starting the kernel's {s.n} processes ({s.backend})...")
        # (session first: a shutdown on the control thread looks at pending, then session)
        self.session = pending.session
        self.pending = None
        if pending.attached:  # (the kernel before this one died; its cluster lingered)
            if shown != pending.attached:
                say(pending.attached)
            if pending.error is None and pending.attached.startswith("Attached"):
                for line in away.what_happened(pending.session):
                    say(line)
        if pending.error is not None:
            again = "" if pending.refused else " (%spmd restart tries again)"
            raise UsageError(f"{pending.error}{again}")
        # (the kernel's own cluster, which a first %spmd start with other settings replaces;
        # never one it attached to: that one holds what the ranks kept)
        self._fresh = not pending.attached.startswith("Attached")
        return shown


    def _cmd_start(self, args: list[str]) -> None:
        opts, settings = start_settings(args)
        kernels = self.pending.settings if self.pending is not None else (
            self.session.settings if self._fresh and self.session is not None else None)
        if opts.linger is None and kernels is not None:  # (the kernel's own, unless asked)
            settings = dataclasses.replace(settings, linger=kernels.linger)
        taken = self._kernel_cluster_is(settings)
        if taken is not None:
            self._show_as(opts)
            if not taken:  # (the wait's own line became the summary: never say it twice)
                say(summary(self.session))
            return
        if self.session is not None and self.session.running:
            raise UsageError(
                f"A cluster of {self.session.settings.n} processes is already running: "
                "use %spmd stop or %spmd restart first."
            )
        _refuse_beside_lingering()
        if self.session is not None:
            self.session.stop()  # (after a death, its controller and rank server)
            self.session.logs.remove()  # (kept until now: a dead rank's lines matter)
        _warn_if_notebook_joined_jax()
        if opts.linger is not None and opts.linger > 0 and opts.linger_refused:
            say(f"Note: --linger: {opts.linger_refused}; this cluster ends with the notebook's "
                "process.", file=sys.stderr)
        self._start(settings)
        self._show_as(opts)

    def _cmd_attach(self, args: list[str]) -> None:
        if len(args) > 1:
            raise UsageError("%spmd attach takes one cluster id at most, like %spmd attach "
                             "3f2a9c1e (python -m spmd list shows them).")
        if self.pending is not None:  # the SPMD kernel's own cluster, not used yet
            if self.pending.attaching:  # (it attaches to this notebook's: taken, never ended)
                self._take_pending()
                if not args:
                    return
            else:
                with interrupts.held("the cancel of the kernel's own start"):
                    self.pending.cancel()
                    self.pending = None
        if self.session is not None and self.session.running:
            raise UsageError("This notebook already has a cluster: %spmd stop it first, then "
                             "%spmd attach.")
        try:
            record = linger.choose(args[0] if args else "")
            t0 = time.perf_counter()
            session = Session(record.the_settings()).attach(record)
        except linger.AttachError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:  # (attach.attach put the owner files back: it lingers on)
            raise UsageError("Interrupted: the attach was given up and the cluster lingers on "
                             "as it was; %spmd attach tries again.") from None
        if self.session is not None:
            self.session.stop()  # (a stopped one's controller, after a death)
        self.session, self._fresh = session, False
        self.auto.on = True
        say(attached_line(record, time.perf_counter() - t0))
        for line in away.what_happened(session):
            say(line)

    def _show_as(self, opts) -> None:
        """How cells show from now on, as the start that was taken asked."""
        self.panel, self.tabs, self.breakpoints = opts.panel, opts.tabs, opts.breakpoint

    def _kernel_cluster_is(self, settings: Settings) -> str | None:
        """Whether the kernel's own, still unused cluster is the one asked for: the line its
        wait showed ('' if none) when it is, None when not. If it is not, it is cancelled or
        stopped, so that the one asked for starts instead (never two)."""
        shown = ""
        if self.pending is not None:
            if self.pending.settings == settings or self.pending.attaching:
                # (an attach is taken whatever: %spmd start then refuses)
                shown = self._take_pending()
            else:
                with interrupts.held("the cancel of the kernel's own start"):
                    self.pending.cancel()
                    self.pending = None
        if self._fresh and self.session is not None:
            self._fresh = False
            if self.session.running and self.session.settings == settings:
                return shown
            self.session.stop()
            self.session.logs.remove()
            self.session = None
        return None

    def _start(
        self, settings: Settings, cache_dir: str | None = None, logs: RankLogs | None = None
    ) -> None:
        if not settings.curve and settings.where.leaves_machine:
            say(
                "Warning: --no-curve: messages to and from the other hosts are signed but "
                "not encrypted.",
                file=sys.stderr,
            )
        # (a restart's compilation cache: compiled cells stay compiled; and its logs go on)
        progress = StartProgress(settings.n, settings.backend)
        session = Session(settings, cache_dir=cache_dir, logs=logs, progress=progress.update)
        progress.started = time.monotonic()  # (the same clock as the summary's seconds)
        # An interrupt may cancel the engines' start and join (the start then ends what it
        # began); once they have joined, the cluster is recorded here whatever comes.
        with interrupts.held("the end of the start"):
            self._refuse_if_shutting_down()
            self.starting = session  # (so that a shutdown from the control thread finds it)
            try:
                with interrupts.interruptible():
                    session.start()
            except BaseException as exc:
                self.starting = None
                progress.done(ok=False)
                # (a start interrupted right at its end still runs: stop is safe twice)
                session.stop()
                if isinstance(exc, StartError):
                    raise UsageError(str(exc)) from None
                if isinstance(exc, KeyboardInterrupt):  # (one sentence, not its traceback)
                    raise UsageError(
                        "Interrupted: the start was given up and nothing runs now; run "
                        "%spmd start again to start the cluster.") from None
                raise
            # (session first: a shutdown on the control thread looks at starting, then session)
            self.session = session
            self.starting = None
            if self._shutting_down:  # it came while the start ran: this cluster goes too
                session.shutdown()
                self._refuse_if_shutting_down()
            progress.done(ok=True)
            self.auto.on = True
            say(summary(session))

    def _cmd_stop(self, args: list[str]) -> None:
        self._no_args("stop", args)
        session = self._require_session(allow_stopped=bool(self.session and self.session.death))
        with interrupts.held("the stop"):
            self.auto.on = self.always_on
            after = (
                "auto mode is off." if not self.always_on else "%spmd restart starts them again."
            )
            if not session.running:  # stopped already, after a rank died
                session.stop()  # (its rank server and controller, where they were kept)
                say(
                    f"The cluster was already stopped after rank {session.death.rank} died; "
                    f"{after}"
                )
                return
            t0 = time.perf_counter()
            session.stop()
            say(
                f"Stopped {session.settings.n} processes in {time.perf_counter() - t0:.2f} s; "
                f"{after}"
            )

    def _cmd_restart(self, args: list[str]) -> None:
        self._no_args("restart", args)
        session = self._require_session(allow_stopped=True)
        # (the wait for the new ranks to register can be interrupted; before it, not)
        with interrupts.held("the restart"):
            try:
                forked = session.record().cluster is not None and session.restart()
            except StartError as exc:
                raise UsageError(str(exc)) from None
            except KeyboardInterrupt:  # (it came while the new ranks joined: all stopped)
                raise UsageError(
                    "Interrupted: the restart was given up while the new ranks joined, and "
                    "no rank runs now; %spmd restart starts them afresh.") from None
            finally:
                left_out, session.env_left_out = session.env_left_out, ""
                if left_out:
                    say(left_out)
            if forked:
                self.auto.on = True
                say(summary(session, restarted=True))
                return
            if session.afresh_because:
                say(f"The ranks start afresh, with a new rank server: "
                    f"{session.afresh_because}.")
            session.stop(keep_cache=True)
        self._start(session.settings, cache_dir=session.record().cache_dir, logs=session.logs)

    def shutdown(self) -> None:
        """Stop whatever this notebook started, from any thread (ipykernel's control thread
        at a shutdown request): a start under way is cancelled, a cell's wait ends, and the
        stop runs once the main thread has let go. No start begins after it."""
        self._shutting_down = True
        # (read once: the main thread may take the start, and set pending to None, meanwhile)
        pending = self.pending
        if pending is not None:
            pending.cancel()
        for session in (self.starting, self.session):
            if session is not None:
                session.shutdown()


    def _refuse_if_shutting_down(self) -> None:
        if self._shutting_down:
            raise UsageError("The kernel is shutting down: no cluster starts now.")


def _refuse_beside_lingering() -> None:
    """A start where this notebook's cluster lingers would run a second one beside it."""
    notebook = linger.this_notebook()
    if not notebook:
        return
    for record in linger.lingering():
        if record.notebook == notebook:
            raise UsageError(
                f"This notebook's cluster {record.id} ({record.n()} ranks) still runs since "
                f"its notebook process ended: %spmd attach takes it back (python -m spmd stop "
                f"{record.id} ends it).")


def _warn_if_notebook_joined_jax() -> None:
    """The notebook must not be a member of the job: a failing rank would abort it."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        say(
            "Warning: jax has initialized its backends in this notebook process. The notebook "
            "does not join the job (only the ranks do), so run jax code on the ranks.",
            file=sys.stderr,
        )


