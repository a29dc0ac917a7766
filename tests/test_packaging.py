"""Import hygiene: installing Murmur adds one top-level name, `murmur`, and a user's own
`node.py` or `protocol.py` beside their script shadows nothing of ours."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

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


def test_the_wheel_has_one_top_level_name(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("murmur-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"murmur", wheel.name.split("-py")[0] + ".dist-info"}
    assert {"murmur/node/cli.py", "murmur/protocol/codec.py", "murmur/node/ops/web/index.html",
            "murmur/node/learn/tasks/data/digits.csv.gz"} <= set(names)  # fmt: skip
    assert not [n for n in names if n.startswith(("lab/", "murmur/lab/", "murmur/node/lab/"))]  # the lab runs from a checkout
