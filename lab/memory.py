"""Peak memory of a GPT-2-small-sized model (124M parameters) trained through `murmur.Peer` on CPU.

    python -m lab.memory --settings plain,none,strong --seconds 150 --out results/memory

Each Murmur setting (a `--compression` value) runs 2 peers, separate OS processes on loopback; `plain`
runs the same training loop once without Murmur. Every process builds the model from a config (no
download), trains it with AdamW on random tokens, and reports its peak RSS, steps, merges and bytes
and seconds per merge. Settings run one after another; the JSON results and a table (peak RSS while
training, and with the exit checkpoint, in float32 model copies over the plain loop's) go to `--out`.

    python -m lab.memory --settings plain,none,strong --seconds 240 --link-mbit 20 --out results/memory-20mbit

`--link-mbit` runs each peer in a network namespace of its own whose link is capped at that rate
both ways (lab.netns; needs root). Both peers build the same model from one seed, so there the
newcomer skips state sync, which would pull the whole float32 model over the slow link first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.netns import Network

BATCH, TOKENS = 1, 64  # a small step: the point is memory, and 2 cores run 2 peers


def _model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch_seed()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def torch_seed() -> None:
    import torch

    torch.manual_seed(0)  # every peer starts from the same model


def worker(
    setting: str, data_dir: Path, seconds: float, addr_file: Path, bootstrap: Path | None, result: Path,
    listen: str, sync_state: bool,
) -> None:
    """Train for `seconds` (with a `murmur.Peer` unless `setting` is "plain") and write what it measured to `result`."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    peer = None
    if setting != "plain":
        import murmur

        boot = []
        if bootstrap is not None:
            deadline = time.monotonic() + 120
            while not (bootstrap.exists() and bootstrap.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.2)
            boot = [bootstrap.read_text().split()[0]]
        peer = murmur.Peer(
            model,
            optimizer,
            run_id="memory",
            data_dir=str(data_dir),
            bootstrap=boot,
            listen=[listen],
            no_state_sync=not sync_state,
            compression=setting,
            checkpoint_every=1e9,
        )
        addr_file.write_text("\n".join(peer.addrs))
    gen = torch.Generator().manual_seed(len(str(data_dir)))
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        tokens = torch.randint(0, 50257, (BATCH, TOKENS), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if peer is not None:
            peer.step(samples=BATCH, loss=loss.item())
        steps += 1
    status = peer.status() if peer is not None else {}
    training_peak = _peak_rss()
    if peer is not None:
        peer.close()  # writes its exit checkpoint: a peak of its own
    result.write_text(json.dumps({
        "setting": setting, "peak_rss_bytes": training_peak, "peak_rss_with_exit_checkpoint_bytes": _peak_rss(),
        "model_bytes": model_bytes, "steps": steps, "seconds": seconds,
        "merges": status.get("exchanges", {}).get("merged", 0), "exchanges": status.get("exchanges", {}),
        "recent_exchanges": status.get("recent_exchanges", [])[-4:], "bytes_per_merge": status.get("bytes_per_merge"),
        "mean_exchange_s": status.get("mean_exchange_s"),
    }))  # fmt: skip


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_setting(setting: str, seconds: float, root: Path, hosts: list | None = None) -> list[dict]:
    """Run one setting's processes to the end, in `hosts` (lab.netns namespaces) if given; return their results."""
    count = 1 if setting == "plain" else 2
    procs, results = [], []
    for i in range(count):
        data_dir = root / f"{setting}-{i}"
        data_dir.mkdir(parents=True)
        result = data_dir / "result.json"
        boot = root / f"{setting}-0" / "addrs" if i else None
        argv = [
            sys.executable,
            "-m",
            "lab.memory",
            "--worker",
            setting,
            "--data-dir",
            str(data_dir),
            "--seconds",
            str(seconds),
            "--result",
            str(result),
            *(["--bootstrap-file", str(boot)] if boot else []),
            "--listen",
            f"/ip4/{hosts[i].address if hosts else '127.0.0.1'}/tcp/0",
            *(["--no-state-sync"] if hosts else []),
        ]
        proc = hosts[i].popen(argv) if hosts else subprocess.Popen(argv, start_new_session=True)
        procs.append((proc, result))
    try:
        for proc, result in procs:
            proc.wait(timeout=seconds + 600)
            results.append(json.loads(result.read_text()))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="plain,none,strong")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=Path("results/memory"))
    parser.add_argument("--link-mbit", type=float, help="cap each peer's link at this rate (network namespaces)")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help=argparse.SUPPRESS)
    parser.add_argument("--no-state-sync", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.data_dir, args.seconds, args.data_dir / "addrs", args.bootstrap_file, args.result,
               args.listen, not args.no_state_sync)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        hosts = None
        if args.link_mbit:
            network = stack.enter_context(Network(prefix="mem"))
            hosts = [network.host(f"p{i}", link_mbit=args.link_mbit) for i in range(2)]
        for setting in args.settings.split(","):
            rows += [{**row, "link_mbit": args.link_mbit} for row in run_setting(setting, args.seconds, Path(tmp), hosts)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plain = next((r["peak_rss_bytes"] for r in rows if r["setting"] == "plain"), None)
    print(
        "| setting | peak RSS GB | over plain, model copies | with the exit checkpoint | steps | merges | bytes per merge | s per merge |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        over = f"{(r['peak_rss_bytes'] - plain) / r['model_bytes']:.1f}" if plain else "—"
        exit_over = f"{(r['peak_rss_with_exit_checkpoint_bytes'] - plain) / r['model_bytes']:.1f}" if plain else "—"
        per = f"{r['bytes_per_merge'] / 1e6:.2f} MB" if r["bytes_per_merge"] else "—"
        secs = f"{r['mean_exchange_s']:.1f}" if r["mean_exchange_s"] else "—"
        print(
            f"| {r['setting']} | {r['peak_rss_bytes'] / 1e9:.2f} | {over} | {exit_over} | {r['steps']} | {r['merges']} | {per} | {secs} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
