"""The notebooks as the site's build ran them, kept for the tests: each runs once per CI run.

`make docs` runs every notebook in notebooks/ (myst-nb writes each, with its outputs, under
docs/_build/jupyter_execute/tutorials/). When the build ends without an error, ``STAMP``
there records a digest of what each notebook's outputs came from: the notebook, jupyter-spmd's
code, the Python that ran it. tests/test_notebooks.py reads a notebook's executed copy only
where the digest is the one the checkout has now; a changed line of code or of the notebook
(or a build that failed, or ran nothing: ``SPMD_DOCS_EXECUTE=off``) sends the test back to
running the notebook itself.

Threads: the build's main thread only (its config-inited, source-read and build-finished
events).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "docs" / "_build" / "jupyter_execute" / "tutorials"
STAMP = EXECUTED / "sources.json"


def digest(notebook: Path) -> str:
    """What ``notebook``'s outputs depend on, here: its own text, every file of the package,
    the interpreter and the versions of what is installed beside it (a new jax is a new
    digest)."""
    from importlib import metadata

    h = hashlib.sha256()
    h.update(sys.executable.encode())
    h.update(" ".join(sorted(f"{d.metadata['Name']}=={d.version}"
                             for d in metadata.distributions())).encode())
    h.update(notebook.read_bytes())
    for path in sorted((ROOT / "spmd").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def executed_copy(name: str):
    """The notebook ``name`` (notebooks/<name>.ipynb) as the site's build ran it, read with
    nbformat; None where that build is not of this checkout's sources."""
    import nbformat

    copy = EXECUTED / f"{name}.ipynb"
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None
    if not copy.exists() or stamp.get(name) != digest(NOTEBOOKS / f"{name}.ipynb"):
        return None
    return nbformat.read(str(copy), as_version=4)


_taken: dict[str, str] = {}  # the digests as the build began (a file changed during it is new)
_read: set[str] = set()  # the notebooks this build read: their copies are this build's
_ran = False  # whether this build runs the notebooks it reads (not SPMD_DOCS_EXECUTE=off)


def _stamp() -> dict:
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(stamp: dict) -> None:
    if stamp:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        STAMP.write_text(json.dumps(stamp, indent=1, sort_keys=True))
    else:
        STAMP.unlink(missing_ok=True)


def _config_inited(app, config) -> None:
    global _ran
    _taken.clear()
    _read.clear()
    _ran = config.nb_execution_mode == "force"  # (cache or auto may run none of them)
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        if not notebook.name.endswith(".executed.ipynb"):
            _taken[notebook.stem] = digest(notebook)


def _source_read(app, docname: str, source: list) -> None:
    """A notebook read is about to be run and its copy written again: its entry goes now,
    so a build that stops half-way (^C, killed) leaves no entry for a copy it changed."""
    folder, _, name = docname.rpartition("/")
    if folder == "tutorials" and name in _taken:
        _read.add(name)
        stamp = _stamp()
        if stamp.pop(name, None) is not None:
            _write_stamp(stamp)


def _build_finished(app, exception) -> None:
    """Record the digests of the notebooks this build ran (those it did not read keep what
    the build that ran them recorded); a build that failed, or ran nothing, records none."""
    stamp = _stamp()
    for name in _read:
        stamp.pop(name, None)
    if exception is None and _ran:
        stamp.update({name: _taken[name] for name in _read})
    _write_stamp(stamp)


def _keep_outputs_whole() -> None:
    """myst-nb merges a cell's stream outputs for the page (nb_merge_streams) in place: the
    notebook it then writes has the first output holding every line, the others still after
    it, and carriage returns gone. Merged here on copies, so the written notebook is the one
    the kernel produced, as the tests read it."""
    import copy

    from myst_nb.core import render

    merge = render.coalesce_streams
    if getattr(merge, "on_copies", False):
        return

    def coalesce_streams(outputs):
        return merge(copy.deepcopy(outputs))

    coalesce_streams.on_copies = True
    render.coalesce_streams = coalesce_streams


def setup(app):
    _keep_outputs_whole()
    app.connect("config-inited", _config_inited)
    app.connect("source-read", _source_read)
    app.connect("build-finished", _build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
