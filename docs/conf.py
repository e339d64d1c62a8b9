"""Sphinx configuration for jupyter-spmd's site: `make docs` builds it into docs/_build/html.

MyST pages, the notebooks rendered by myst-nb after they ran at build in their own kernels
(the SPMD kernel, or the magics in a plain Python kernel), and reference pages generated from
the code by the extension in _ext/spmd_docs. No network: nothing is fetched (no intersphinx).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # benchmarks/, whose table the benchmarks page shows

from spmd import __version__  # noqa: E402

project = "jupyter-spmd"
author = "the jupyter-spmd developers"
copyright = "the jupyter-spmd developers"
release = version = __version__

extensions = ["myst_nb", "spmd_docs"]

# The notebooks stay in notebooks/, where the tests and `make demo` read them; tutorials/
# holds a symbolic link to each (Sphinx reads only documents under docs/, and a link has no
# copy to fall behind or to clean up). Executed notebooks go to _build, never beside them.
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "**/*.executed.ipynb"]

# A measured figure in a hand-written page is plain text between two comments that name it,
# <!--fig:key-->0.653 s<!--/fig-->, checked against benchmarks/results.json at each build
# (_ext/spmd_docs/figures.py); one that differs, or a key it does not define, is a warning, so
# a failed build (-W). A link to another page is a Markdown link to its file,
# [Install](../getting-started/install.md), which a repository host follows as well (a
# tutorial's, to its link in tutorials/: _ext/spmd_docs/links.py).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- notebooks: run at every build -------------------------------------------------------
# SPMD_DOCS_EXECUTE=off builds the pages with the outputs saved in the notebooks (none):
# quick, for work on the pages; `make docs` runs them.
nb_execution_mode = os.environ.get("SPMD_DOCS_EXECUTE", "force")
nb_execution_timeout = 300  # per cell: a start of 4 ranks with jax on a busy 2-core machine
# A cell that raises fails the build, but for those tagged raises-exception (pitfalls.ipynb
# and 03-distributed-initialize.ipynb raise on purpose, as `make demo` shows them).
nb_execution_allow_errors = False
nb_execution_raise_on_error = True
nb_execution_show_tb = True
# Outputs as the notebook shows them; stderr carries the ranks' tracebacks and reports.
nb_output_stderr = "show"
nb_merge_streams = True  # each rank's lines of one stream in one block, as Jupyter shows them

# -- HTML ------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "jupyter-spmd"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 7,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"index": [], "changelog": [], "development/benchmarks": []}  # (room for its table)
html_show_sourcelink = False
html_static_path = ["_static"]
html_css_files = ["spmd.css"]
# Pages show the browser tests' screenshots (docs/screenshots/, which those tests write) by
# relative path: `![...](../screenshots/spmd-kernel.png)`; Sphinx copies each one it shows.
