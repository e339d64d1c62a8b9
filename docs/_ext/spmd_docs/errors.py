"""reference/errors.md: every refusal and error sentence the code can say to a person, each with
its entry in docs/reference/errors.yaml (its topic, and when it comes where the sentence alone
does not say).

The sentences are read from the code itself, not from a list kept by hand: every call that
makes one of the user-facing errors below (IPython's ``UsageError``, which the magics and the
kernel raise, and the project's own errors whose text a person reads in the notebook), with
its sentence as a template: string pieces as they are, each ``{...}`` of an f-string as
``…``. Where the sentence is made elsewhere, it is followed: a module's string constant, or
the strings a helper of the same module returns or builds (``no_answer(...)``). A call that
passes on a sentence already made (``str(exc)`` of an error collected where it was raised)
adds nothing.

Left out, on purpose: errors no person reads as a sentence (``KeyError``, ``TypeError``...,
caught in the code), and ``InternalsChanged``, which names a private part of jax for the
project's developers (reference/internals.md lists those).

The check: a sentence of the code without an entry, an entry that matches no sentence, and
a call whose sentence cannot be read all raise ``Drift``, naming the file and line, so the
site's build fails until errors.yaml says what the code says.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from spmd_docs.tables import Drift

ROOT = Path(__file__).resolve().parents[3]
ENTRIES = ROOT / "docs" / "reference" / "errors.yaml"

# The errors whose text a person reads in the notebook, by the name the code calls them.
ERRORS = frozenset({
    "UsageError",  # IPython's: the magics' and the kernel's refusals, shown as one line
    "ArgumentTypeError",  # a start option's value, said through the start's UsageError
    "StartError", "OutOfStep",  # cluster/records.py
    "AttachError",  # cluster/linger.py
    "HostsError",  # cluster/launchers/remote.py
    "StartRefused",  # cluster/launchers/processes.py
    "ServerUnavailable", "ServerSlow",  # cluster/launchers/servers.py (why a start fell back)
    "TorchSetupError",  # engine/join/torch_group.py
    "GpuError",  # engine/join/placement.py
    "BackendMissing",  # engine/bootstrap.py
    "NoRanks",  # kernel/debugger.py: a debugger request's error
    "TooLarge", "NotAnArray", "PartialValues",  # engine/arrays: %spmd gather's refusals
    "Incomplete",  # magics/arrays/values.py
})

# Arguments that pass on a sentence made before (collected where it was made).
PASSED_ON = frozenset({"str(exc)", "exc", "evalue", "self.out_of_step",
                       "self.gen.out_of_step", "message"})

MIN_PIECE = 20  # a helper's string shorter than this, without '…', is a word, not a sentence


@dataclass
class Sentence:
    """One template the code says, and every place it is said."""

    says: str
    where: list[str] = field(default_factory=list)  # 'spmd/x.py:12'


def template(node: ast.AST) -> str | None:
    """The sentence ``node`` makes, with '…' for what it fills in; None if not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left), template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "…") + (right if right is not None else "…")
    if isinstance(node, ast.IfExp):
        return "…"
    return None


