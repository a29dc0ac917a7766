"""One rank of a `torchrun --nproc_per_node 2` Hugging Face `Trainer` job with `MurmurCallback` (gloo, CPU).

Run by tests/test_hf.py: `hf_ranks.py OUT_DIR BOOTSTRAP STEPS`. Each rank writes OUT_DIR/rank<r>.json:
whether it opened a peer, that peer's status, a checksum of its final model, and the swarm's work it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from test_hf import RandomTokens, gpt2  # noqa: E402

from murmur.hf import MurmurCallback  # noqa: E402


def main() -> None:
    out, bootstrap, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rank = int(os.environ["RANK"])
    callback = MurmurCallback(run_id="hf", listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap], data_dir=out / "peer")
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        gradient_accumulation_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=3, disable_tqdm=True,
        ddp_backend="gloo",
    )
    model = gpt2()
    transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(3 + rank), callbacks=[callback]).train()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    status = callback.peer.status() if callback.peer is not None else None
    result = {"peer": callback.peer is not None, "status": status, "checksum": checksum, "work": callback.work}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # The Trainer leaves gloo's process group open; left to the interpreter's exit, its threads abort the process.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
