"""A cell as plain Python, for a script that runs without IPython (``%spmd export``).

IPython's own ``TransformerManager`` finds the magics and shell escapes (the same parser the
ranks ran the cell with); each one it turned into a ``get_ipython()`` call becomes the Python it
stands for (``!cmd`` -> ``subprocess.run``, ``%cd`` -> ``os.chdir``, ``%%writefile`` -> a file
write), or a comment that says what to do where there is none. Lines without magics are kept
exactly as written, comments included. Also: what in a cell needs a person (``input()``,
``breakpoint()``, widgets), which a job cannot give.
"""

from __future__ import annotations

import ast
import difflib
import re
import shlex
import textwrap
from dataclasses import dataclass, field

from IPython.core.inputtransformer2 import TransformerManager

# Cell magics that only show something: nothing for a job to do.
_DISPLAY_MAGICS = ("html", "markdown", "latex", "javascript", "js", "svg")
# Line magics that set up the notebook, not the program.
_NOTEBOOK_MAGICS = {
    "matplotlib": "figures shown in the notebook: a job saves them (plt.savefig)",
    "config": "a notebook setting, nothing for a job to do",
    "load_ext": "a notebook extension, nothing for a job to do",
    "reload_ext": "a notebook extension, nothing for a job to do",
    "autoreload": "a notebook setting, nothing for a job to do",
    "aimport": "a notebook setting, nothing for a job to do",
    "xmode": "how the notebook shows errors, nothing for a job to do",
    "precision": "how the notebook shows numbers, nothing for a job to do",
    "pinfo": "help in the notebook, nothing for a job to do",
    "pinfo2": "help in the notebook, nothing for a job to do",
    "who": "a look at the notebook's variables, nothing for a job to do",
    "whos": "a look at the notebook's variables, nothing for a job to do",
    "history": "the notebook's history, nothing for a job to do",
}
_INSTALLERS = ("pip", "conda", "mamba", "uv")

# Calls that wait for a person at a keyboard or screen, and what a job does instead.
_PERSON_CALLS = {
    "input": "input() waits for an answer: in a job, read it from an argument or a file",
    "getpass": "getpass waits for an answer: in a job, read it from the environment",
    "breakpoint": "breakpoint() stops for pdb: a job has no one at its prompt",
    "set_trace": "pdb.set_trace() stops for pdb: a job has no one at its prompt",
    "interact": "a widget waits for a person: in a job, set the values in code",
    "interactive": "a widget waits for a person: in a job, set the values in code",
}
_PERSON_METHODS = {("getpass", "getpass"), ("pdb", "set_trace"), ("ipdb", "set_trace"),
                   ("widgets", "interact"), ("ipywidgets", "interact"),
                   ("widgets", "interactive"), ("ipywidgets", "interactive")}
_WIDGET_MODULES = ("ipywidgets",)
# The notebook's own names, which a script does not have (``_`` is left alone: a script's
# throwaway name too).
_NOTEBOOK_NAMES = ("get_ipython", "Out", "In", "_oh", "_ih")
_WIDGETS_NOTE = "ipywidgets wait for a person: in a job, set the values in code"


@dataclass
class PlainCell:
    """A cell as plain Python: its code, the modules that code now needs (``subprocess``, ...),
    and what in it needs a person ('' if nothing)."""

    code: str
    imports: set[str] = field(default_factory=set)
    person: str = ""
    known: set[str] | None = None  # names defined before it (see plain)
    notebook: str = ""  # the notebook's own names it reads ('Out, get_ipython()'), if any


def plain(cell: str, known: set[str] | None = None) -> PlainCell:
    """``cell`` (as a person typed it) as Python a script can run without IPython. ``known``:
    the names earlier cells of the script define (a shell command's ``$name`` is expanded only
    for those; None: for any name)."""
    out = PlainCell("")
    out.known = None if known is None else set(known)
    cell = re.sub(r"\A(?:[ \t]*\n)+", "", cell)  # (IPython skips blank lines too)
    first, _, body = cell.partition("\n")
    if first.startswith("%%"):
        code = _cell_magic(first[2:], body, out)
    else:
        code = _lines(cell, out)
    out.code = code.rstrip("\n") + "\n"
    out.person = needs_person(out.code)
    out.notebook = needs_notebook(out.code, out.known or set())
    return out


def needs_notebook(code: str, known: set[str]) -> str:
    """Which of the notebook's own names ``code`` reads that a script lacks ('' if none):
    ``Out[3]``, ``In``, a ``get_ipython()`` that no magic translation accounted for."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    used = sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
                   and isinstance(node.ctx, ast.Load) and node.id in _NOTEBOOK_NAMES}
                  - known)
    return ", ".join(f"{n}()" if n == "get_ipython" else n for n in used)


def needs_person(code: str) -> str:
    """What in ``code`` waits for a person, in one sentence ('' if nothing does)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                name = func.id
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                # (getpass.getpass, pdb.set_trace, widgets.interact: not any .input())
                name = func.attr if (func.value.id, func.attr) in _PERSON_METHODS else ""
            else:
                name = ""
            if name in _PERSON_CALLS:
                return _PERSON_CALLS[name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names
            ]
            if any(n.split(".")[0] in _WIDGET_MODULES for n in names):
                return _WIDGETS_NOTE
    return ""


