"""reference/kernel: the SPMD kernel's settings and its command lines, from their own code.

The settings are the kernel class's configurable traitlets, with their help; the commands
are ``python -m spmd.kernel``'s argparse parser (spmd/kernel/kernelspec.py), subcommand by
subcommand, and ``python -m spmd``'s own help text. Where the kernelspec parser gives an
option no help (it takes ``%spmd start``'s values), the sentence is here, checked as the
magics' are (tables.Drift).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from spmd.options import BACKENDS
from spmd_docs.tables import Drift, Said, option_rows, options, table, usage

# The options its parser leaves without help, by subcommand: install's take %spmd start's
# values.
_SAID = {
    "install": {
        "--backend": Said("|".join(BACKENDS), "What every rank initializes, as "
                          "[`%spmd start --backend`](#spmd-start)."),
        "--torch-backend": Said("", "torch.distributed's backend, for `--backend torch`."),
        "--launcher": Said("", "How the ranks start, as "
                           "[`%spmd start --launcher`](#spmd-start)."),
    },
    "remove": {"name": Said("NAME", "The kernelspec's name, as `list` shows it.")},
}


def _value_forms() -> dict[str, Said]:
    """The value forms of %spmd start's options (N, H1,H2...), and of install's own; their
    sentences stay the parser's help."""
    from spmd_docs.magics import commands

    forms = {k: Said(v.value, "") for k, v in commands()["start"].options.items()}
    return {**forms, "--name": Said("NAME", ""), "--display-name": Said("TEXT", "")}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def settings() -> list[tuple[str, str, str, str]]:
    """(setting, type, default, help) of each of the kernel's own configurable traitlets, in
    the order the class defines them."""
    from spmd.kernel.kernel import SpmdKernel

    own = SpmdKernel.class_own_traits(config=True)
    rows = []
    for name in [n for n in vars(SpmdKernel) if n in own]:
        trait = own[name]
        if not trait.help:
            raise Drift(f"SpmdKernel.{name} has no help: give the traitlet a help text.")
        values = getattr(trait, "values", None)
        kind = "|".join(values) if values else type(trait).__name__.lower()
        default = trait.default_value
        rows.append((f"`SpmdKernel.{name}`", f"`{kind}`",
                     f"`{default!r}`" if default != "" else "", trait.help))
    return rows


def kernel_json() -> str:
    """What ``python -m spmd.kernel install`` writes with its defaults, as kernel.json
    (the Python's path as ``python``: it is the environment's own)."""
    from spmd.kernel.kernelspec import kernel_dict

    spec = kernel_dict()
    spec["argv"] = ["python" if a == sys.executable else a for a in spec["argv"]]
    return json.dumps(spec, indent=2)


def _help_text(main, argv: list[str]) -> str:
    """What ``main(argv)`` prints for ``--help`` (argparse exits after printing it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    return out.getvalue().rstrip()


def page() -> str:
    from spmd import __main__ as spmd_main
    from spmd.kernel import kernelspec

    parser = kernelspec._parser()
    commands = _subparsers(parser)
    helps = _helps(parser)
    out = [
        "# The SPMD kernel",
        "",
        "The kernel's settings and its command lines, generated when this site is built "
        "from their own code. The kernel is IPython's kernel with every cell running on N "
        "ranks: it starts its kernelspec's cluster as soon as it is up, and every `%spmd` "
        "command works in it (see {doc}`the magics <magics>`).",
        "",
        "(kernel-install)=",
        "## `python -m spmd.kernel`",
        "",
        f"{parser.description}",
        "",
    ]
    stale = sorted(set(_SAID) - set(commands))
    if stale:
        raise Drift(f"docs/_ext/spmd_docs/kernel.py describes python -m spmd.kernel "
                    f"{', '.join(stale)}, which it no longer has.")
    forms = _value_forms()
    for command, sub in commands.items():
        said = _SAID.get(command, {})
        if command == "install":  # (%spmd start's options, written as that page writes them)
            names = {max(a.option_strings, key=len) for a in sub._actions if a.option_strings}
            said = {**{k: v for k, v in forms.items() if k in names}, **said}
        rows = option_rows(sub, said, f"docs/_ext/spmd_docs/kernel.py (_SAID[{command!r}])")
        out += [f"### `{command}`", "", f"{helps.get(command, '').capitalize()}.", "",
                "```text", usage(f"python -m spmd.kernel {command}", sub, said, ("name",)),
                "```", ""]
        if rows:
            out += [options(rows), ""]
    out += [
        "(kernel-settings)=",
        "## The kernel's settings",
        "",
        "A kernelspec's `argv` carries them as `--SpmdKernel.NAME=VALUE`; a Jupyter config "
        "file may set them too (`c.SpmdKernel.processes = 8`). The kernel's cluster starts "
        "from them; where a config file changes them, the kernel cancels the start its "
        "kernelspec began and starts its own.",
        "",
        table(("setting", "type", "default", "what it is"), settings()),
        "",
        "What `python -m spmd.kernel install` writes, with its defaults (`kernel.json`):",
        "",
        "```json",
        kernel_json(),
        "```",
        "",
        "(spmd-command-line)=",
        "## `python -m spmd`",
        "",
        "This user's clusters from a terminal: those held by a notebook, and those lingering "
        "after their notebook's process ended. Its help:",
        "",
        "```text",
        _help_text(spmd_main.main, ["--help"]),
        "```",
        "",
        "```text",
        _help_text(spmd_main.main, ["stop", "--help"]),
        "```",
        "",
    ]
    return "\n".join(out)
