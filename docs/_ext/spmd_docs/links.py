"""Markdown links to the tutorials, which are symbolic links to the notebooks in notebooks/
(conf.py says why).

The pages link to each other as Markdown links to their files
(``[the quickstart](../tutorials/quickstart.ipynb)``), which the site and a repository host
both follow. Sphinx resolves a link's path through symbolic links (``relfn2path``), so MyST
takes a link to a tutorial for one to ``notebooks/quickstart``, a file outside the site, and
warns that it knows no such document. Each such link gets back the document it names
(``tutorials/quickstart``) as its page is read, before MyST resolves it.
"""

from __future__ import annotations

from pathlib import Path


def _linked_documents(env) -> dict[str, str]:
    """The documents whose source is a symbolic link: the name MyST makes of the file it
    points to (its path without the suffix) -> the document's name."""
    linked = {}
    for docname in env.found_docs:
        source = Path(env.doc2path(docname))
        if source.is_symlink():
            linked[source.resolve().with_suffix("").as_posix()] = docname
    return linked


def _doctree_read(app, doctree) -> None:
    from sphinx import addnodes

    linked = None
    for node in doctree.findall(addnodes.pending_xref):
        if node.get("reftype") == "myst" and node.get("refdomain") == "doc":
            if linked is None:
                linked = _linked_documents(app.env)
            if node["reftarget"] in linked:
                node["reftarget"] = linked[node["reftarget"]]


def setup(app):
    app.connect("doctree-read", _doctree_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
