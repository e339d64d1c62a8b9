"""The SPMD kernel's cluster, started on a thread while the notebook opens.

The kernel starts its kernelspec's cluster as soon as it is up, so the first cell usually finds
it ready (or, where its notebook's cluster lingers after the kernel before it died, attaches to
that one, and the first cell says so); a cell that comes earlier waits for it, showing one progress line that becomes the
start's summary. A notebook whose first cell is ``%spmd start ...`` with other settings gets its
own cluster instead: the background start is cancelled and what it began is stopped, so there
are never two. A start cancelled while it attaches (the kernel shuts down) starts nothing
afterwards, even where the attach then fails: a cluster started then would linger after a
deliberate shutdown.
"""

from __future__ import annotations

import threading
import time

from IPython.display import display

from spmd.cluster import linger
from spmd.cluster.session import Session, Settings, StartError
from spmd.magics.start.status import summary


class BackgroundStart:
    """One ``Session.start`` running on a thread of its own."""

    def __init__(self, settings: Settings, refused: str = "",
                 attach_to: linger.Record | None = None) -> None:
        self.attach_to = None if refused else attach_to
        try:
            attached = self.attach_to.the_settings() if self.attach_to else settings
        except linger.AttachError:  # (another version's: the kernel starts its own)
            self.attach_to, attached = None, settings
        self.progress = ""  # how the start goes, in a few words (set on the start's thread)
        self.session = Session(attached, progress=self._tell)
        self.fresh_settings = settings  # (what starts where the attach fails)
        # Set by cancel (any thread); with _lock held, the start's thread makes no new
        # Session once it is set, and cancel cancels the Session there is.
        self._cancelled = False
        self._lock = threading.Lock()
        self.attached = ""  # the attach's line, once it attached ('' if it did not)
        self.error: StartError | None = None
        self._thread = threading.Thread(target=self._run, name="spmd-start", daemon=True)
        self.refused = bool(refused)
        if refused:  # (the kernelspec's options: nothing starts, the first cell says why)
            why = refused.removeprefix("%spmd start: ").rstrip(".")
            self.error = StartError(
                f"The kernel's cluster options cannot be used ({why}): %spmd start with other "
                "options starts a cluster here."
            )
        else:
            self._thread.start()

    def _run(self) -> None:
        if self.attach_to is not None:
            record, t0 = self.attach_to, time.perf_counter()
            try:
                self.session.attach(record)
            except Exception as exc:  # (it ended meanwhile: a new one starts)
                with self._lock:
                    if self._cancelled:  # (the kernel shuts down: nothing starts)
                        self.error = StartError("The kernel's cluster start was cancelled.")
                        return
                    self.attached = ("The notebook's earlier cluster could not be attached, "
                                     f"so a new one starts: {exc}")
                    self.session = Session(self.fresh_settings, progress=self._tell)
            else:
                self.attached = attached_line(record, time.perf_counter() - t0)
                return
        try:
            self.session.start()
        except StartError as exc:
            self.error = exc
        except Exception as exc:  # reported to the first cell, which is where a person looks
            self.error = StartError(
                f"The kernel's cluster did not start: {type(exc).__name__}: {exc}"
            )

    def _tell(self, stage: str, done: int, of: int, coordinator: str) -> None:
        what = "engines registered" if stage == "registered" else "ranks joined"
        self.progress = f"{done}/{of} {what}" + (f", coordinator {coordinator}" if coordinator else "")

    @property
    def settings(self) -> Settings:
        return self.session.settings

    @property
    def attaching(self) -> bool:
        return self.attach_to is not None

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, progress: str = "") -> str:
        """Wait until the start has ended, showing ``progress`` meanwhile if it has not; the
        line that progress became (the start's summary), or '' when none was shown."""
        handle = None
        if progress and not self.done:
            handle = display({"text/plain": progress}, raw=True, display_id=True)
        shown = ""
        while self._thread.is_alive():
            self._thread.join(0.1)  # a timeout, so that an interrupt gets through
            if handle is not None and self.progress != shown:
                shown = self.progress
                handle.update({"text/plain": f"{progress} {shown}"}, raw=True)
        if handle is None:
            return ""
        # (on an error the cell's own error says why)
        line = "The kernel's processes did not start." if self.error else (
            self.attached if self.attached.startswith("Attached") else summary(self.session))
        handle.update({"text/plain": line}, raw=True)
        return line

    def cancel(self) -> None:
        """Give the start up and end whatever it had started (an attach that fails after
        this starts no cluster)."""
        with self._lock:
            self._cancelled = True
            session = self.session
        session.cancel()
        while self._thread.is_alive():
            self._thread.join(0.1)
        self.session.stop()


def attached_line(record: linger.Record, seconds: float) -> str:
    """What ``%spmd attach`` (and the SPMD kernel's attach) says first."""
    since = time.strftime("%H:%M:%S", time.localtime(record.started))
    return (f"Attached to cluster {record.id} in {seconds:.2f} s: {record.n()} ranks "
            f"({record.backend()}), started at {since} by notebook process {record.pid}; they "
            "kept what they hold.")
