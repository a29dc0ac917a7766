import errno
import hashlib
import io
import logging
import os
from pathlib import Path

import pytest
import torch
from tmpfs import small_disk

from murmur.node.learn.checkpoint import (
    MAGIC,
    CheckpointWriteFailed,
    CorruptCheckpoint,
    load_latest,
    read_checkpoint,
    remove_unfinished,
    save_checkpoint,
)
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.tasks import CharLMTask, DigitsTask


def test_save_keeps_the_two_newest_and_loads_the_newest(tmp_path: Path) -> None:
    for i in range(4):
        save_checkpoint(tmp_path, {"n": i})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000003.pt", "checkpoint-00000004.pt"]
    state, path = load_latest(tmp_path)
    assert state == {"n": 3} and path.name == "checkpoint-00000004.pt"


def test_every_truncation_of_the_newest_falls_back_to_the_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tmp_path, {"n": 1, "w": torch.ones(4)})
    newest = save_checkpoint(tmp_path, {"n": 2, "w": torch.ones(4)})
    data = newest.read_bytes()
    for cut in range(0, len(data), 97):
        newest.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpoint):
            read_checkpoint(newest)
    newest.write_bytes(data[:-1])
    with caplog.at_level(logging.WARNING, logger="murmur.checkpoint"):
        state, path = load_latest(tmp_path)
    assert state["n"] == 1 and path.name == "checkpoint-00000001.pt"
    assert caplog.messages == ["checkpoint unusable: checkpoint-00000002.pt: no checksum trailer (truncated, or not a "
                               "Murmur checkpoint); trying an older one"]
    # The corrupt file is set aside, so the next save cannot prune the good one.
    save_checkpoint(tmp_path, {"n": 3})
    assert load_latest(tmp_path)[0] == {"n": 3}
    assert (tmp_path / "checkpoint-00000001.pt").exists()


def test_a_flipped_byte_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, {"w": torch.zeros(8)})
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        read_checkpoint(path)
    assert load_latest(tmp_path) is None


def test_a_checkpoint_loads_with_torch_load_as_it_is(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, {"n": 1, "w": torch.arange(4.0)})
    state = torch.load(path, weights_only=True)
    assert state["n"] == 1 and torch.equal(state["w"], torch.arange(4.0))


def test_a_checkpoint_in_the_earlier_headed_layout_still_loads(tmp_path: Path) -> None:
    payload = io.BytesIO()
    torch.save({"n": 7, "w": torch.ones(3)}, payload)
    data = payload.getvalue()
    path = tmp_path / "checkpoint-00000001.pt"
    path.write_bytes(MAGIC + hashlib.sha256(data).digest() + data)
    assert read_checkpoint(path)["n"] == 7
    path.write_bytes(MAGIC + hashlib.sha256(data).digest() + data[:-1])
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        read_checkpoint(path)


def test_a_write_killed_midway_leaves_only_a_stray_temporary(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"n": 1})
    (tmp_path / ".checkpoint-00000002.pt.tmp").write_bytes(b"MURMURCK1 half")  # kill -9 during write
    assert load_latest(tmp_path)[0] == {"n": 1}


def test_trainer_resumes_model_optimizer_and_counters(tmp_path: Path) -> None:
    loop = TrainingLoop(DigitsTask(), shard=0)
    for _ in range(3):
        loop.step()
    save_checkpoint(tmp_path, loop.replica.checkpoint_state())
    resumed = TrainingLoop(DigitsTask(), shard=0)
    resumed.replica.restore(load_latest(tmp_path)[0])
    assert (resumed.replica.samples, resumed.replica.work) == (96, 96.0)
    for name, tensor in loop.replica.snapshot().state.items():
        torch.testing.assert_close(resumed.replica.snapshot().state[name], tensor)
    momentum = next(iter(resumed.replica.optimizer.state.values()))["momentum_buffer"]
    assert momentum.abs().sum() > 0


def test_a_checkpoint_of_another_task_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, TrainingLoop(DigitsTask(), shard=0).replica.checkpoint_state())
    with pytest.raises(ValueError, match="another task"):
        TrainingLoop(CharLMTask(), shard=0).replica.restore(load_latest(tmp_path)[0])


def test_a_full_disk_fails_the_write_in_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    state = {"w": torch.zeros(20_000)}  # ~80 kB: one fits in the disk below, two do not
    with small_disk(tmp_path / "disk", 128) as disk:
        save_checkpoint(disk, {"n": 1, **state})
        with pytest.raises(CheckpointWriteFailed) as failed:
            save_checkpoint(disk, {"n": 2, **state})
        assert str(failed.value) == f"no space left on device writing checkpoint {disk / 'checkpoint-00000002.pt'}"
        assert failed.value.errno == errno.ENOSPC
        assert os.listdir(disk) == ["checkpoint-00000001.pt"]  # the temporary is gone, its space returned
        assert load_latest(disk)[0]["n"] == 1
        assert load_latest(disk)[1].name == "checkpoint-00000001.pt"
        # Once there is room again, the next write succeeds and is the newest.
        save_checkpoint(disk, {"n": 3})
        assert load_latest(disk)[0] == {"n": 3}


def test_a_write_that_cannot_be_pickled_removes_its_temporary_and_raises_as_it_is(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"n": 1})
    with pytest.raises(AttributeError):  # not the file system's fault: not a CheckpointWriteFailed
        save_checkpoint(tmp_path, {"f": lambda: None})
    assert os.listdir(tmp_path) == ["checkpoint-00000001.pt"]


def test_a_checkpoint_folder_that_cannot_be_made_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointWriteFailed, match=r"^cannot write checkpoint .*/file: "):
        save_checkpoint(tmp_path / "file", {"n": 1})  # a file where the folder should be


def test_unfinished_writes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"n": 1})
    (tmp_path / ".checkpoint-00000002.pt.tmp").write_bytes(b"half")
    (tmp_path / "checkpoint-00000003.pt.corrupt").write_bytes(b"set aside")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    assert remove_unfinished(tmp_path) == [".checkpoint-00000002.pt.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-00000001.pt", "checkpoint-00000003.pt.corrupt", "notes.tmp"]
    assert remove_unfinished(tmp_path / "missing") == []
