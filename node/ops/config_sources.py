"""Where `murmur run`'s settings come from: flags > `MURMUR_*` environment > TOML file > defaults.

Generic over an argparse parser: every long option (including ones added later) is settable as
`MURMUR_<OPTION>` (`--average-every` → `MURMUR_AVERAGE_EVERY`) and as a key of the `--config` TOML
file (`average-every` or `average_every`). Values go through the option's own `type` and `choices`;
repeatable options take a TOML list or a comma- or space-separated string; flags take true/false.
Anything unknown or invalid raises `ConfigError` naming the key.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "MURMUR_"
CONFIG_OPTION = "config"  # names the file; not itself settable from the file
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A setting from the environment or the config file is unknown or invalid; the message names it."""


def env_name(option: str) -> str:
    """The environment variable for a long option name: `average-every` → `MURMUR_AVERAGE_EVERY`."""
    return ENV_PREFIX + option.upper().replace("-", "_")


def resolve_options(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> argparse.Namespace:
    """Parse `argv` with `parser`, filling every option not given on the command line from the
    environment, then from the TOML file named by `--config` (or `MURMUR_CONFIG`), then defaults.

    Command-line errors and `--help` behave as in `parser.parse_args` (exit 2 / 0); a bad
    environment variable, config file, key or value raises `ConfigError`.
    """
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    options = _options(parser)
    from_env = {
        option: _convert(action, environ[env_name(option)], env_name(option), from_text=True)
        for option, action in options.items()
        if env_name(option) in environ
    }
    config_path = args.config if CONFIG_OPTION in given else environ.get(env_name(CONFIG_OPTION))
    from_file = load_config_file(Path(config_path), options) if config_path else {}
    for option, action in options.items():
        if action.dest in given:
            continue
        if option in from_env:
            setattr(args, action.dest, from_env[option])
        elif option in from_file:
            setattr(args, action.dest, from_file[option])
    if hasattr(args, CONFIG_OPTION) and config_path:
        args.config = Path(config_path)
    return args


def load_config_file(path: Path, options: Mapping[str, argparse.Action]) -> dict[str, Any]:
    """The settings of a TOML file, converted and checked against `options` (long name → action)."""
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, raw in table.items():
        option = key.replace("_", "-")
        if option not in options:
            close = difflib.get_close_matches(option, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        values[option] = _convert(options[option], raw, f"{path}: key {key!r}", from_text=False)
    return values


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Settable options by long name (without `--`): every valued option and flag except help and --config."""
    options = {}
    for action in parser._actions:  # argparse has no public accessor for its options
        names = [s[2:] for s in action.option_strings if s.startswith("--")]
        if not names or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if names[0] != CONFIG_OPTION:
            options[names[0]] = action
    return options


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Destinations set explicitly in `argv`: parse again with every default suppressed."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def _convert(action: argparse.Action, raw: Any, where: str, *, from_text: bool) -> Any:
    """`raw` (an environment string, or a TOML value) as the option would have parsed it."""
    option = action.option_strings[-1]
    if action.nargs == 0:  # a flag: store_true / store_false / store_const
        flag = _boolean(raw, where, option) if from_text or not isinstance(raw, bool) else raw
        return action.const if flag else action.default
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        if isinstance(raw, str):
            items: list[Any] = [item for item in re.split(r"[,\s]+", raw) if item]
        elif isinstance(raw, list) and not from_text:
            items = raw
        else:
            raise ConfigError(f"{where}: {option} takes a list, got {raw!r}")
        return [_one(action, item, where, option) for item in items]
    return _one(action, raw, where, option)


def _one(action: argparse.Action, raw: Any, where: str, option: str) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ConfigError(f"{where}: {option} takes one number or string, got {raw!r}")
    try:  # as text, like a flag's value: the option's own `type` decides (int rejects 2.5)
        value: Any = (action.type or str)(str(raw))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: invalid value {raw!r} for {option}: {exc}") from None
    if isinstance(value, Path):
        value = value.expanduser()  # no shell expands `~` in an environment value or a TOML string
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: invalid value {raw!r} for {option} (choose from {choices})")
    return value


def _boolean(raw: Any, where: str, option: str) -> bool:
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{where}: {option} is a flag: use true or false, got {raw!r}")
