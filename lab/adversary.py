"""A malicious Murmur peer, for attack tests: `murmur run` that lies in its exchanges.

    python -m lab.adversary --attack scale|noise|nan|work run --bootstrap … [murmur run options, lab.peer flags]

scale  sends its parameters ×1000        noise  sends random N(0, 1) parameters
nan    sends parameters holding NaN      work   claims 1000× its real work weight
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import murmur.node.averaging.params
import murmur.protocol.exchange
from lab import peer
from murmur.node.net.conversation import Conversation
from murmur.node.ops import process
from murmur.protocol.codec import TensorSpec, WireState, quantize
from murmur.protocol.messages import Accept, Message, Offer, StateReply

ATTACKS = ("scale", "noise", "nan", "work")


def poison(attack: str) -> None:
    """Patch this process's node so that what it sends is poisoned by `attack`."""
    honest_send_params = murmur.node.averaging.params.send_params
    honest_frame = murmur.protocol.exchange.encode_frame

    async def send_params(conv: Conversation, wire: WireState, spec: TensorSpec) -> int:
        state = dict(wire.items())
        if attack == "scale":
            state = {n: t * 1000 for n, t in state.items()}
        elif attack == "noise":
            state = {n: torch.randn_like(t) for n, t in state.items()}
        elif attack == "nan":
            if wire.dtype == "int8":  # int8 values cannot hold NaN (quantizing makes them finite): its scales can
                return await honest_send_params(conv, WireState(wire.dtype, wire.tensors, dict.fromkeys(wire.scales, float("nan"))), spec)
            state = {n: torch.full_like(t, float("nan")) for n, t in state.items()}
        return await honest_send_params(conv, quantize(state, spec, wire.dtype), spec)

    def frame(message: Message) -> bytes:
        if attack == "work" and isinstance(message, (Offer, Accept, StateReply)):
            message = dataclasses.replace(message, work=message.work * 1000)  # lie on the wire only
        return honest_frame(message)

    murmur.node.averaging.params.send_params = send_params
    murmur.protocol.exchange.encode_frame = frame


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--attack" or argv[1] not in ATTACKS or argv[2] != "run":
        print(__doc__, file=sys.stderr)
        return 2
    poison(argv[1])
    with process.quiet_stop_signals():
        return peer.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
