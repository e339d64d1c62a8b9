"""The package's shape: folders import downward only, no module imports itself back through
others, and folders, modules and classes stay small enough to read
(docs/development/layout.md); the last two, and a layout page that names every module,
hold for benchmarks/ too.

Read from the source with ``ast``: every import counts, also those inside a function (a lazy
import is still an arrow, and a circle through one is still a circle).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spmd"
BENCHMARKS = ROOT.parent / "benchmarks"  # (make bench: its parts, and run.py that runs them)

# Each layer may import from the layers after it in this list (and from itself), never from
# those before it: a folder's own modules sit above its subfolders, and each subfolder is one
# floor. engine/ runs inside every rank, with none of the notebook's code; the controller's
# process imports from engine/ only.
LAYERS = [
    ("spmd.agents", "for agents: the MCP server, a process of its own beside the kernels"),
    ("spmd.kernel", "the Jupyter kernel"),
    ("spmd.magics", "the notebook surface: %spmd's table of commands, %%spmd, %%local"),
    ("spmd.magics.commands", "the %spmd commands by what they do"),
    ("spmd.magics.export", "%spmd export: the cells as a job"),
    ("spmd.magics.start", "a cluster's start as the notebook shows it, its options"),
    ("spmd.magics.cells", "a %%spmd cell in the notebook"),
    ("spmd.magics.arrays", "arrays over several processes, in the notebook"),
    ("spmd.cluster", "the cluster's life"),
    ("spmd.cluster.lockstep", "cells in lockstep"),
    ("spmd.cluster.records", "the records that cross the cluster's face"),
    ("spmd.cluster.launchers", "how processes get started"),
    ("spmd.cluster.channel", "the notebook's channel to its ranks"),
    ("spmd.controller", "what runs in ipyparallel's controller process"),
    ("spmd.engine", "what runs inside every rank: its entry points and its kernel"),
    ("spmd.engine.shell", "a rank's shell"),
    ("spmd.engine.arrays", "a rank's part of arrays over several processes"),
    ("spmd.engine.watch", "what the notebook asks a rank while it watches"),
    ("spmd.engine.life", "a rank's process and its end"),
    ("spmd.engine.join", "a rank joining the job"),
]
# The shared top-level modules sit below every layer.
BELOW_ALL = ("spmd.picture", "spmd.options", "spmd.internals", "spmd.wire", "spmd.words",
             "spmd")

MODULES_PER_FOLDER = 20
MODULE_LINES = 500
CLASS_LINES = 300


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project's modules that ``name`` imports, anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _layer(name: str) -> int:
    """Index in LAYERS of the deepest layer ``name`` belongs to (len(LAYERS) below all)."""
    best = None
    for i, (prefix, _) in enumerate(LAYERS):
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(LAYERS[best][0]):
                best = i
    if best is None or any(name == b or name.startswith(b + ".") for b in BELOW_ALL[:-1]):
        return len(LAYERS)
    return best


def _graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module under ``root`` -> the modules under ``root`` it imports."""
    modules = _modules(root)
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph(ROOT)


def test_no_import_runs_back_up(graph):
    upward = []
    for name, targets in graph.items():
        # the package's entry points: %load_ext spmd loads the magics; python -m spmd lists
        # and stops clusters
        if name in ("spmd", "spmd.__main__"):
            continue
        for target in targets:
            if target in ("spmd",):  # the package's __init__ (version, the extension hook)
                continue
            if _layer(target) < _layer(name):
                upward.append(f"{name} -> {target}")
            if name.startswith("spmd.engine") and not target.startswith(
                ("spmd.engine", "spmd.internals", "spmd.picture", "spmd.wire")
            ):
                upward.append(f"{name} -> {target} (engine/ runs in the ranks)")
            if name.startswith("spmd.controller") and not target.startswith(
                ("spmd.controller", "spmd.engine", "spmd.internals", "spmd.wire")
            ):
                upward.append(f"{name} -> {target} (controller/ runs in the controller)")
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


# What the notebook's side (the magics, the kernel) may import of the cluster: its one face and
# the records that cross it, and three modules for what comes before a cluster or beside it.
FACE = {
    "spmd.cluster.session": "the face: the verbs, and what a cell's reader needs",
    "spmd.cluster.records": "the records that cross the face",
    "spmd.cluster.linger": "the lingering clusters on disk, which %spmd attach picks from",
    "spmd.cluster.launchers.remote": "the start options' hosts and launchers, checked first",
    "spmd.cluster.interrupts": "a SIGINT held through a magic's own report, as the cluster's",
}


def test_the_notebook_side_reaches_the_cluster_through_its_face(graph):
    crossing = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith(("spmd.magics", "spmd.kernel"))
        for target in targets
        if target.startswith("spmd.cluster") and target not in FACE
    )
    assert not crossing, "past the cluster's face (session.py, records.py):\n" + "\n".join(crossing)


