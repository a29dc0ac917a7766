"""A Hugging Face model's config kept in the data dir, so `murmur export` can write a folder that
`transformers`' `from_pretrained` loads.

When a node starts (`murmur run` with a task whose model is a `transformers.PreTrainedModel`,
`murmur.Peer` or `murmur.hf.MurmurCallback` on one), it writes the model's config as
`<data dir>/hf/config.json`, with `architectures` naming the model's class as `save_pretrained`
does; a node whose model is not a Hugging Face model removes a config left there, so the file
always describes the model the data dir's checkpoints hold. Murmur's core never imports
`transformers`: a model is a Hugging Face model only if `transformers` is already loaded.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from torch import nn

from murmur.node.ops.data_dir import write_atomic

HF_CONFIG = Path("hf") / "config.json"  # relative to the data dir


def hf_config_json(model: nn.Module) -> str | None:
    """The JSON of `model`'s Hugging Face config (as `save_pretrained` writes it), or None for another model."""
    modeling = sys.modules.get("transformers.modeling_utils")  # loaded by whoever built a PreTrainedModel
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return None
    config = copy.deepcopy(model.config)  # the user's model keeps its own config untouched
    config.architectures = [type(model).__name__]  # what AutoModel* picks the class by
    return config.to_json_string()


def write_hf_config(model: nn.Module, data_dir: Path) -> Path | None:
    """Keep `model`'s Hugging Face config in `data_dir` (see the module); returns its path, None for another model.

    Raises `OSError` if the file cannot be written or removed.
    """
    path = data_dir / HF_CONFIG
    text = hf_config_json(model)
    if text is None:
        path.unlink(missing_ok=True)
        return None
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, text)
    return path
