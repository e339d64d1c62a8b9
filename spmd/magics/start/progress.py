"""How a start goes, while it goes: engines registered, then ranks joined, and where the
coordinator listens.

In a kernel it is an ipywidget (a bar and a line), which a front end that renders widgets
shows moving; the display's text form says the same in one line, and its last form, kept in
a saved notebook, is the start's timeline. In terminal IPython it is one line rewritten in
place, and erased at the end, where the start's summary takes its place.
"""

from __future__ import annotations

import sys
import time

from IPython.display import display


def _in_kernel() -> bool:
    from IPython import get_ipython

    shell = get_ipython()
    return getattr(shell, "kernel", None) is not None


class StartProgress:
    """Give ``update`` as a Session's ``progress``; ``done`` when the start has ended."""

    def __init__(self, n: int, backend: str) -> None:
        self.n = n
        self.backend = backend
        self.started = time.monotonic()
        self.stage = ""
        self.times: dict[str, float] = {}  # stage: seconds from the start until it was full
        self.coordinator = ""
        self._widget = None
        self._handle = None
        self._line = ""
        if _in_kernel():
            import ipywidgets

            self._bar = ipywidgets.IntProgress(value=0, min=0, max=2 * n, bar_style="info")
            self._label = ipywidgets.Label(self.line())
            self._widget = ipywidgets.HBox([self._bar, self._label])
            self._handle = display(self._bundle(), raw=True, display_id=True)
        else:
            self._write(self.line())

    def line(self, registered: int = 0, joined: int = 0) -> str:
        parts = [f"Starting {self.n} processes ({self.backend}): {registered}/{self.n} engines registered"]
        if self.stage == "joined":
            parts.append(f"{joined}/{self.n} ranks joined")
        if self.coordinator:
            parts.append(f"coordinator {self.coordinator}")
        return ", ".join(parts)

    def update(self, stage: str, done: int, of: int, coordinator: str) -> None:
        self.coordinator = coordinator
        first = stage != self.stage
        self.stage = stage
        registered, joined = (done, 0) if stage == "registered" else (of, done)
        if done == of:
            self.times.setdefault(stage, time.monotonic() - self.started)
        line = self.line(registered, joined)
        if self._widget is not None:
            self._bar.value = registered + joined
            self._label.value = line
            if first:  # (the text form once per stage: each update re-renders the view)
                self._handle.update(self._bundle(), raw=True)
        else:
            self._write(line)

    def _bundle(self) -> dict:
        data = self._widget._repr_mimebundle_()
        data["text/plain"] = self._label.value
        return data

    def done(self, ok: bool) -> None:
        """Replace the bar with the start's timeline (or nothing, if it failed: the error
        says why)."""
        steps = [f"{what} in {self.times[stage]:.1f} s" for stage, what in (
            ("registered", f"{self.n} engines registered"),
            ("joined", f"{self.n} ranks joined"),
        ) if stage in self.times]
        if self.coordinator and ok:
            steps.append(f"coordinator {self.coordinator}")
        text = "; ".join(steps) if ok and steps else "The start failed: the error below says why."
        if self._widget is not None:
            self._handle.update({"text/plain": text}, raw=True)
            self._widget.close()
        else:  # (the summary line that follows says it)
            self._write("")
            sys.stdout.write("\r")

    def _write(self, text: str, end: str = "") -> None:
        pad = max(0, len(self._line) - len(text))
        sys.stdout.write("\r" + text + " " * pad + end)
        sys.stdout.flush()
        self._line = text