def test_no_two_modules_share_a_name():
    """One name for each thing: a module's file name says what it holds, once in spmd/ (the
    entry points __main__.py and the packages' __init__.py aside)."""
    seen: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    assert not {n: p for n, p in seen.items() if len(p) > 1}, seen


def test_every_folder_is_a_floor():
    """Each folder under spmd/ is named in LAYERS, so its arrows are checked as its own floor's
    (a folder left out would pass as part of the one above it)."""
    folders = {".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")}
    named = {prefix for prefix, _ in LAYERS}
    assert folders - {"spmd"} <= named, sorted(folders - {"spmd"} - named)


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of imports in ``graph``, as "a -> b -> a"."""
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if target == "spmd" or name == "spmd":
                continue  # the package's own __init__ imports lazily, on load_ext
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_no_import_circle(graph):
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_import_circle_in_the_benchmarks():
    """A part (and its ``__main__`` block, where it has one) imports what it runs with from
    benchmarks/bench.py and table.py, never run.py, which imports the parts."""
    circles = _circles(_graph(BENCHMARKS))
    assert not circles, "import circles in benchmarks/:\n" + "\n".join(circles)


def _too_big(root: pathlib.Path) -> list[str]:
    """The modules under ``root`` over MODULE_LINES and the classes over CLASS_LINES."""
    too_big = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            too_big.append(f"{path.relative_to(root.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > CLASS_LINES:
                    too_big.append(f"{path.relative_to(root.parent)}: class {node.name}, "
                                   f"{size} lines")
    return too_big


@pytest.mark.parametrize("root", [ROOT, BENCHMARKS], ids=["spmd", "benchmarks"])
def test_modules_and_classes_stay_small(root):
    too_big = _too_big(root)
    assert not too_big, "over the size limits:\n" + "\n".join(too_big)


@pytest.mark.parametrize("root", [ROOT, BENCHMARKS], ids=["spmd", "benchmarks"])
def test_no_folder_holds_over_20_modules(root):
    """A folder a newcomer can read through: at most 20 modules (its ``__init__.py`` aside;
    its subfolders are counted in their own right)."""
    crowded = []
    for folder in sorted({p.parent for p in root.rglob("*.py")}):
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MODULES_PER_FOLDER:
            crowded.append(f"{folder.relative_to(ROOT.parent)}/: {len(modules)} modules")
    assert not crowded, (f"folders over {MODULES_PER_FOLDER} modules:\n" + "\n".join(crowded))


def test_the_layout_page_names_every_folder_and_module():
    """docs/development/layout.md names every module and folder under spmd/, and every module
    of benchmarks/ (as ``benchmarks/name.py`` or in its benchmarks/ entry)."""
    layout = (ROOT.parent / "docs" / "development" / "layout.md").read_text()
    missing = []
    for path in ROOT.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT.parent)
        if path.name not in layout:
            missing.append(str(rel))
    for folder in {p.parent for p in ROOT.rglob("__init__.py")} - {ROOT}:
        if f"{folder.name}/" not in layout:
            missing.append(f"{folder.relative_to(ROOT.parent)}/")
    start = layout.index("\nbenchmarks/")
    end = layout.find("\ndocs/", start)
    benchmarks = layout[start:end if end > 0 else None]
    for path in BENCHMARKS.glob("*.py"):
        if path.name != "__init__.py" and not re.search(
                rf"(?<![\w.]){re.escape(path.name)}", benchmarks):
            missing.append(str(path.relative_to(ROOT.parent)))
    assert not missing, "docs/development/layout.md does not name:\n" + "\n".join(missing)


def test_the_session_is_parts_not_mixins():
    """Session keeps the lock and the generation and delegates to parts it owns (README,
    "How it works"): no base classes whose methods share one namespace with it."""
    tree = ast.parse((ROOT / "cluster" / "session.py").read_text())
    session = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session")
    assert not session.bases, [ast.unparse(b) for b in session.bases]


# What the surface (the magics, the kernel) and the benchmarks hold of the cluster: they read
# its public face only, never a private name of the session, its generation or the client.
SURFACE = [ROOT / "magics", ROOT / "kernel", ROOT.parent / "benchmarks"]
CLUSTER_OBJECTS = {"session", "client", "gen", "generation", "_session", "_client", "_gen"}


def test_the_surface_reads_no_private_name_of_the_cluster():
    reads = []
    for folder in SURFACE:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and not node.attr.startswith("__")):
                    continue
                owner = ast.unparse(node.value)
                if owner.rpartition(".")[2] in CLUSTER_OBJECTS:
                    reads.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                                 f"{owner}.{node.attr}")
    assert not reads, "private names read from outside the cluster:\n" + "\n".join(reads)


# A name on jupyter-spmd's wire: an spmd_* message type or metadata key, or a MIME type of its.
WIRE_NAME = re.compile(r"spmd_\w+|application/vnd\.spmd\..+")


def test_the_wire_names_are_spelled_in_one_module():
    """Every spmd_* message type and metadata key (and MIME type) is spelled in spmd/wire.py,
    with what it means; every other module imports it from there."""
    spelled = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "wire.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and WIRE_NAME.fullmatch(node.value)):
                spelled.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    assert not spelled, "wire names spelled outside spmd/wire.py:\n" + "\n".join(spelled)


# What a rank's kernel is reached by: an engine module that assigns to an attribute of one
# (or to an item of one's table) patches the live kernel instead of being part of its class.
# (A variable put in the user's namespace, ``shell.user_ns[name] = ...``, is what a cell does.)
KERNEL_OBJECTS = {"kernel", "shell", "_kernel", "_shell", "get_ipython()"}


def _kernel_object(node: ast.AST) -> bool:
    return ast.unparse(node).rpartition(".")[2] in KERNEL_OBJECTS


def test_no_engine_module_patches_a_live_kernel():
    """The rank's kernel is one class (spmd/engine/rank_kernel.py, README "How it works"): no
    engine module assigns to an attribute of a kernel or shell object, or to an item of one of its
    attributes (``kernel.shell_handlers[...] = ...``), or sets one with setattr."""
    patches = []
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "setattr" and node.args):
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
                    if target.value.attr == "user_ns":
                        continue
                    target = target.value
                if isinstance(target, ast.Attribute) and _kernel_object(target.value):
                    patches.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                                   f"{ast.unparse(target)}")
    assert not patches, "a live kernel patched:\n" + "\n".join(patches)


# Engine modules that keep state of their own at module level, and why: they run before
# ipyparallel makes the rank's kernel (the join's thread, the linger's callbacks).
MODULE_STATE = {"bootstrap.py", "unattended.py"}


def test_the_ranks_state_is_its_kernels():
    """The rank's state lives on its kernel, one object per concern (spmd/engine/rank_kernel.py):
    no other engine module rebinds a name of its own at run time (``global``)."""
    rebinds = []
    for path in (ROOT / "engine").rglob("*.py"):
        if path.name in MODULE_STATE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                rebinds.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: "
                               f"global {', '.join(node.names)}")
    assert not rebinds, "module state outside the rank's kernel:\n" + "\n".join(rebinds)


def test_the_rank_kernel_declares_its_control_requests_and_answers_them_once_joined():
    """The control requests a rank adds are declared on its kernel's class, as ipykernel's
    are (``control_msg_types``, each handled by the method of its name); a rank that has not
    joined answers none of them (the notebook reads no answer as a rank it cannot reach)."""
    import threading
    import types

    from spmd import wire
    from spmd.engine.rank_kernel import RankKernel

    added = {wire.WHERE_REQUEST, wire.SIGNAL_REQUEST, wire.CENSUS_REQUEST, wire.PROMPT_ANSWER}
    assert added <= set(RankKernel.control_msg_types)
    assert all(callable(getattr(RankKernel, name)) for name in RankKernel.control_msg_types)
    sent, logged = [], []
    kernel = types.SimpleNamespace(
        _joined=False, _main_thread=threading.get_ident(),
        log=types.SimpleNamespace(error=lambda *args: logged.append(args)),
        session=types.SimpleNamespace(send=lambda stream, msg_type, *rest: sent.append(msg_type)))
    parent = {"header": {"msg_type": wire.WHERE_REQUEST}, "content": {}}
    handler = getattr(RankKernel, wire.WHERE_REQUEST)
    handler(kernel, None, [], parent)
    assert sent == [] and logged
    kernel._joined = True
    handler(kernel, None, [], parent)
    assert sent == [wire.WHERE_REPLY]


def test_the_paths_the_notebook_knows_rank_frames_by_are_real():
    """Reports look through the rank's own machinery by its files' paths (where.py): every
    module of spmd/engine/, in any subfolder, is matched, and the census's file exists."""
    from spmd.cluster.lockstep import where

    engine = [p for p in (ROOT / "engine").rglob("*.py")]
    assert engine and all(where._ENGINE.search(str(p)) for p in engine)
    assert not where._ENGINE.search(str(ROOT / "magics" / "magics.py"))
    assert (ROOT.parent / where._CENSUS_FILE).is_file()


def test_every_module_the_rank_server_preloads_is_there():
    """The rank server imports these once for every rank it forks; one it cannot import is
    skipped without a word (server.py), so a moved module would be imported by each rank
    after its fork instead."""
    import importlib

    from spmd.engine import server

    names = [m for m in server.ENGINE_MODULES + server.OPTIONAL_MODULES if m.startswith("spmd")]
    assert names
    for name in names:
        importlib.import_module(name)
