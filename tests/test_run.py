"""`murmur run` (node/ops/run.py): settings in, one line and a status code out when it cannot start."""

import socket
import subprocess
import sys
import time
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


def test_a_listen_port_in_use_stops_the_node_before_it_trains(tmp_path: Path) -> None:
    # A bootstrap node that cannot listen is unreachable: it must say so and stop, not train alone.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"/ip4/127.0.0.1/tcp/{taken.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path), "--listen", address,
             "--duration", "5"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"murmur run: error: cannot listen on {address}: address already in use: another process listens there; "
        "give this node another --listen port (tcp/0: any free one)"
    )
    assert "listening on" not in done.stdout
    assert not (tmp_path / "checkpoints").exists()  # it never trained


def test_a_port_another_murmur_node_listens_on_stops_the_second_node(tmp_path: Path) -> None:
    # py-libp2p's listeners set SO_REUSEPORT, so without a check the second node would share the port.
    addr_file = tmp_path / "first.addr"
    first = subprocess.Popen(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path / "first"),
         "--listen", "/ip4/127.0.0.1/tcp/0", "--addr-file", str(addr_file), "--duration", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not addr_file.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first node never listened"
            time.sleep(0.1)
        address = addr_file.read_text().split("/p2p/")[0]
        done = subprocess.run(
            [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path / "second"), "--listen", address,
             "--duration", "5"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert first.poll() is None  # the first node is untouched
    finally:
        first.terminate()
        first.wait(timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"murmur run: error: cannot listen on {address}: address already in use: another process listens there; "
        "give this node another --listen port (tcp/0: any free one)"
    )
    assert "listening on" not in done.stdout
    assert not (tmp_path / "second" / "checkpoints").exists()


def test_a_module_attribute_that_is_not_a_task_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path), "--task", "os:getcwd",
         "--listen", "/ip4/127.0.0.1/tcp/0", "--duration", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("murmur run: error: 'os:getcwd' is not a task factory: os.getcwd() returned a str")


def test_a_duration_run_whose_bootstrap_never_answers_exits_3_with_the_reason(tmp_path: Path) -> None:
    absent = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGzh6mGrMG5RXEuq6k1qQ2VyS2MZHGuxnWX2WU6fbqT5j"
    done = subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path / "data"), "--listen", "/ip4/127.0.0.1/tcp/0",
         "--bootstrap", absent, "--duration", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "WARNING murmur.membership: bootstrap 127.0.0.1:1: unreachable: connection refused\n" in done.stderr
    assert done.stderr.endswith("murmur run: never merged with a peer: 127.0.0.1:1: unreachable: connection refused\n")
