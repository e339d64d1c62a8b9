"""What the reference pages share: a MyST table, and an argparse parser's options as rows.

An option's name, its choices and its default come from the parser itself; its sentence from
the parser's help, or, where the parser has none (the magics' parsers are terse), from the
page's table of sentences. Either way the two must agree: an option without a sentence, or a
sentence for an option the parser no longer has, is an error that names it, so the build
fails instead of printing a page that drifted from the code.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


class Drift(RuntimeError):
    """A generated page and the code it is generated from disagree; the text says where."""


@dataclass(frozen=True)
class Said:
    """What the docs say of one option: its value's form and one sentence."""

    value: str  # the value's form, like N or H1,H2 ('' for a flag)
    text: str
    default: str | None = None  # shown instead of the parser's default, where it is a sentinel


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A MyST pipe table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def name(action: argparse.Action) -> str:
    """'--processes' for ['-n', '--processes']; the positional's dest ('rank') otherwise."""
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options and positionals, without help and subcommands."""
    return [
        a for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]


def default_text(action: argparse.Action, said: Said | None = None) -> str:
    """The default as a person writes it ('' where there is none to show)."""
    if said is not None and said.default is not None:
        return said.default
    value = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._AppendAction)):
        return ""
    if value is None or value == "" or value == () or value == [] or value is False:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def value_form(action: argparse.Action, said: Said | None) -> str:
    if action.nargs == 0:  # a flag
        return ""
    if action.choices:
        return "|".join(str(c) for c in action.choices)
    if said is not None and said.value:
        return said.value
    return action.metavar or action.dest.upper()


def option_rows(parser: argparse.ArgumentParser, said: dict[str, Said],
                where: str) -> list[tuple[str, str, str, str]]:
    """(option, value, default, what it does) for every option of ``parser``; Drift where
    an option has neither help nor a sentence in ``said``, or ``said`` names one the parser
    lacks. ``where`` names the table of sentences, for the error."""
    known = {name(a) for a in actions(parser)}
    stale = sorted(set(said) - known)
    if stale:
        raise Drift(f"{where} describes {', '.join(stale)}, which {parser.prog} no longer "
                    "has: remove the sentence (or the option was renamed: rename it).")
    rows = []
    for action in actions(parser):
        key = name(action)
        words = said.get(key)
        text = (words.text if words is not None else "") or _sentence(action.help or "")
        if not text:
            raise Drift(f"{parser.prog} {key} has no sentence in {where}: add one.")
        shown = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{key.upper()}`"
        value = value_form(action, words)
        rows.append((shown, f"`{value}`" if value else "", default_text(action, words), text))
    return rows


def options(rows: list[tuple[str, str, str, str]]) -> str:
    """option_rows as a MyST definition list: each option with its value, then its sentence
    and its default (a list, not a table: a sentence has room to wrap beside long values)."""
    out = []
    for names, value, default, text in rows:
        if not names.startswith("`-"):  # a positional: its value's form is its name
            term = value or names
        else:
            term = ", ".join(f"{n[:-1]} {value.strip('`')}`" if value else n
                             for n in names.split(", "))
        if default and "default" not in text.lower():
            text += f" Default: {default}."
        out += [term, f": {text}", ""]
    return "\n".join(out)


def _sentence(help_text: str) -> str:
    """argparse's help ('ranks (default 4)') as a sentence: 'Ranks (default 4).'"""
    text = help_text.strip()
    if not text:
        return ""
    return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def usage(prog: str, parser: argparse.ArgumentParser, said: dict[str, Said],
          required: tuple[str, ...] = (), width: int = 76) -> str:
    """``%spmd start -n N [-d K] [--backend jax|...]``, wrapped as the docstring wraps it."""
    words = [prog]
    for action in actions(parser):
        key = name(action)
        if not action.option_strings:
            words.append(value_form(action, said.get(key)))
            continue
        flag = min(action.option_strings, key=len)
        value = value_form(action, said.get(key))
        word = f"{flag} {value}" if value else flag
        if isinstance(action, argparse._AppendAction):
            word += " ..."
        words.append(word if key in required else f"[{word}]")
    lines, line = [], ""
    indent = " " * (len(prog) + 1)
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])
