"""Lab commands check their extra (matplotlib) before they run anything (lab/extras.py)."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from lab import bench_cli, demo, extras
from lab.simulation import cli as simulation_cli

FIX = 'its plots need matplotlib, which the lab\'s extra installs: pip install -e ".[lab]"'


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_with_matplotlib_nothing_is_missing() -> None:
    assert extras.plotting_unavailable_reason() is None


def test_bench_without_matplotlib_says_the_fix_before_any_run(no_matplotlib, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench"
    assert bench_cli.main(["--quick", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"murmur bench: error: {FIX}\n"
    assert not out.exists()


def test_demo_without_matplotlib_says_the_fix_before_starting_peers(no_matplotlib, tmp_path: Path, capsys) -> None:
    args = argparse.Namespace(out=tmp_path / "demo", task="digits", peers=2, slowdowns="1", duration=1.0)
    assert demo.run_demo(args) == 2
    assert capsys.readouterr().err == f"murmur demo: error: {FIX}\n"
    assert not (tmp_path / "demo").exists()


def test_simulation_without_matplotlib_says_the_fix_before_simulating(no_matplotlib, tmp_path: Path, capsys) -> None:
    assert simulation_cli.main(["--out", str(tmp_path / "sim")], root=tmp_path) == 2
    assert capsys.readouterr().err == f"lab.simulation: error: {FIX}\n"
    assert not (tmp_path / "sim").exists()
