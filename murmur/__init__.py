"""Murmur's Python API: join a swarm from your own training loop (`Peer`), or from Hugging Face's
`Trainer` (`murmur.hf.MurmurCallback`, with the `[hf]` extra)."""

from murmur.peer import Peer, PeerClosed
from node.learn.device import DeviceError
from node.learn.user_loop import ForeignOptimizer, ModelMismatch

__all__ = ["DeviceError", "ForeignOptimizer", "ModelMismatch", "Peer", "PeerClosed"]
