"""`murmur export`: a node's newest checkpoint as a plain safetensors state dict, tied weights stored once, or
for a Hugging Face model (its config kept in the data dir, `hf_config.py`) as a folder `from_pretrained` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from murmur.node.cli import main
from murmur.node.learn.checkpoint import save_checkpoint
from murmur.node.ops.checkpoints import CHECKPOINT_DIR
from murmur.node.ops.export import TIED_KEY, ExportError, hf_config, load, newest_model, save
from murmur.node.ops.hf_config import HF_CONFIG, write_hf_config


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


def test_a_tied_tensor_keeps_the_name_a_loader_does_not_tie_back(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    tied = save(TiedLM().state_dict(), out, {}, loaded_tied={"emb.weight"})  # as if the loader tied emb to head
    assert tied == {"emb.weight": "head.weight"}
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == ["head.weight", "mid.bias", "mid.weight"]


def tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def test_a_hugging_face_model_trained_by_a_peer_exports_to_a_folder_from_pretrained_loads(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    import murmur

    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(1))
    with murmur.Peer(model, optimizer, run_id="hf-export", listen=["/ip4/127.0.0.1/tcp/0"], data_dir=tmp_path) as peer:
        for _ in range(3):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            peer.step(samples=len(tokens))
    assert json.loads((tmp_path / HF_CONFIG).read_text())["architectures"] == ["GPT2LMHeadModel"]

    out = tmp_path / "exported"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 0  # auto: the data dir has a config
    assert capsys.readouterr().out.startswith(f"murmur export: wrote {out} (a Hugging Face folder of config.json and "
                                              "model.safetensors: ")  # fmt: skip
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied back, as save_pretrained's output would be
    checkpoint, meta = newest_model(tmp_path, "live")
    assert meta["murmur.samples"] == "24"
    assert_same(loaded.state_dict(), checkpoint)
    assert_same(checkpoint, model.state_dict())  # the checkpoint holds what the peer trained
    assert not torch.equal(checkpoint["transformer.wte.weight"], tiny_gpt2().transformer.wte.weight)  # it trained

    plain = tmp_path / "model.safetensors"  # a .safetensors name: the plain state dict, as before
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(plain)]) == 0
    assert plain.is_file()
    assert_same(load(plain), checkpoint)


def test_a_node_keeps_a_config_only_for_a_hugging_face_model(tmp_path: Path) -> None:
    assert write_hf_config(tiny_gpt2(), tmp_path) == tmp_path / HF_CONFIG
    config = json.loads((tmp_path / HF_CONFIG).read_text())
    assert (config["model_type"], config["n_embd"], config["architectures"]) == ("gpt2", 32, ["GPT2LMHeadModel"])
    assert write_hf_config(TiedLM(), tmp_path) is None
    assert not (tmp_path / HF_CONFIG).exists()  # another model's checkpoints would not match a config left there


def test_the_hf_format_without_a_config_or_with_a_bad_one_is_one_line(tmp_path: Path, capsys) -> None:
    write_checkpoint(tmp_path, TiedLM(), average=None)
    out = tmp_path / "exported"
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out), "--format", "hf"]) == 1
    assert capsys.readouterr().err == (f"murmur export: error: no Hugging Face config in {tmp_path / HF_CONFIG}: the "
                                       "node's model is not a transformers model, or give --hf-config\n")  # fmt: skip
    bad = tmp_path / "config.json"
    bad.write_text('{"n_embd": 4}')
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out), "--hf-config", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"murmur export: error: {bad} is not a Hugging Face model config (it has no model_type)\n"
    bad.write_text("{")
    with pytest.raises(ExportError, match=f"cannot read the Hugging Face config {bad}: "):
        hf_config(tmp_path, bad)
    assert not out.exists()
    assert main(["export", "--data-dir", str(tmp_path), "--out", str(out)]) == 0  # auto without a config: one file
    assert out.is_file()
