"""`murmur export`: take a node's model away as a plain safetensors file, or as a Hugging Face folder.

The newest readable checkpoint in the data dir gives the model: its weight average (what the node
evaluates and serves, `--ema-decay`) or its live weights. Tensors that share storage (tied
weights, e.g. an LM head tied to its embedding) are written once, under the first name, and the
file's metadata lists each dropped name with the one it aliases, as `save_model` in safetensors
does; `load` ties them back. Reading never changes the data dir, so a running node can be exported.

A node whose model is a `transformers.PreTrainedModel` keeps its config in the data dir
(`hf_config.py`); from it, export writes a folder with `config.json` and `model.safetensors` that
`AutoModel*.from_pretrained` loads. There a tied tensor is stored under the name the model's class
keeps (its `_tied_weights_keys` lists the names it ties back when loading), as `save_pretrained` does.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as serialize

from murmur.node.learn.checkpoint import CorruptCheckpoint, newest_first, read_checkpoint
from murmur.node.learn.tensors import untie
from murmur.node.ops.checkpoints import CHECKPOINT_DIR
from murmur.node.ops.data_dir import write_atomic
from murmur.node.ops.hf_config import HF_CONFIG

WEIGHTS = ("average", "live")
FORMATS = ("auto", "safetensors", "hf")
HF_WEIGHTS_FILE = "model.safetensors"  # the names `from_pretrained` looks for in a folder
HF_CONFIG_FILE = "config.json"
TIED_KEY = "murmur.tied"  # metadata: JSON {dropped name: the name it aliases}


class ExportError(Exception):
    """Nothing could be exported; the message says why and what to do, in one line."""


def newest_model(data_dir: Path, weights: str = "average") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model state dict of the newest readable checkpoint in `data_dir`, and metadata describing it.

    `weights` is "average" (the weight average; the live weights where the node keeps none) or "live".
    Raises `ExportError` when the data dir holds no readable checkpoint, naming each unreadable one.
    """
    if weights not in WEIGHTS:
        raise ExportError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS)}")
    directory = data_dir / CHECKPOINT_DIR
    problems = []
    for path in newest_first(directory):
        try:
            state = read_checkpoint(path)
        except (CorruptCheckpoint, OSError) as exc:
            problems.append(str(exc))
            continue
        chosen = "average" if weights == "average" and "weight_average" in state else "live"
        model = state["weight_average"] if chosen == "average" else state["model"]
        meta = {"murmur.checkpoint": path.name, "murmur.weights": chosen, "murmur.fingerprint": str(state.get("fingerprint", "")),
                "murmur.samples": str(state.get("samples", 0)), "murmur.work": str(state.get("work", 0.0))}  # fmt: skip
        return model, meta
    if problems:
        raise ExportError(f"no readable checkpoint in {directory}: " + "; ".join(problems))
    raise ExportError(f"no checkpoint in {directory}: run the node until it writes one (--checkpoint-every), or give --data-dir")


def save(model: dict[str, torch.Tensor], out: Path, metadata: dict[str, str], loaded_tied: Collection[str] = ()
         ) -> dict[str, str]:  # fmt: skip
    """Write `model` to `out` as safetensors, tied tensors once, atomically; return {dropped name: kept name}.

    A tied tensor is kept under its first name not in `loaded_tied` (the names a loader ties back
    itself), else its first name. Raises `OSError` if `out` cannot be written; nothing is left behind then.
    """
    kept, tied = untie(model)
    for name in [n for n in kept if n in loaded_tied]:
        better = next((d for d, target in tied.items() if target == name and d not in loaded_tied), None)
        if better is not None:
            kept[better] = kept.pop(name)
            tied = {d: better if target == name else target for d, target in tied.items() if d != better}
            tied[name] = better
    data = serialize({name: t.contiguous() for name, t in kept.items()}, metadata={**metadata, TIED_KEY: json.dumps(tied)})
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return tied


