"""`murmur export`: a node's newest checkpoint as a plain safetensors state dict, tied weights stored once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from murmur.node.cli import main
from murmur.node.learn.checkpoint import save_checkpoint
from murmur.node.ops.export import TIED_KEY, ExportError, load, newest_model
from murmur.node.ops.node import CHECKPOINT_DIR


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 16, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's head is to its embedding


def write_checkpoint(data_dir: Path, model: torch.nn.Module, average: torch.nn.Module | None) -> dict:
    state = {"fingerprint": "f" * 64, "model": model.state_dict(), "samples": 320, "work": 320.0}
    if average is not None:
        state["weight_average"] = average.state_dict()
    save_checkpoint(data_dir / CHECKPOINT_DIR, state)
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


@pytest.mark.parametrize("weights", ["average", "live"])
def test_the_exported_file_loads_into_the_model_with_its_tied_weights(tmp_path: Path, capsys, weights: str) -> None:
    torch.manual_seed(0)
    live, average = TiedLM(), TiedLM()
    write_checkpoint(tmp_path, live, average)
    out = tmp_path / "model.safetensors"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out), "--weights", weights]) == 0
    assert capsys.readouterr().out == (f"murmur export: wrote {out} (4 tensors, {weights} weights of checkpoint-00000001.pt, "
                                       "1 tied tensor(s) stored once)\n")  # fmt: skip
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == ["emb.weight", "mid.bias", "mid.weight"]
        meta = f.metadata()
    assert json.loads(meta[TIED_KEY]) == {"head.weight": "emb.weight"}
    assert (meta["murmur.weights"], meta["murmur.samples"]) == (weights, "320")
    restored = TiedLM()
    restored.load_state_dict(load(out))
    assert_same(restored.state_dict(), (average if weights == "average" else live).state_dict())
    assert restored.head.weight is restored.emb.weight


def test_a_node_without_a_weight_average_exports_its_live_weights(tmp_path: Path) -> None:
    live = TiedLM()
    write_checkpoint(tmp_path, live, average=None)
    model, meta = newest_model(tmp_path, "average")
    assert meta["murmur.weights"] == "live"
    assert_same(model, live.state_dict())


def test_an_unreadable_newest_checkpoint_falls_back_to_the_older_one_and_is_left_in_place(tmp_path: Path) -> None:
    older = TiedLM()
    write_checkpoint(tmp_path, older, average=None)
    write_checkpoint(tmp_path, TiedLM(), average=None)
    newest = tmp_path / CHECKPOINT_DIR / "checkpoint-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # torn
    model, meta = newest_model(tmp_path, "live")
    assert meta["murmur.checkpoint"] == "checkpoint-00000001.pt"
    assert_same(model, older.state_dict())
    assert newest.exists()  # exporting never changes a (possibly running) node's data dir


def test_no_checkpoint_is_one_line_that_says_what_to_do(tmp_path: Path, capsys) -> None:
    out = tmp_path / "model.safetensors"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"murmur export: error: no checkpoint in {tmp_path / CHECKPOINT_DIR}: run the node until it "
                                       "writes one (--checkpoint-every), or give --data-dir\n")  # fmt: skip
    assert not out.exists()
    (tmp_path / CHECKPOINT_DIR).mkdir()
    (tmp_path / CHECKPOINT_DIR / "checkpoint-00000001.pt").write_bytes(b"junk")
    with pytest.raises(ExportError, match="no readable checkpoint in .*checkpoint-00000001.pt: not a Murmur checkpoint"):
        newest_model(tmp_path)


def test_an_unwritable_destination_is_one_line_and_leaves_nothing_behind(tmp_path: Path, capsys) -> None:
    write_checkpoint(tmp_path, TiedLM(), average=None)
    out = tmp_path / "missing" / "model.safetensors"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 1
    assert capsys.readouterr().err == f"murmur export: error: cannot write {out}: No such file or directory\n"
    assert not out.parent.exists()
