"""`murmur run` (node/ops/run.py): settings in, one line and a status code out when it cannot start."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "murmur run: error: device 'cuda' is not available"),
        (["--device", "cpu", "--mixed-precision"], "murmur run: error: --mixed-precision needs a CUDA device"),
    ],
)
def test_cli_refuses_an_unusable_device_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    data_dir = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(data_dir), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert not data_dir.exists()  # refused before creating an identity