def load(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a file `save` wrote, tied names restored (aliases of the kept tensor)."""
    model = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
    for name, target in tied.items():
        model[name] = model[target]
    return model


def hf_config(data_dir: Path, given: Path | None = None) -> dict[str, Any] | None:
    """The Hugging Face config to export with: `given` (a config.json or a folder holding one), else the
    data dir's (see `hf_config.py`), else None. Raises `ExportError` if it cannot be read or is not a config."""
    path = (given / HF_CONFIG_FILE if given.is_dir() else given) if given is not None else data_dir / HF_CONFIG
    if given is None and not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read the Hugging Face config {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ExportError(f"{path} is not a Hugging Face model config (it has no model_type)")
    return config


def loaded_tied_names(config: dict[str, Any]) -> set[str]:
    """The names the config's model class ties back itself when loading (its `_tied_weights_keys`);
    empty when `transformers` or the class is not there (then tied tensors keep their first name)."""
    try:
        import transformers
    except ImportError:
        return set()
    names: set[str] = set()
    for architecture in config.get("architectures") or []:
        keys = getattr(getattr(transformers, str(architecture), None), "_tied_weights_keys", None)
        if isinstance(keys, (dict, list, tuple, set)):
            names |= {str(k) for k in keys}  # {tied name: source} (transformers 5) or [tied names] (4)
    return names


def save_hf(model: dict[str, torch.Tensor], out: Path, metadata: dict[str, str], config: dict[str, Any]) -> dict[str, str]:
    """Write a folder `out` that `from_pretrained` loads: `config.json` and `model.safetensors` (see the
    module for tied tensors); returns {dropped name: kept name}. Files already in `out` are replaced,
    each atomically. Raises `OSError` if `out` cannot be created or written."""
    out.mkdir(parents=True, exist_ok=True)
    tied = save(model, out / HF_WEIGHTS_FILE, {**metadata, "format": "pt"}, loaded_tied_names(config))  # format: as save_pretrained writes it
    write_atomic(out / HF_CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tied


def main(argv: list[str]) -> int:
    """`murmur export --data-dir D --out PATH [--weights average|live] [--format auto|safetensors|hf]
    [--hf-config FILE]`; returns the exit status."""
    from murmur.node.ops.parsing import Parser
    from murmur.node.ops.status import default_data_dir

    parser = Parser(prog="murmur export", description="Write a node's model as a safetensors file (a plain state dict) "
                    "or, for a Hugging Face model, as a folder that from_pretrained loads.")  # fmt: skip
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="the node's data dir (default $MURMUR_DATA_DIR or ~/.murmur)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file, or the Hugging Face folder, to write (replaced if it exists)")
    parser.add_argument("--weights", choices=WEIGHTS, default="average",
                        help="average: the weight average the node evaluates (its live weights if it keeps none); live: its live weights")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="hf: a folder with config.json and model.safetensors for transformers' from_pretrained; "
                        "safetensors: one file, a plain state dict; auto (default): hf when there is a Hugging Face config "
                        "(the data dir keeps one for a transformers model, or --hf-config) and --out does not end in .safetensors")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="the Hugging Face config.json (or a folder holding one) to export with, instead of the data dir's")
    args = parser.parse_args(argv)
    data_dir = args.data_dir.expanduser()
    try:
        config = hf_config(data_dir, args.hf_config.expanduser() if args.hf_config else None)
        hf = args.format == "hf" or (args.format == "auto" and config is not None and args.out.suffix != ".safetensors")
        if hf and config is None:
            raise ExportError(f"no Hugging Face config in {data_dir / HF_CONFIG}: the node's model is not a transformers "
                              "model, or give --hf-config")  # fmt: skip
        model, meta = newest_model(data_dir, args.weights)
        tied = save_hf(model, args.out, meta, config) if hf and config is not None else save(model, args.out, meta)
    except ExportError as exc:
        print(f"murmur export: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"murmur export: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    note = f", {len(tied)} tied tensor(s) stored once" if tied else ""
    kind = f"a Hugging Face folder of {HF_CONFIG_FILE} and {HF_WEIGHTS_FILE}: " if hf else ""
    print(f"murmur export: wrote {args.out} ({kind}{len(model)} tensors, {meta['murmur.weights']} weights of "
          f"{meta['murmur.checkpoint']}{note})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
