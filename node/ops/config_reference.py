"""The configuration reference (docs/configuration.md), rendered from the settings' own fields.

Every `murmur run` option is an `option(...)` field of one of `murmur.node.ops.config.SETTINGS`; its flag, `MURMUR_*` variable and TOML key are derived from the field
name the same way the parser and `config_sources` derive them. Rendering the page from the same
fields keeps it from drifting: `tests/test_docs.py` fails when the committed page differs from

    python -m murmur.node.ops.config_reference > docs/configuration.md
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, get_type_hints

from murmur.node.ops.config import SETTINGS, Option, option_of, value_type
from murmur.node.ops.config_sources import env_name

COMMAND = "python -m murmur.node.ops.config_reference > docs/configuration.md"

HEADER = f"""# Configuration reference

<!-- Generated from the option fields of node/ops/config.py by `{COMMAND}`.
     Do not edit by hand: tests/test_docs.py fails when this page differs from the generated text. -->

Every `murmur run` option can be set in three places. **Flags beat environment variables, which
beat the config file, which beats the defaults.**

- a flag: `--metrics-port 9100`;
- an environment variable `MURMUR_<OPTION>` (the column below): repeatable options take a comma- or
  space-separated list, flags `true` or `false`. `murmur status` and `murmur id` read
  `MURMUR_DATA_DIR` too;
- a TOML file named by `--config FILE` (or `MURMUR_CONFIG`), with keys named like the long options
  (dashes or underscores) and lists for repeatable options:

```toml
data-dir = "/data"
listen = ["/ip4/0.0.0.0/tcp/4001"]
bootstrap = ["/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWBEMKnE3g98ft739AEuZJHgHk8eERK2W6sxREhoqsxV5W"]
average-every = 0.1
metrics-port = 9100
log-format = "json"
```

With that file, `MURMUR_METRICS_PORT=9200 murmur run --config murmur.toml --average-every 0.2`
averages every 0.2 s (flag), serves metrics on port 9200 (environment) and takes the rest from the
file. An unknown key or a bad value stops `murmur run` with one line that names it and exit status 2,
e.g. `murmur run: error: murmur.toml: unknown key 'bootstrapp' (did you mean 'bootstrap'?)`.

A flag (value `flag`) is off unless given; in the environment or the file it takes `true` or `false`.
A repeatable option (value ending in `…`) may be given more than once.
"""

TABLE_HEAD = "| option | value | default | environment | meaning |\n| --- | --- | --- | --- | --- |"


def _long_name(f: Field, how: Option) -> str:
    return how.flag or f.name.replace("_", "-")


def _default_text(f: Field) -> str:
    default = f.default if f.default_factory is MISSING else f.default_factory()
    if isinstance(default, bool):
        return "off"
    if default is None or default == []:
        return "none"
    if isinstance(default, list):
        return " ".join(f"`{item}`" for item in default)
    if isinstance(default, Path):
        home = Path.home()
        if default == home or home in default.parents:  # the same page on every machine
            default = Path("~") / default.relative_to(home)
    return f"`{default}`"


def _value_text(f: Field, how: Option, hint: Any) -> str:
    kind, repeatable = value_type(hint)
    if kind is bool:
        return "flag"
    if how.choices is not None:
        text = " \\| ".join(f"`{choice}`" for choice in how.choices())
    else:
        text = how.metavar or f.name.upper()
    return text + (" …" if repeatable else "")


def _cell(text: str) -> str:
    """Help text as one table cell: `|` would end the cell and `<id>` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


def option_rows(settings: Sequence[type] = SETTINGS) -> list[tuple[str | None, str]]:
    """(group, table row) for every option field of `settings`, in field order; the group is the class's `GROUP`."""
    rows = []
    for cls in settings:
        hints = get_type_hints(cls)
        for f in fields(cls):
            how = option_of(f)
            if how is None:
                continue
            name = _long_name(f, how)
            cells = [f"`--{name}`", _value_text(f, how, hints[f.name]), _default_text(f), f"`{env_name(name)}`",
                     _cell(how.help_text())]  # fmt: skip
            rows.append((getattr(cls, "GROUP", None), "| " + " | ".join(cells) + " |"))
    return rows


def render(settings: Sequence[type] = SETTINGS) -> str:
    """The whole page, Markdown."""
    groups: dict[str | None, list[str]] = {}
    for group, row in option_rows(settings):
        groups.setdefault(group, []).append(row)
    parts = [HEADER]
    for group, rows in groups.items():
        parts.append(f"## {'Options' if group is None else group.capitalize()}\n")
        parts.append(TABLE_HEAD + "\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