def _cell_magic(line: str, body: str, out: PlainCell) -> str:
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("time", "prun"):
        return _lines(body, out)
    if name == "capture":
        note = f"# (%%capture {arg}: its output is printed here)\n" if arg else ""
        return note + _lines(body, out)
    if name == "timeit":  # (its options, then the setup statement on its line)
        setup = re.sub(r"^(\s*(-[nrp]\s*\d+|-[tcqo]))*\s*", "", arg)
        return ("# (%%timeit: the cell runs once here)\n"
                + (f"{setup}\n" if setup else "") + _lines(body, out))
    if name == "spmd":  # (its options say how the notebook waits; --ranks is kept apart)
        return _lines(body, out)
    if name == "writefile":
        try:
            words = shlex.split(arg)
        except ValueError:  # (a quote left open: IPython refused it too)
            return _commented(f"%%{line.strip()}", body, "its file name has a quote left open")
        append = words and words[0] in ("-a", "--append")
        # (as IPython: the line's {expr} and $name expanded, ~ too, and the cell's text ends
        # with a newline, so that -a cells add whole lines)
        path = ast.unparse(_command(ast.Constant(words[-1] if words else ""), out.known))
        if path.lstrip("f'\"").startswith("~"):
            out.imports.add("os")
            path = f"os.path.expanduser({path})"
        text = body if not body or body.endswith("\n") else body + "\n"
        if append:
            return (f"with open({path}, 'a', encoding='utf-8') as f:\n"
                    f"    f.write({text!r})\n")
        out.imports.add("pathlib")
        return f"pathlib.Path({path}).write_text({text!r}, encoding='utf-8')\n"
    if name in ("bash", "sh") or (name == "script" and arg in ("bash", "sh")):
        out.imports.add("subprocess")
        shell = name if name != "script" else arg
        return f"subprocess.run([{shell!r}, '-c', {body!r}])\n"
    if name in _DISPLAY_MAGICS:
        return f"# (a %%{name} cell: it only shows something in the notebook)\n"
    return _commented(
        f"%%{line.strip()}", body, "an IPython cell magic with no plain-Python form: rewrite "
        "the cell in Python, or run the script with ipython"
    )


def _lines(code: str, out: PlainCell) -> str:
    """Line magics and shell escapes turned into Python; every other line as written."""
    try:
        python = TransformerManager().transform_cell(code)
    except SyntaxError:  # (IPython could not read it either: the rank raised, so did we)
        return code
    if out.known is not None:
        out.known |= defined_names(python)
    before, after = code.splitlines(), python.splitlines()
    lines: list[str] = []
    for op, b0, b1, a0, a1 in difflib.SequenceMatcher(None, before, after,
                                                      autojunk=False).get_opcodes():
        if op == "equal":
            lines += before[b0:b1]
            continue
        for line in after[a0:a1]:
            lines += _line(line, out)
    return "\n".join(lines) + "\n"


def _line(line: str, out: PlainCell) -> list[str]:
    """One line of IPython's translation: as written unless it calls get_ipython()."""
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    if "get_ipython()" not in text:
        return [line]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [line]
    statement = _statement_magic(tree, out)
    if statement is not None:
        return [indent + part for part in statement.splitlines()]
    try:
        tree = _Escapes(out).visit(tree)
    except _NoPython as exc:  # (indented: a pass keeps its block a block)
        return [f"{indent}{'pass  ' if indent else ''}# {exc.magic}: {exc.why}"]
    return [indent + part for part in ast.unparse(tree).splitlines()]


