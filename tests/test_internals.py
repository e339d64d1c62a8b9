"""The private parts of ipyparallel, ipykernel, IPython and jax that the project uses: all
there in the installed versions, and a missing one is one sentence naming it and the version;
spmd/internals.py's table is true (every private name of another project that the code uses
is in it, and nothing else); the controller refuses to serve plain text where encryption was
asked for and not given."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import pathlib
import re
import types
from dataclasses import dataclass

import pytest

from spmd import internals


@pytest.mark.parametrize("side", ["notebook", "rank"])
def test_every_private_part_used_is_there(side):
    assert internals.missing(side) == []


def test_a_missing_private_part_is_one_sentence_with_the_version(monkeypatch):
    gone = internals.Internal(
        "ipyparallel", "ipyparallel", "Client._gone_in_a_new_release", "notebook", "a test"
    )
    monkeypatch.setattr(internals, "INTERNALS", [*internals.INTERNALS, gone])
    internals.check.cache_clear()
    try:
        with pytest.raises(internals.InternalsChanged) as raised:
            internals.check("notebook")
    finally:
        internals.check.cache_clear()
    import ipyparallel

    assert str(raised.value) == (
        f"ipyparallel {ipyparallel.__version__} has no ipyparallel.Client."
        "_gone_in_a_new_release, which jupyter-spmd needs for a test: install a version that "
        "does (see pyproject.toml)."
    )


def test_the_controller_refuses_plain_text_where_encryption_was_asked_for(monkeypatch, tmp_path):
    from spmd.controller import start as controller

    monkeypatch.setenv(controller.CURVE_ENV, "1")
    app = types.SimpleNamespace(
        profile_dir=types.SimpleNamespace(security_dir=str(tmp_path)),
        log=logging.getLogger("test"),
    )
    with pytest.raises(SystemExit):
        # what ipyparallel would write if it stopped honouring enable_curve: no server key
        controller.save_connection_dict(app, "client.json", {"key": "k", "curve_serverkey": None})
    assert list(tmp_path.iterdir()) == []  # no connection file: nobody connects
    controller.save_connection_dict(app, "client.json", {"key": "k", "curve_serverkey": "s"})
    assert [p.name for p in tmp_path.iterdir()] == ["client.json"]


# -- the table is true ----------------------------------------------------------------------
#
# The code is read with ``ast``. A private name (one leading underscore) is another project's
# where it is
#   - imported from another project's module (``from ipyparallel... import _ssh_outputs``);
#   - defined, read or written in a class of spmd/ (on ``self``, ``cls``, ``super()``, or as
#     a method or class attribute that overrides one) while a class of another project among
#     its bases has it: ``Class._name``, which the table must list on that class or a base;
#   - read or written on any other object (``client._io_loop``, ``getattr(bridge,
#     "_backends")``), unless spmd/ defines that name itself (a module's, a class's, or set on
#     ``self`` in a class whose other project's bases do not have it) and no class of another
#     project that spmd/ subclasses has it too (``client._closed`` is ipyparallel's, although
#     a class here has its own ``_closed``).
# Also another project's: a method of another project's class replaced in place
# (``IPController.get_default_logging_config = ...``), public or not.

SPMD = pathlib.Path(internals.__file__).resolve().parent
# (internals.py spells every name of the table; a __main__ runs when it is imported)
SCANNED = sorted(p for p in SPMD.rglob("*.py") if p.name not in ("internals.py", "__main__.py"))

# Python's own private names, as the code spells them: no other project's release takes them
# away, and start-up does not look for them.
PYTHON_OWN = {
    "os._exit",  # documented: leave at once, without exit handlers
    "sys._getframe",  # documented (CPython): the frame that asked for a prompt
    "sys._current_frames",  # documented (CPython): a busy rank's stack
    "atexit._run_exitfuncs",  # a forked rank runs its exit handlers before os._exit
    "os.environ._data",  # CPython's bytes of the environment, read with a fallback
}
# The project's own private attributes on others' objects (a jitted function's census mark,
# the controller's fan-out): spelled ``_spmd...`` so that none is taken for another's.
OWN_PREFIX = "_spmd"


@dataclass(frozen=True)
class Use:
    name: str
    where: str  # "cluster/launchers/ssh.py:81"
    cls: type | None = None  # the class it is looked up on, where the code says which


def _private(name: str) -> bool:
    # (``_repr_html_``, ``_render_traceback_``: IPython's display protocol, public)
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


@functools.cache
def _names_of(cls: type) -> frozenset[str]:
    """What another project's class has, as internals.py looks for it (an attribute, a
    traitlet, one its instances set on themselves), read once per class."""
    names = set(dir(cls)) | set(getattr(cls, "class_traits", dict)())
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (TypeError, OSError):  # (a built-in class, or no source)
            continue
        names |= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    return frozenset(names)


def _foreign(cls: type) -> bool:
    return not cls.__module__.startswith("spmd") and cls.__module__ != "builtins"


def _classes(path: pathlib.Path, tree: ast.Module) -> dict[ast.ClassDef, type]:
    """Each class statement of a module (at its top or in a class), with its class."""
    if not any(isinstance(node, ast.ClassDef) for node in ast.walk(tree)):
        return {}  # (not imported)
    module = importlib.import_module(
        ".".join(path.relative_to(SPMD.parent).with_suffix("").parts).removesuffix(".__init__"))
    found = {}

    def walk(body, owner) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[node] = getattr(owner, node.name)
                walk(node.body, found[node])

    walk(tree.body, module)
    inner = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n not in found]
    assert not inner, f"{path}: a class inside a function ({inner[0].name}): its bases are " \
                      "not known here; define it at the module's top"
    return found


def _bindings(tree: ast.Module) -> dict[str, str]:
    """Names bound by imports anywhere in a module: their dotted target."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name \
                    or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _resolve(dotted: str):
    """The object a dotted name of another project names (None: not one, or not found)."""
    if dotted.split(".")[0] == "spmd":
        return None
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part, None)
        return value
    return None


