"""State sync over `/murmur/state`: a newcomer (or a peer resuming far behind) adopts a live peer's model.

The requester sends its run and task fingerprint and the wire dtype it wants; the peer answers
Refuse (another task) or StateReply (its work) and its model as Params + Chunks, validated
against the requester's model before anything is adopted.
"""

from __future__ import annotations

import logging
import random

import anyio

from murmur.node.averaging import params
from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.learn.replica import Replica
from murmur.node.learn.runtime import Runtime
from murmur.node.net.conversation import Conversation
from murmur.node.net.membership import TaskIdentity
from murmur.node.net.peers import PeerTable
from murmur.node.net.transport import ByteStream, Transport, TransportError
from murmur.protocol.codec import WireState
from murmur.protocol.errors import ProtocolError
from murmur.protocol.exchange import STATE_SYNC, Exchange, Role
from murmur.protocol.messages import Refuse, StateReply, StateRequest

STATE_PROTOCOL = "/murmur/state/2.0.0"
log = logging.getLogger("murmur.averager")


class StateSyncRefused(ProtocolError):
    """The peer refused to share its model (it trains another task)."""


class StateSync:
    """This node's side of state sync: serves its model, and fetches and adopts a peer's.

    `timeout_s` bounds one whole transfer; `max_params` bounds the bytes a reply's model may
    take; `wire_dtype` is the dtype this node asks for: float32 unless told otherwise, whatever
    its exchanges use, because a node adopts a synced model whole and nothing corrects a lossy copy.
    """

    def __init__(
        self, transport: Transport, replica: Replica, table: PeerTable, identity: TaskIdentity, *,
        rng: random.Random, timeout_s: float, max_params: int, runtime: Runtime, wire_dtype: str = "float32",
    ) -> None:
        self.transport = transport
        self.replica = replica
        self.table = table
        self.identity = identity
        self.rng = rng
        self.timeout_s = timeout_s
        self.max_params = max_params
        self.wire_dtype = wire_dtype
        self.runtime = runtime

    async def serve(self, stream: ByteStream) -> None:
        """Answer one state-sync request (the `/murmur/state` stream handler)."""
        conv = Conversation(stream, Exchange(Role.RESPONDER, STATE_SYNC))
        try:
            with anyio.fail_after(self.timeout_s):
                request = await conv.receive(StateRequest)
                assert isinstance(request, StateRequest)
                mismatch = self.identity.mismatch(request.run_id, request.fingerprint)
                if mismatch:
                    await conv.send(Refuse(mismatch))
                    log.warning("refused state sync from %s: %s", stream.remote_peer[-8:], mismatch)
                else:
                    snapshot = await self.runtime.run_sync(self.replica.snapshot, request.wire_dtype)
                    await conv.send(StateReply(snapshot.work, snapshot.versions))
                    await params.send_params(conv, snapshot.state, self.replica.spec)
                await stream.close()
                return
        except (TimeoutError, ProtocolError, TransportError) as exc:
            log.info("state sync for %s failed: %s", stream.remote_peer[-8:], exc or type(exc).__name__)
        await stream.reset()

    async def fetch(self, peer_id: str, addrs: list[str]) -> tuple[WireState, StateReply]:
        """Download a peer's current model and its reply (its work, and the deltas the model holds), validated against ours.

        Raises `TransportError`, `ProtocolError` (including `Refuse` as
        `StateSyncRefused`) or `TimeoutError`; the local model is not touched.
        """
        stream = await self.transport.open_stream(peer_id, addrs, STATE_PROTOCOL)
        conv = Conversation(stream, Exchange(Role.INITIATOR, STATE_SYNC, max_params_bytes=self.max_params))
        try:
            with anyio.fail_after(self.timeout_s):
                await conv.send(StateRequest(self.identity.run_id, self.identity.fingerprint, self.wire_dtype))
                reply = await conv.receive(StateReply, Refuse)
                if isinstance(reply, Refuse):
                    raise StateSyncRefused(reply.reason)
                assert isinstance(reply, StateReply)
                state = await params.receive_params(conv, self.replica.spec, self.wire_dtype, self.runtime.run_sync)
                await stream.close()
                return state, reply
        except BaseException:
            await stream.reset()
            raise

    async def sync_from_swarm(self, attempts: int = 3, behind_ratio: float = 0.0) -> Outcome:
        """Before the first step: adopt a live peer's model and work, if any answers.

        A node resuming from a checkpoint passes `behind_ratio`: it adopts the peer's
        model only if that carries at least `behind_ratio` times its own work, so
        a stale peer catches up instead of dragging its neighbours back.
        """
        tried: set[str] = set()
        outcome = Outcome(Result.NO_PARTNER, "", "no known peers")
        for _ in range(attempts):
            entry, reason = self.table.select_partner(self.rng, tried)
            if entry is None:
                return outcome if tried else Outcome(Result.NO_PARTNER, "", reason)
            tried.add(entry.peer_id)
            start = self.runtime.monotonic()
            try:
                state, reply = await self.fetch(entry.peer_id, entry.addrs)
            except (TimeoutError, ProtocolError, TransportError) as exc:
                outcome = Outcome(Result.FAILED, entry.peer_id, f"{type(exc).__name__}: {exc}")
                continue
            if reply.work < behind_ratio * self.replica.work:
                reason = f"peer's work {reply.work:.0f} is not {behind_ratio:g}x ours ({self.replica.work:.0f})"
                return Outcome(Result.KEPT, entry.peer_id, reason)
            await self.runtime.run_sync(self.replica.adopt, state, reply.work, reply.versions)
            outcome = Outcome(Result.SYNCED, entry.peer_id, f"adopted a model of work {reply.work:.0f}", self.runtime.monotonic() - start)
            log.info("state sync from %s: %s in %.3fs", entry.peer_id[-8:], outcome.reason, outcome.duration_s)
            return outcome
        return outcome
