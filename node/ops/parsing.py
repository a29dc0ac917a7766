"""Argument parsers for the `murmur` commands: errors in one line, defaults in `--help`.

argparse's own parser prints the whole usage block before the one line that matters; here
a bad flag prints that line and where the options are described, and exits 2 as argparse does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn


def describe_default(default: Any) -> str | None:
    """How `--help` shows an option's default, or None where there is nothing to show
    (no default, a flag, an empty list)."""
    if default is None or isinstance(default, bool) or default == [] or default is argparse.SUPPRESS:
        return None
    if isinstance(default, list):
        return " ".join(map(str, default))
    if isinstance(default, Path):
        home = Path.home()
        if default == home or home in default.parents:
            return str(Path("~") / default.relative_to(home))
    return str(default)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Adds "(default X)" to each option's help, unless the help already speaks of its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = describe_default(action.default) if action.option_strings else None
        if default is None or "default" in text or text == argparse.SUPPRESS:
            return action.help
        return f"{text} (default {default.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line: the problem, then where the options are
    described (exit status 2); its `--help` shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help for the options)\n")
