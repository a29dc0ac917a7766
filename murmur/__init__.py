"""Murmur's Python API: join a swarm from your own training loop (`Peer`), or from Hugging Face's
`Trainer` (`murmur.hf.MurmurCallback`, with the `[hf]` extra)."""

from murmur.node.learn.device import DeviceError
from murmur.node.learn.user_loop import ForeignOptimizer, ModelMismatch
from murmur.peer import Peer, PeerClosed

__all__ = ["DeviceError", "ForeignOptimizer", "ModelMismatch", "Peer", "PeerClosed"]