@functools.cache
def _scan() -> tuple[list[Use], set[str], set[str]]:
    """(every use of another project's private name or class patch, every name spmd/
    spells, the PYTHON_OWN names met)."""
    trees = {path: ast.parse(path.read_text()) for path in SCANNED}
    classes = {path: _classes(path, tree) for path, tree in trees.items()}
    theirs = {k for found in classes.values() for c in found.values()
              for k in c.__mro__[1:] if _foreign(k)}
    own, uses, spelled, python = set(), [], set(), set()

    def foreign_with(cls: type, name: str) -> bool:
        return any(_foreign(k) and name in _names_of(k) for k in cls.__mro__[1:])

    for path, tree in trees.items():
        here = str(path.relative_to(SPMD))
        for node in tree.body:  # the module's own
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            own |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
        for node, cls in classes[path].items():  # each class's own, or its bases'
            for sub in ast.walk(node):
                name = None
                if sub in node.body and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = sub.name
                elif sub in node.body and isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    for target in getattr(sub, "targets", [getattr(sub, "target", None)]):
                        if isinstance(target, ast.Name) and _private(target.id):
                            name = target.id
                elif isinstance(sub, ast.Attribute) and (
                        isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
                        or ast.unparse(sub.value) == "super()"):
                    name = sub.attr
                if name is None or not _private(name):
                    continue
                if foreign_with(cls, name):
                    uses.append(Use(name, f"{here}:{sub.lineno}", cls))
                elif not isinstance(sub, ast.Attribute) or isinstance(sub.ctx, ast.Store):
                    own.add(name)
    for path, tree in trees.items():  # (once every module's own is known)
        here = str(path.relative_to(SPMD))
        bound = _bindings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level \
                    and node.module.split(".")[0] != "spmd":
                uses += [Use(a.name, f"{here}:{node.lineno}") for a in node.names
                         if _private(a.name)]
            if isinstance(node, ast.Attribute):
                spelled.add(node.attr)
            elif isinstance(node, ast.Name):
                spelled.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                spelled.add(node.name)
            elif isinstance(node, ast.alias):
                spelled.add(node.name.split(".")[-1])
        for node in ast.walk(tree):  # on other objects
            if isinstance(node, ast.Attribute):
                receiver, name = node.value, node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                    "getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                receiver, name = node.args[0], node.args[1].value
                spelled.add(name)
            else:
                continue
            text = ast.unparse(receiver)
            if text in ("self", "cls", "super()"):
                continue
            root = bound.get(text.split(".")[0])
            patched = root is not None and isinstance(node, ast.Attribute) \
                and isinstance(node.ctx, ast.Store) and not name.startswith("__")
            if patched:  # (a method of another project's class, replaced in place)
                target = _resolve(".".join([root, *text.split(".")[1:]]))
                if isinstance(target, type) and _foreign(target):
                    uses.append(Use(name, f"{here}:{node.lineno}", target))
                    continue
            if not _private(name) or name.startswith(OWN_PREFIX):
                continue
            if f"{text}.{name}" in PYTHON_OWN:
                python.add(f"{text}.{name}")
            elif name not in own or any(name in _names_of(k) for k in theirs):
                uses.append(Use(name, f"{here}:{node.lineno}"))
    return uses, spelled, python