def _statement_magic(tree: ast.Module, out: PlainCell) -> str | None:
    """A line that is one magic standing for a statement: ``%time x = f()`` -> ``x = f()``,
    ``%env A=1`` -> ``os.environ["A"] = "1"`` (None: not one of those)."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not _is_ipython_call(call, "run_line_magic"):
        return None
    name, arg = (a.value if isinstance(a, ast.Constant) else "" for a in call.args[:2])
    if name in ("time", "timeit"):
        try:
            ast.parse(arg)
        except SyntaxError:
            return None
        return arg if name == "time" else f"{arg}  # (%timeit: once here)"
    if name == "env" and ("=" in arg or " " in arg.strip()):
        out.imports.add("os")
        key, _, value = arg.strip().replace("=", " ", 1).partition(" ")
        # (IPython expands {expr} and $name in a line magic's argument, as in a command)
        return f"os.environ[{key!r}] = {ast.unparse(_command(ast.Constant(value.strip()), out.known))}"
    return None


class _NoPython(Exception):
    def __init__(self, magic: str, why: str) -> None:
        self.magic, self.why = magic, why


def _is_ipython_call(node: ast.AST, method: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and isinstance(node.func.value, ast.Call)
        and getattr(node.func.value.func, "id", "") == "get_ipython"
    )


def _command(node: ast.expr, known: set[str] | None) -> ast.expr:
    """A shell command with IPython's expansion of Python values written out as an f-string:
    the command split as IPython splits it (its own DollarFormatter: ``{expr}``, ``$name``
    outside single quotes, ``$$`` for ``$``). IPython runs the command as written when a name
    in it is not defined; here a name counts as defined when an exported cell before it (or
    this one) defines it (``known``; None: every name): ``$f`` of a shell loop stays the shell's."""
    text = node.value if isinstance(node, ast.Constant) else None
    if not isinstance(text, str) or ("{" not in text and "$" not in text):
        return node
    from IPython.utils.text import DollarFormatter

    parts: list[ast.expr] = []
    try:
        for literal, field, spec, conversion in DollarFormatter().parse(text):
            if literal:
                parts.append(ast.Constant(literal))
            if field is None:
                continue
            value = ast.parse(field, mode="eval").body
            names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
            if known is not None and not names <= known | _BUILTINS:
                return node
            parts.append(ast.FormattedValue(
                value, ord(conversion) if conversion else -1,
                ast.JoinedStr([ast.Constant(spec)]) if spec else None))
    except (ValueError, SyntaxError):  # (not Python: IPython runs it as written too)
        return node
    if not any(isinstance(p, ast.FormattedValue) for p in parts):
        return ast.Constant("".join(p.value for p in parts))  # ($$ -> $)
    return ast.JoinedStr(parts)


_BUILTINS = set(dir(__import__("builtins")))


def defined_names(code: str) -> set[str]:
    """The names a cell's top level binds (assignments, defs, imports, loops)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


class _Escapes(ast.NodeTransformer):
    """``get_ipython().system/getoutput/run_line_magic(...)`` -> plain Python."""

    def __init__(self, out: PlainCell) -> None:
        self.out = out

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if _is_ipython_call(node, "system"):
            self.out.imports.add("subprocess")
            return _call("subprocess.run({}, shell=True)", _command(node.args[0], self.out.known))
        if _is_ipython_call(node, "getoutput"):
            self.out.imports.add("subprocess")
            return _call(
                "subprocess.run({}, shell=True, capture_output=True, text=True)"
                ".stdout.splitlines()",
                _command(node.args[0], self.out.known),
            )
        if _is_ipython_call(node, "run_line_magic"):
            name, arg = (a.value if isinstance(a, ast.Constant) else "" for a in node.args[:2])
            return self._line_magic(name, arg)
        if _is_ipython_call(node, "run_cell_magic"):
            raise _NoPython("%%" + str(getattr(node.args[0], "value", "")),
                            "a cell magic inside a cell: rewrite it in Python")
        return node

    def _line_magic(self, name: str, arg: str) -> ast.AST:
        magic = f"%{name} {arg}".strip()
        if name in ("time", "timeit"):  # (in an expression: x = %time f(y))
            try:
                return ast.parse(arg, mode="eval").body
            except SyntaxError:
                raise _NoPython(magic, "not Python: rewrite it") from None
        if name == "env" and arg:  # (the value of one variable)
            self.out.imports.add("os")
            return _call("os.environ[{}]", ast.Constant(arg.strip()))
        if name == "cd" and arg:
            try:
                words = [w for w in shlex.split(arg) if w != "-q"]
            except ValueError:
                words = []
            if len(words) != 1 or words[0].startswith("-"):
                raise _NoPython(magic, "IPython's own folder history: write os.chdir(PATH)")
            self.out.imports.add("os")
            folder = _command(ast.Constant(words[0]), self.out.known)  # (%cd {d}, as IPython)
            if words[0].startswith("~"):
                return _call("os.chdir(os.path.expanduser({}))", folder)
            return _call("os.chdir({})", folder)
        if name == "pwd":
            self.out.imports.add("os")
            return _call("os.getcwd()")
        try:
            run_words = shlex.split(arg) if name == "run" else []
        except ValueError:
            run_words = []
        if len(run_words) == 1 and not run_words[0].startswith("-"):
            # (IPython's %run keeps the file's names in the namespace: so does the script)
            self.out.imports.add("runpy")
            return _call("globals().update((k, v) for k, v in runpy.run_path({}, "
                         "run_name='__main__').items() if not k.startswith('__'))",
                         _command(ast.Constant(run_words[0]), self.out.known))
        if name in _INSTALLERS:
            raise _NoPython(magic, f"install it in the job's environment before the run "
                            f"({name} {arg})")
        if name in _NOTEBOOK_MAGICS:
            raise _NoPython(magic, _NOTEBOOK_MAGICS[name])
        raise _NoPython(magic, "an IPython magic with no plain-Python form: rewrite it, or run "
                        "the script with ipython")


def _call(template: str, *args: ast.expr) -> ast.expr:
    """An expression from ``template`` with ``{}`` filled by ``args`` (as source)."""
    return ast.parse(template.format(*(ast.unparse(a) for a in args)), mode="eval").body


def _commented(first: str, body: str, why: str) -> str:
    return f"# {first}: {why}\n" + textwrap.indent(body, "# ", lambda _: True)
