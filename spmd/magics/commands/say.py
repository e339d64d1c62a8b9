"""One line to the cell: how every magic speaks."""

from __future__ import annotations

import sys

NOT_RUNNING = "No SPMD cluster is running: start one with %spmd start -n 4."


def say(text: str, file=None) -> None:
    """One line (or lines) to the cell, in one write: ``print`` writes the text and its
    newline apart, and ipykernel may send them as two outputs (a lone "\\n" in the saved
    notebook) when its flush timer fires in between."""
    (file or sys.stdout).write(f"{text}\n")


