"""The docs stay true to the tree: every repository path they cite exists, and the configuration
reference is the one the option fields generate.

A "repository path" is a token that starts with one of the top-level folders (`node/`, `lab/`, …)
or is a top-level file (`pyproject.toml`, `Dockerfile`, …), in Markdown (README.md, SECURITY.md,
docs/) and in the comments and docstrings of code (node/, protocol/, murmur/, lab/, tests/,
examples/, scripts/*.sh, Dockerfile). `path:line` and `path::test` cite `path`. Globs and
placeholders (`*`, `<…>`, `{…}`, `…`) are not paths. Markdown links are checked relative to the page.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from murmur.node.ops.config import option
from murmur.node.ops.config_reference import COMMAND, render

ROOT = Path(__file__).resolve().parent.parent

TOP_FOLDERS = ("node", "protocol", "murmur", "lab", "tests", "scripts", "docs", "examples")
TOP_FILES = ("pyproject.toml", "Dockerfile", "README.md", "SECURITY.md", "docker-compose.yml")
CODE_FOLDERS = ("node", "protocol", "murmur", "lab", "tests", "examples")

# Not preceded by a path or word character (so `/murmur/average/2.0.0`, `x.lab/` and URLs do not count).
_PATH = re.compile(
    r"(?<![\w./\-~$])"
    rf"((?:{'|'.join(TOP_FOLDERS)})/[\w./\-*<>{{}}…]*|(?:{'|'.join(re.escape(f) for f in TOP_FILES)})(?![\w\-]|\.\w))"
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"[*<>{}…]")
# Installed, `node/` and `protocol/` are `murmur/node/` and `murmur/protocol/` (pyproject.toml's package-dir).
_INSTALLED = re.compile(r"^murmur/(?=(?:node|protocol)(?:/|$))")


def _paths_in(text: str) -> list[str]:
    """The repository paths `text` cites, as written (without a trailing `.` or `,`)."""
    found = []
    for match in _PATH.finditer(text):
        path = match.group(1)
        if _PLACEHOLDER.search(path):
            continue
        found.append(_INSTALLED.sub("", path.rstrip(".,")))
    return found


def _python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    prose = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                prose.append((token.start[0], token.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    prose.append((body[0].lineno, body[0].value.value))
    return prose


def _hash_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of the `#` comments of a shell script or Dockerfile (a whole line or a line's tail)."""
    prose = []
    for number, line in enumerate(source.splitlines(), 1):
        comment = re.search(r"(?:^|\s)#(?!!)(.*)", line)
        if comment:
            prose.append((number, comment.group(1)))
    return prose


def documents(root: Path) -> list[Path]:
    """The files whose prose is checked."""
    files = [root / name for name in ("README.md", "SECURITY.md") if (root / name).exists()]
    files += sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    for folder in CODE_FOLDERS:
        if (root / folder).is_dir():
            files += sorted(p for p in (root / folder).rglob("*.py") if ".venv" not in p.parts)
    files += sorted((root / "scripts").glob("*.sh")) if (root / "scripts").is_dir() else []
    files += [root / "Dockerfile"] if (root / "Dockerfile").exists() else []
    return files


def citations(root: Path, file: Path) -> list[tuple[int, str, Path]]:
    """(line, path as written, where it must exist) for every path `file` cites."""
    source = file.read_text(encoding="utf-8")
    if file.suffix == ".md":
        cited = []
        for number, line in enumerate(source.splitlines(), 1):
            cited += [(number, path, root / path) for path in _paths_in(line)]
            for target in _LINK.findall(line):
                target = target.split("#", 1)[0]
                if target and not re.match(r"[a-z]+:", target) and not _PLACEHOLDER.search(target):
                    cited.append((number, target, (file.parent / target).resolve()))
        return cited
    prose = _python_prose(source) if file.suffix == ".py" else _hash_comments(source)
    cited = []
    for first_line, text in prose:
        for offset, line in enumerate(text.splitlines()):
            cited += [(first_line + offset, path, root / path) for path in _paths_in(line)]
    return cited


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def missing_anchors(root: Path) -> list[str]:
    """`file:line → target#anchor` for every Markdown link to a heading that the target page lacks."""
    missing = []
    for file in documents(root):
        if file.suffix != ".md":
            continue
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            for target in _LINK.findall(line):
                if "#" not in target or re.match(r"[a-z]+:", target):
                    continue
                page, anchor = target.split("#", 1)
                path = (file.parent / page).resolve() if page else file
                if path.suffix != ".md" or not path.is_file():
                    continue
                headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.MULTILINE)
                if anchor not in {_slug(h) for h in headings}:
                    missing.append(f"{file.relative_to(root)}:{number} → {target}")
    return missing


