"""One node per data dir (node/ops/data_dir.py): a second node, `murmur run` or `murmur.Peer`, is refused
with the folder and the holder's PID; a killed holder's lock does not block; an unwritable folder is one line."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from murmur.node.ops.data_dir import LOCK_FILE, DataDirLock, DataDirLocked, DataDirUnusable

HOLD = (
    "import sys, time\n"
    "from murmur.node.ops.data_dir import DataDirLock\n"
    "DataDirLock.acquire(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


def _holder(data_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(data_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_lock_names_the_holder_and_a_released_one_is_free_again(tmp_path: Path) -> None:
    first = DataDirLock.acquire(tmp_path / "data")
    with pytest.raises(DataDirLocked) as refused:
        DataDirLock.acquire(tmp_path / "data")
    assert refused.value.pid == os.getpid()
    assert str(refused.value) == (f"data dir {tmp_path / 'data'} is in use by another Murmur node (PID {os.getpid()}); "
                                  "each node needs its own data dir")  # fmt: skip
    first.release()
    with DataDirLock.acquire(tmp_path / "data"):
        pass


def test_the_lock_of_a_killed_process_does_not_block(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        with pytest.raises(DataDirLocked) as refused:
            DataDirLock.acquire(tmp_path)
        assert refused.value.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / LOCK_FILE).read_text() == f"{holder.pid}\n"  # left behind, as after a crash
    with DataDirLock.acquire(tmp_path):
        pass


def test_murmur_run_on_a_folder_in_use_exits_with_one_line(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    try:
        done = subprocess.run([sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(tmp_path),
                               "--listen", "/ip4/127.0.0.1/tcp/0", "--duration", "1"],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1
    assert done.stderr == (f"murmur run: error: data dir {tmp_path} is in use by another Murmur node (PID {holder.pid}): "
                           "stop it, or give this node its own --data-dir\n")  # fmt: skip
    assert not (tmp_path / "identity.key").exists()  # refused before it read or made an identity


def test_a_murmur_peer_on_a_folder_in_use_raises_data_dir_locked(tmp_path: Path) -> None:
    import torch

    import murmur

    with DataDirLock.acquire(tmp_path):
        model = torch.nn.Linear(2, 2)
        with pytest.raises(murmur.DataDirLocked) as refused:
            murmur.Peer(model, torch.optim.SGD(model.parameters(), lr=0.1), data_dir=tmp_path,
                        listen=["/ip4/127.0.0.1/tcp/0"])  # fmt: skip
        assert refused.value.pid == os.getpid()


def _read_only_command(folder: Path, argv: list[str]) -> list[str]:
    """`argv` run where `folder` cannot be written: a read-only mount in a mount namespace of its own
    where this user is root (root may write any folder whatever its mode), else a folder without write permission."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return argv
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to make a read-only folder as root")
    script = 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, str(folder), *argv]


def test_an_unwritable_data_dir_is_one_line_naming_it_and_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    argv = [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(folder / "data"), "--duration", "1"]
    done = subprocess.run(_read_only_command(folder, argv), capture_output=True, text=True, timeout=120, check=False)
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert done.returncode == 1
    assert done.stderr == (f"murmur run: error: cannot write to data dir {folder / 'data'}: {reason}: "
                           "give --data-dir a folder this user can write\n")  # fmt: skip


def test_a_data_dir_that_is_a_file_is_unusable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(DataDirUnusable, match=f"cannot write to data dir {tmp_path / 'file'}: File exists"):
        DataDirLock.acquire(tmp_path / "file")
