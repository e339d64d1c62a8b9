"""reference/internals: every private part of another project that jupyter-spmd uses, from
``spmd.internals.INTERNALS`` (the list each side checks when it starts), with the versions
this site was built against and the bounds pyproject.toml puts on each project."""

from __future__ import annotations

import importlib.metadata
import re
from collections import defaultdict

from spmd_docs.tables import Drift, table

_SIDES = {"notebook": "in the notebook's process", "rank": "on every rank"}


def _bounds() -> dict[str, str]:
    """{project: its requirement, as pyproject.toml bounds it} (from the installed metadata)."""
    found = {}
    for requirement in importlib.metadata.requires("jupyter-spmd") or []:
        spec, _, marker = requirement.partition(";")
        project = re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0].lower()
        extra = re.search(r"extra == .(\w+).", marker)
        if extra and extra.group(1) != project:  # (the test extra's tools)
            continue
        found.setdefault(project, f"`{spec.strip()}`"
                         + (f" (the `{extra.group(1)}` extra)" if extra else ""))
    return found


def _version(project: str) -> str:
    try:
        return importlib.metadata.version(project)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _kind(item) -> str:
    if item.versions:  # (a workaround: looked for in those versions, where it is used)
        return f" ({item.project} {item.versions} only)"
    return "" if item.required else " (optional)"


def page() -> str:
    from spmd import internals

    by_project: dict[str, list] = defaultdict(list)
    for item in internals.INTERNALS:
        by_project[item.project].append(item)
    bounds = _bounds()
    out = [
        "# Internals of other projects",
        "",
        "Every private part of another project that jupyter-spmd calls, replaces or "
        "subclasses: the places a new release can break without a word. Generated when this "
        "site is built from `spmd/internals.py`, the list each side checks when it starts: "
        "the notebook before a cluster starts, every rank when its engine starts. A required "
        "one that is missing fails the start in one sentence that names it and the version "
        "installed; an optional one makes its feature step aside and say so where it is used.",
        "",
        f"{len(internals.INTERNALS)} parts of {len(by_project)} projects. This site was built "
        "with:",
        "",
        table(("project", "version", "pyproject.toml's bound"),
              [(p, _version(p), bounds.get(p.lower(), "(not a direct dependency)"))
               for p in by_project]),
        "",
    ]
    for project, items in by_project.items():
        out += [f"## {project}", ""]
        for side, where in _SIDES.items():
            used = [i for i in items if i.side == side]
            if used:
                out += [f"{where.capitalize()}:", ""]
                out += [f"- `{i.module}.{i.path}`{_kind(i)}: {i.why}" for i in used]
                out += [""]
        # a workaround of the project's fault: the program that shows it, once
        for fault in dict.fromkeys(i.fault for i in items if i.fault):
            parts = [f"`{i.module}.{i.path}`" for i in items if i.fault == fault]
            out += [f"### A fault of {project} worked around ({', '.join(parts)})", "",
                    fault, ""]
        unknown = sorted({i.side for i in items} - set(_SIDES))
        if unknown:
            raise Drift(f"spmd/internals.py names a side {', '.join(unknown)} that "
                        "docs/_ext/spmd_docs/internals.py does not know: add it to _SIDES.")
    return "\n".join(out)
