"""The command-line reference, generated from `gpubroker`'s own argparse parser (src/gpubroker/broker/cli.py) at
every build: each command and subcommand with its usage, its help and every argument's, so the page cannot drift
from what ``gpubroker ... --help`` prints.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator

from gpubroker.broker.cli import _parser

__all__ = ["GENERATED", "cli_reference", "commands"]

_WIDTH = "100"  # the usage lines' width, whatever terminal builds the site


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """A parser's subcommands in the order added: (name, its one-line help, its parser); aliases left out."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen and helps.get(name) != argparse.SUPPRESS:
                    seen.add(id(sub))
                    found.append((name, helps.get(name, ""), sub))
    return found


def commands(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ("gpubroker",),
             summary: str = "") -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """Every command, depth first: (its words, its one-line help, its parser)."""
    parser = parser or _parser()
    yield path, summary or parser.description or "", parser
    for name, help_text, sub in _subcommands(parser):
        yield from commands(sub, (*path, name), help_text)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _argument(prog: str, action: argparse.Action) -> tuple[str, str, str] | None:
    """(how it is written, its default, its help) for one argument's row; None for what the page leaves out."""
    if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
        return None
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        metavar = metavar or "{" + ",".join(str(c) for c in action.choices) + "}"
    if action.option_strings:
        takes_value = action.nargs != 0
        value = f" {metavar or action.dest.upper()}" if takes_value else ""
        written = ", ".join(f"`{option}{value}`" for option in action.option_strings)
    else:
        written = f"`{metavar or action.dest}`"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    help_text = action.help or ""
    if "%" in help_text:  # argparse's own expansion of %(default)s, %(choices)s, ... (and %% for a percent sign)
        params = {key: value for key, value in vars(action).items() if value is not argparse.SUPPRESS}
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        help_text = help_text % {**params, "prog": prog}
    if action.required and action.option_strings:
        help_text = f"(required) {help_text}"
    return written, shown, help_text


def cli_reference() -> str:
    """Markdown: one section per command, with its usage and a table of its arguments."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = _WIDTH
    try:
        out: list[str] = []
        for path, summary, parser in commands():
            out.append(f"## `{' '.join(path)}` {{ #{'-'.join(path)} }}\n")
            if summary:
                out.append(_cell(summary[0].upper() + summary[1:]) + ".\n" if not summary.endswith(".")
                           else _cell(summary) + "\n")
            out.append("```text\n" + parser.format_usage().strip() + "\n```\n")
            subs = _subcommands(parser)
            if subs:
                out.append("| command | what it does |\n| --- | --- |")
                out += [f"| [`{name}`](#{'-'.join((*path, name))}) | {_cell(help_text)} |"
                        for name, help_text, _ in subs]
                out.append("")
            rows = [row for row in (_argument(parser.prog, a) for a in parser._actions) if row is not None]
            if rows:
                out.append("| argument | default | what it does |\n| --- | --- | --- |")
                out += [f"| {written} | {_cell(default)} | {_cell(text)} |" for written, default, text in rows]
                out.append("")
        return "\n".join(out)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


GENERATED: dict[str, Callable[[], str]] = {"cli-reference": cli_reference}