def missing_paths(root: Path) -> list[str]:
    """`file:line → path` for every cited path that does not exist under `root`."""
    missing: list[str] = []
    for file in documents(root):
        for line, path, target in citations(root, file):
            entry = f"{file.relative_to(root)}:{line} → {path}"
            if not target.exists() and entry not in missing:
                missing.append(entry)
    return missing


# --- the checker itself ---------------------------------------------------------------------------


def test_the_checker_finds_a_missing_path_and_accepts_real_ones(tmp_path: Path) -> None:
    (tmp_path / "node" / "learn").mkdir(parents=True)
    (tmp_path / "node" / "learn" / "rules.py").write_text(
        '"""Merge rules; see docs/design.md and tests/test_rules.py::test_uniform."""\n'
        "# measured in docs/bench/gone/results.json, README.md\n"
        "PATH = 'docs/not-a-comment.md'  # a string, not prose: not checked\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_rules.py").write_text("# see node/learn/rules.py:12 and node/learn/*.py\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "See [the API](api.md), [rules](../node/learn/rules.py#L3), `node/learn/`, node/<module>.py,\n"
        "the protocol id /murmur/average/2.0.0, https://example.com/docs/x.md and `docs/missing.md`.\n"
    )
    (tmp_path / "README.md").write_text("Read docs/design.md, then [bench](docs/bench.md).\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.sh").write_text("#!/usr/bin/env bash\n# like lab/absent.py\necho lab/x.py\n")
    assert sorted(missing_paths(tmp_path)) == sorted([
        "README.md:1 → docs/bench.md",
        "docs/design.md:1 → api.md",
        "docs/design.md:2 → docs/missing.md",
        "node/learn/rules.py:2 → docs/bench/gone/results.json",
        "scripts/run.sh:2 → lab/absent.py",
    ])  # fmt: skip


def test_the_checker_finds_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page\n\n## Simulation: 100 to 1,000 peers\n\n[x](#page) [y](#gone)\n")
    (tmp_path / "README.md").write_text("[s](docs/a.md#simulation-100-to-1000-peers) [t](docs/a.md#old-name)\n")
    assert sorted(missing_anchors(tmp_path)) == ["README.md:1 → docs/a.md#old-name", "docs/a.md:5 → #gone"]


def test_path_tokens() -> None:
    assert _paths_in("see `node/net/host.py:42`, tests/test_x.py::test_y and pyproject.toml.") == [
        "node/net/host.py", "tests/test_x.py", "pyproject.toml"]  # fmt: skip
    assert _paths_in("node/*.py, tests/test_<module>.py, lab/{a,b}.py, docs/…") == []
    assert _paths_in("/murmur/peers/1.0.0 x.node/y murmur.node.ops README.mdx") == []
    assert _paths_in("a wheel has murmur/node/cli.py and murmur/protocol") == ["node/cli.py", "protocol"]


# --- the repository -------------------------------------------------------------------------------


def test_every_cited_repository_path_exists() -> None:
    missing = missing_paths(ROOT)
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_every_link_to_a_heading_finds_it() -> None:
    missing = missing_anchors(ROOT)
    assert not missing, "links to headings that do not exist:\n" + "\n".join(missing)


def test_the_configuration_reference_is_generated_from_the_option_fields() -> None:
    # A fresh interpreter, as the command runs: plugins other tests imported cannot add choices here.
    generated = subprocess.run([sys.executable, "-m", "murmur.node.ops.config_reference"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == generated, f"docs/configuration.md is stale: run `{COMMAND}`"


def test_the_reference_renders_a_later_option_and_the_help_as_table_cells() -> None:
    @dataclass
    class Later:
        made_up_size: int = option(8, "an option added later, <n> | more")
        hidden: float = 1.0  # not an option: not on the page

    page = render((Later,))
    assert "| `--made-up-size` | MADE_UP_SIZE | `8` | `MURMUR_MADE_UP_SIZE` | an option added later, \\<n> \\| more |" in page
    assert "hidden" not in page
