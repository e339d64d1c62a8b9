"""The wheel's build hooks: the SPMD kernel's spec, shipped as the wheel's data files; and the
README as the package index shows it.

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

The README is the package's long description (pyproject.toml's ``dynamic``). Its links to the
docs' pages are relative to the checkout, which a repository host resolves and a package index
does not: there each becomes its text with the page's path in the source, and a screenshot its
words (``pypi_readme``).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface


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


class ReadmeHook(MetadataHookInterface):
    PLUGIN_NAME = "custom"

    def update(self, metadata: dict) -> None:
        text = Path(self.root, "README.md").read_text(encoding="utf-8")
        metadata["readme"] = {"content-type": "text/markdown", "text": pypi_readme(text)}


_IMAGE = re.compile(r"!\[([^\]]*)\]\((?!https?:)([^)]+)\)")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((?!https?:|#)([^)]+)\)")


def pypi_readme(text: str) -> str:
    """The README with its relative links as text: ``[Install](docs/x.md)`` becomes
    ``Install (`docs/x.md` in the source)``, and a relative image its alt text in italics."""
    text = _IMAGE.sub(lambda m: f"*{m.group(1)}*", text)
    return _LINK.sub(lambda m: f"{m.group(1)} (`{m.group(2)}` in the source)", text)
