"""Murmur's Python API: join a swarm from your own training loop (`Peer`), or from Hugging Face's
`Trainer` (`murmur.hf.MurmurCallback`, with the `[hf]` extra) or Lightning's (`murmur.lightning.MurmurCallback`,
with the `[lightning]` extra); `murmur.schedule` turns the swarm's progress into a learning-rate schedule.

The node's code lives in `murmur.node` and `murmur.protocol`, so installing Murmur adds one
top-level name, `murmur`, and a user's own `node.py` or `protocol.py` shadows nothing. In the
repository those packages stay in the folders `node/` and `protocol/`; pyproject.toml maps them
into this package when it is installed, and the lines below do the same for a source checkout.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any

DISTRIBUTION = "murmur-gossip"  # the name on PyPI and in pip ("murmur" was taken); the import name stays `murmur`
_here = Path(__file__).resolve().parent
if not (_here / "node").is_dir() and (_here.parent / "node" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # a checkout: murmur.node is ../node (an installed wheel has murmur/node)


def _version() -> str:
    """pyproject.toml's version, as the installed package's metadata has it; read from pyproject.toml
    itself in a checkout that was never installed."""
    from importlib.metadata import PackageNotFoundError, version  # slow to import: only when asked

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        import tomllib

        try:
            with (_here.parent / "pyproject.toml").open("rb") as f:
                return str(tomllib.load(f)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"

# Imported on first use, so `murmur.node.net` (which needs no torch) does not load the API's torch.
_PUBLIC = {
    "Peer": "murmur.peer", "PeerClosed": "murmur.peer", "NotJoined": "murmur.peer",
    "DeviceError": "murmur.node.learn.device", "DataDirLocked": "murmur.node.ops.data_dir",
    "ForeignOptimizer": "murmur.node.learn.user_loop", "ModelMismatch": "murmur.node.learn.user_loop",
    "TrackingUnavailable": "murmur.node.ops.tracking",
}  # fmt: skip
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return _version()
    if name not in _PUBLIC:
        raise AttributeError(f"module 'murmur' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