def _owner(item: internals.Internal, part: str):
    """The module or class that holds ``part`` of a table entry's path."""
    value = importlib.import_module(item.module)
    for before in item.path.split(".")[: item.path.split(".").index(part)]:
        value = internals._attr(value, before)
    return value


def _table_check() -> tuple[list[str], list[str], list[str]]:
    """(uses the table lacks, table entries nothing uses, PYTHON_OWN names nothing uses)."""
    uses, spelled, python = _scan()
    listed: dict[str, list] = {}
    for item in internals.INTERNALS:
        for part in item.path.split("."):
            listed.setdefault(part, []).append(item)
    lacking = []
    for use in uses:
        owners = [_owner(item, use.name) for item in listed.get(use.name, [])]
        if use.cls is None and owners or any(
                isinstance(o, type) and issubclass(use.cls, o) for o in owners):
            continue
        on = f" on {use.cls.__module__}.{use.cls.__qualname__}" if use.cls else ""
        lacking.append(f"{use.where}: {use.name}{on}")
    used = {use.name for use in uses}
    unused = []
    for item in internals.INTERNALS:
        private = [part for part in item.path.split(".") if _private(part)]
        if private and not set(private) <= used or not private \
                and item.path.split(".")[-1] not in spelled:
            unused.append(f"{item.module}.{item.path}")
    return lacking, unused, sorted(PYTHON_OWN - python)


def test_every_private_name_used_is_in_the_table():
    lacking, _, _ = _table_check()
    assert lacking == [], "spmd/internals.py lacks what these use (add an Internal each)"


def test_every_entry_of_the_table_is_used():
    _, unused, python = _table_check()
    assert unused == [], "spmd/internals.py lists what nothing uses now (remove them)"
    assert python == [], "PYTHON_OWN lists what nothing uses now (remove them)"


def test_an_entry_taken_out_of_the_table_is_missed(monkeypatch):
    """The check above can fail: without Client._query_stream, its use in client.py shows."""
    kept = [i for i in internals.INTERNALS if i.path != "Client._query_stream"]
    assert len(kept) == len(internals.INTERNALS) - 1
    monkeypatch.setattr(internals, "INTERNALS", kept)
    lacking, _, _ = _table_check()
    assert {line.split(": ")[1] for line in lacking} == {"_query_stream on "
                                                          "spmd.cluster.channel.client.SpmdClient"}
