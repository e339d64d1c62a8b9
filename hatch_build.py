"""The wheel's build hook: the SPMD kernel's spec, shipped as the wheel's data files.

hatchling runs it for every wheel, editable ones too (pyproject.toml,
``[tool.hatch.build.targets.wheel.hooks.custom]``). It writes the spec that
``python -m spmd.kernel install`` writes with no options (its code, spmd/kernel/kernelspec.py:
the same name, display name, logos and settings), into share/jupyter/kernels/spmd of the
wheel's data, so that ``pip install jupyter-spmd`` puts the kernel in ``jupyter kernelspec
list`` and in JupyterLab's launcher at once, as ipykernel's wheel does with ``python3``.

Its argv starts with a bare ``python``, as ipykernel's does: Jupyter runs that as its own
interpreter, the one of the environment JupyterLab runs from and the wheel was installed into
(no path could be written at build: the build's interpreter may be a throwaway one, pip's or
uv's isolated build). ``python -m spmd.kernel install`` writes the full path of the Python it
runs: ``--sys-prefix`` writes over this one; a ``--user`` spec is found first by a Jupyter
of another environment, while one run from this environment finds this one first.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class KernelSpecHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        # the checkout's own spmd, whatever else is installed (only ipykernel is needed:
        # pyproject.toml's build requirements)
        sys.path.insert(0, self.root)
        try:
            from spmd.kernel.kernelspec import KERNEL_NAME, write_kernel_spec
        finally:
            sys.path.remove(self.root)
        self._folder = tempfile.mkdtemp(prefix="spmd-kernelspec-")
        spec = write_kernel_spec(Path(self._folder) / KERNEL_NAME, executable="python")
        build_data["shared_data"][str(spec)] = f"share/jupyter/kernels/{KERNEL_NAME}"

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)
