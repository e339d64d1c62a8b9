"""Auto mode: every cell runs on all ranks, through a public IPython hook.

An input transformer (``shell.input_transformers_cleanup``) rewrites a cell into a call of the
``%%spmd`` cell magic. It runs before IPython's own escapes (``%``, ``!``) are translated, so
the engines receive the cell exactly as the user wrote it and run its magics themselves.
"""

from __future__ import annotations

from contextlib import contextmanager

# Cells that begin with one of these stay in the notebook.
_LOCAL_PREFIXES = ("%spmd", "%%spmd", "%%local")

# A cell that is only one of these ends the notebook's kernel, as in every Jupyter kernel
# (IPython asks the front end to shut it down, and the shutdown stops the cluster): on the
# ranks it would end each rank's engine instead.
EXITS = ("exit", "quit", "exit()", "quit()")

# A cell that is only this loads what auto mode comes from: the extension is loaded already, so
# it does nothing, as a first %load_ext does (the SPMD kernel runs the notebooks written for a
# plain kernel as written; on the ranks it would take the kernel's own start, and a first
# %spmd start with other settings would then be refused).
LOAD = "%load_ext spmd"


def is_exit(code: str) -> bool:
    return code.strip() in EXITS


def stays_local(lines: list[str]) -> bool:
    first = next((ln.lstrip() for ln in lines if ln.strip()), "")
    return not first or first.startswith(_LOCAL_PREFIXES) or is_exit("".join(lines))


class AutoMode:
    """The transformer, and the switch that turns it on and off."""

    def __init__(self, shell) -> None:
        self.shell = shell
        self.on = False
        self._paused = 0

    def install(self) -> None:
        if self.transform not in self.shell.input_transformers_cleanup:
            self.shell.input_transformers_cleanup.append(self.transform)

    def uninstall(self) -> None:
        if self.transform in self.shell.input_transformers_cleanup:
            self.shell.input_transformers_cleanup.remove(self.transform)

    @contextmanager
    def paused(self):
        """Leave cells alone inside this block (``%%local`` compiles its cell here)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def transform(self, lines: list[str]) -> list[str]:
        if not self.on or self._paused or stays_local(lines):
            return lines
        if "".join(lines).strip() == LOAD:
            return []
        cell = "".join(lines)
        return [f"get_ipython().run_cell_magic('spmd', '', {cell!r})\n"]
