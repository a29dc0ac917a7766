"""Import hygiene: installing Murmur adds one top-level name, `murmur`, and a user's own
`node.py` or `protocol.py` beside their script shadows nothing of ours."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from murmur import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"murmur": "murmur", "murmur.node": "node", "murmur.protocol": "protocol"}


def test_pyproject_lists_every_package_folder() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == MAPPED
    folders = {
        ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
        for name, folder in MAPPED.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(tool["packages"]) == folders  # a new subpackage missing here would be left out of the wheel


def test_the_distribution_is_named_as_the_api_says() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION  # `murmur.__version__` reads this distribution's metadata
    assert project["scripts"] == {"murmur": "murmur.node.cli:entry"}  # the command keeps the import name


def test_a_script_beside_its_own_node_and_protocol_modules_still_imports_murmur(tmp_path: Path) -> None:
    (tmp_path / "node.py").write_text("WHOSE = 'the user'\n")
    (tmp_path / "protocol.py").write_text("WHOSE = 'the user'\n")
    (tmp_path / "train.py").write_text(
        "import node, protocol\n"
        "import murmur\n"
        "from murmur.node.learn.tasks import load_task\n"
        "from murmur.protocol.codec import quantize\n"
        "assert (node.WHOSE, protocol.WHOSE) == ('the user', 'the user')\n"
        "assert murmur.Peer.__module__ == 'murmur.peer' and load_task('digits').name == 'digits'\n"
        "assert node.__file__.startswith(%r)\n"
        "print('ok')\n" % str(tmp_path)
    )
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob(f"{DISTRIBUTION.replace('-', '_')}-*.whl")
    return built


def test_the_wheel_has_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"murmur", wheel.name.split("-py")[0] + ".dist-info"}
    assert {"murmur/node/cli.py", "murmur/protocol/codec.py", "murmur/node/ops/web/index.html",
            "murmur/node/learn/tasks/data/digits.csv.gz"} <= set(names)  # fmt: skip
    assert not [n for n in names if n.startswith(("lab/", "murmur/lab/", "murmur/node/lab/"))]  # the lab runs from a checkout


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_the_lab_commands_of_an_installed_wheel_say_in_one_line_where_the_lab_is(wheel: Path, tmp_path: Path, command: str) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")  # the package as a wheel installs it: no checkout around it
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from murmur.node.cli import main; sys.exit(main(sys.argv[1:]))", command],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"murmur {command}: ") and "source checkout" in done.stderr
