"""`murmur export`: take a node's model away as a plain safetensors file.

The newest readable checkpoint in the data dir gives the model: its weight average (what the node
evaluates and serves, `--ema-decay`) or its live weights. Tensors that share storage (tied
weights, e.g. an LM head tied to its embedding) are written once, under the first name, and the
file's metadata lists each dropped name with the one it aliases, as `save_model` in safetensors
does; `load` ties them back. Reading never changes the data dir, so a running node can be exported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as serialize

from murmur.node.learn.checkpoint import CorruptCheckpoint, newest_first, read_checkpoint
from murmur.node.learn.tensors import untie
from murmur.node.ops.node import CHECKPOINT_DIR

WEIGHTS = ("average", "live")
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


def save(model: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> dict[str, str]:
    """Write `model` to `out` as safetensors, tied tensors once, atomically; return {dropped name: kept name}.

    Raises `OSError` if `out` cannot be written; nothing is left behind then.
    """
    kept, tied = untie(model)
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


def main(argv: list[str]) -> int:
    """`murmur export --data-dir D --out PATH [--weights average|live]`; returns the exit status."""
    from murmur.node.ops.parsing import Parser
    from murmur.node.ops.status import default_data_dir

    parser = Parser(prog="murmur export", description="Write a node's model as a safetensors file (a plain state dict).")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(), help="the node's data dir (default $MURMUR_DATA_DIR or ~/.murmur)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write (replaced if it exists)")
    parser.add_argument("--weights", choices=WEIGHTS, default="average",
                        help="average: the weight average the node evaluates (its live weights if it keeps none); live: its live weights")
    args = parser.parse_args(argv)
    try:
        model, meta = newest_model(args.data_dir.expanduser(), args.weights)
        tied = save(model, args.out, meta)
    except ExportError as exc:
        print(f"murmur export: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"murmur export: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    note = f", {len(tied)} tied tensor(s) stored once" if tied else ""
    print(f"murmur export: wrote {args.out} ({len(model)} tensors, {meta['murmur.weights']} weights of {meta['murmur.checkpoint']}{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
