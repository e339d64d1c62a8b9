"""The build's two hooks: the SPMD kernel's spec, shipped as the wheel's data files, and the
long description made from README.md.

hatchling runs the first for every wheel, editable ones too (pyproject.toml,
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

The second, the metadata hook, makes the project's long description, which PyPI shows
(``[tool.hatch.metadata.hooks.custom]``, with ``readme`` dynamic): README.md, whose links to
the docs are relative, which a repository host follows but PyPI's page, with no checkout
beside it, cannot. There is no hosted site to point them at, so each becomes the page's path
in words: ``[Install](docs/getting-started/install.md)`` reads "Install
(docs/getting-started/install.md in the source)", and a relative image is its description, in
italics, and its path. Code blocks, and links with a scheme (``https:``) or to an anchor of the
page, stay as they are.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface

README = "README.md"
# a Markdown link or image whose target has no scheme and is not an anchor of the page itself
_RELATIVE = re.compile(r"(!?)\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:|#)([^()\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)", re.M)


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


def readme_for_an_index(text: str) -> str:
    """README.md's ``text`` as a package index shows it: each relative link or image, outside
    code blocks, as words that name its path in the source."""

    def words(m: re.Match) -> str:
        image, label, target = m.groups()
        if image:
            return f"*{label}* (an image, {target} in the source)" if label else ""
        return f"{label} ({target} in the source)"

    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[ \t]*$)", text, flags=re.M | re.S)
    return "".join(part if _FENCE.match(part) else _RELATIVE.sub(words, part)
                   for part in parts)


class ReadmeHook(MetadataHookInterface):
    PLUGIN_NAME = "custom"

    def update(self, metadata: dict) -> None:
        text = (Path(self.root) / README).read_text(encoding="utf-8")
        metadata["readme"] = {"content-type": "text/markdown",
                              "text": readme_for_an_index(text)}