class _Module:
    """One module's refusals, and what it names: string constants and helpers."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.name = path, path.relative_to(root.parent).as_posix()
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.constants: dict[str, str] = {}
        self.helpers: dict[str, ast.FunctionDef] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name) and node.targets[0].id.isupper():
                said = template(node.value)
                if said is not None:
                    self.constants[node.targets[0].id] = said
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.helpers.setdefault(node.name, node)

    def calls(self):
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.id if isinstance(func, ast.Name) else (
                    func.attr if isinstance(func, ast.Attribute) else "")
                if called in ERRORS:
                    yield node


def _helper_strings(helper: ast.FunctionDef) -> list[str]:
    """The sentences a helper builds: its returned and assigned strings, without the words
    too short to be one."""
    found = []
    for node in ast.walk(helper):
        value = node.value if isinstance(node, ast.Return | ast.Assign | ast.AugAssign) else None
        said = template(value) if value is not None else None
        if said and said.strip("…") and ("…" in said or len(said) >= MIN_PIECE):
            found.append(said.strip())
    return found


def _sentences_of(arg: ast.AST, module: _Module, constants: dict[str, str],
                  helpers: dict[str, ast.FunctionDef]) -> list[str] | None:
    """The sentences one error's argument can be ([] where it passes one on); None when they
    cannot be read."""
    said = template(arg)
    if said is not None:
        return [said]
    source = ast.unparse(arg)
    if source in PASSED_ON:
        return []
    if isinstance(arg, ast.Name) and arg.id in constants:
        return [constants[arg.id]]
    if isinstance(arg, ast.BoolOp):  # (a or 'the reason when there is none')
        return [s for v in arg.values if (s := template(v)) is not None]
    if isinstance(arg, ast.Call):
        func = arg.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else "")
        helper = module.helpers.get(name) or helpers.get(name)
        if helper is not None:
            found = _helper_strings(helper)
            # (a helper that takes the sentence as an argument, and adds to it)
            found += [s for a in arg.args if (s := template(a)) is not None]
            return found or None
    return None


def sentences(package: Path) -> dict[str, Sentence]:
    """Every sentence under ``package`` (the spmd folder), by its text."""
    modules = [_Module(p, package) for p in sorted(package.rglob("*.py"))]
    constants: dict[str, str] = {}
    helpers: dict[str, ast.FunctionDef] = {}
    for module in modules:  # (imported by name: NOT_RUNNING, remote.launch_failure)
        constants.update(module.constants)
        for name, helper in module.helpers.items():
            helpers.setdefault(name, helper)
    found: dict[str, Sentence] = {}
    unread = []
    for module in modules:
        for call in module.calls():
            where = f"{module.name}:{call.lineno}"
            said = _sentences_of(call.args[0], module, constants, helpers)
            if said is None:
                unread.append(f"{where} ({ast.unparse(call.args[0])[:70]})")
                continue
            for text in said:
                if not any(c.isalpha() for c in text):  # ('…: …': the sentences it joins)
                    continue
                found.setdefault(text, Sentence(text)).where.append(where)
    if unread:
        raise Drift("The errors page cannot read the sentence of these errors: write it as a "
                    "string, an f-string, a module's constant or a helper's returned string "
                    "(docs/_ext/spmd_docs/errors.py):\n  " + "\n  ".join(unread))
    return found


def read_entries(path: Path = ENTRIES) -> list[dict]:
    """errors.yaml's entries, each with its topic: [{topic, says, when}]."""
    entries = []
    for topic, items in (yaml.safe_load(path.read_text()) or {}).items():
        for item in items:
            if isinstance(item, str):
                item = {"says": item}
            entries.append({"topic": topic, "says": item["says"], "when": item.get("when", "")})
    return entries


def check(package: Path, path: Path = ENTRIES) -> tuple[dict[str, Sentence], list[dict]]:
    """The code's sentences and the entries, once every sentence has exactly one entry."""
    said = sentences(package)
    entries = read_entries(path)
    written = [e["says"] for e in entries]
    missing = [s for s in said.values() if s.says not in written]
    stale = [e["says"] for e in entries if e["says"] not in said]
    twice = sorted({s for s in written if written.count(s) > 1})
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} error sentence(s) of the code have no entry in {path.name}: add "
            "each under its topic (says: the sentence as below, when: what causes it):\n"
            + "\n".join(f"  {', '.join(s.where)}: says: {s.says!r}" for s in missing))
    if stale:
        problems.append(f"{len(stale)} entr(ies) of {path.name} match no sentence the code says "
                        "(changed or removed): mend or remove them:\n"
                        + "\n".join(f"  {s!r}" for s in stale))
    if twice:
        problems.append(f"entries written twice in {path.name}: " + "; ".join(map(repr, twice)))
    if problems:
        raise Drift("\n".join(problems))
    return said, entries


def _shown(text: str) -> str:
    """A sentence as the page shows it: in a code span, its lines joined."""
    one = " ".join(line.strip() for line in text.strip().splitlines())
    ticks = "``" if "`" in one else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{one}{pad}{ticks}"


def page(package: Path = ROOT / "spmd", path: Path = ENTRIES) -> str:
    said, entries = check(package, path)
    topics: dict[str, list[dict]] = {}
    for entry in entries:
        topics.setdefault(entry["topic"], []).append(entry)
    lines = [
        "# Errors and refusals",
        "",
        "Every error sentence jupyter-spmd can show, by what you were doing, as the code says "
        "it: `…` stands for what it fills in (a host, a rank, a path). Most say what to do "
        "in the sentence itself; where they do not, the line under them does. A command "
        "that is refused starts nothing and leaves nothing running.",
        "",
        "This page is generated from the code at each build (docs/_ext/spmd_docs/errors.py): "
        "a sentence without an entry in docs/reference/errors.yaml fails the build.",
        "",
    ]
    for topic, items in topics.items():
        lines += [f"## {topic}", ""]
        for entry in items:
            where = sorted({w.rpartition(":")[0] for w in said[entry["says"]].where})
            lines.append(f"- {_shown(entry['says'])}")
            if entry["when"]:
                lines.append(f"  {entry['when'].strip()}")
            lines.append(f"  <small>({', '.join(where)})</small>")
        lines.append("")
    return "\n".join(lines)
