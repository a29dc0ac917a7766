"""Putting a node together from its configuration: the libp2p transport behind its guards, then the `Node`."""

from __future__ import annotations

from collections.abc import Callable

from libp2p.crypto.keys import KeyPair

from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import MergeRule
from murmur.node.learn.step import Pacing
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.security import BanList, GuardedTransport, load_allow_list, load_secret
from murmur.node.ops.config import AUTO_RELAY, NodeConfig
from murmur.node.ops.data_dir import DataDirLock, DataDirUnusable
from murmur.node.ops.hf_config import HF_CONFIG, write_hf_config
from murmur.node.ops.node import BANS_FILE, Node


def build_transport(config: NodeConfig, key_pair: KeyPair, bans: BanList) -> GuardedTransport:
    """The node's libp2p transport behind its allow-list, swarm secret, bans and limits."""
    relays = [r for r in config.relays if r != AUTO_RELAY]
    inner = Libp2pTransport(
        key_pair, max_connections=config.max_connections,
        announce=config.announce, relays=relays, relay_service=config.relay_service,
        nat_traversal=config.nat_traversal, auto_relay=not relays or AUTO_RELAY in config.relays,
        bootstrap_peers=[addr.rsplit("/p2p/", 1)[-1] for addr in config.bootstrap],  # AutoNAT trusts their word
    )
    guarded = GuardedTransport(
        inner,
        allow=load_allow_list(config.allow_peers) if config.allow_peers else None,
        secret=load_secret(config.swarm_secret_file) if config.swarm_secret_file else None,
        bans=bans,
    )
    # Our relays (configured or found) may connect even when not allowed to take part: the reservation needs it.
    inner.gate_connections(lambda peer: None if peer in inner.relay.relay_ids() else guarded.refusal(peer))
    if config.nat_traversal:  # but only allowed, unbanned peers are found as relays
        inner.finder.acceptable = lambda peer: guarded.refusal(peer) is None
    return guarded


def build_node(
    config: NodeConfig, key_pair: KeyPair, user_loop: Callable[[MergeRule], Replica] | None = None, pacing: Pacing = Pacing(),
    data_dir_lock: DataDirLock | None = None,
) -> Node:
    """A libp2p node for `config`, with its ban list kept in the data dir (`user_loop`, `pacing`: see `Node`).

    The node owns the data dir's lock (`data_dir_lock`, or one taken here) and releases it when
    `run` returns; raises `DataDirLocked` if another node holds the folder, `DataDirUnusable` if
    it cannot be written, both before anything in it is read or changed.
    """
    lock = data_dir_lock or DataDirLock.acquire(config.data_dir)
    try:
        bans = BanList(config.data_dir / BANS_FILE)
        transport = build_transport(config, key_pair, bans)
        inner = transport.inner
        assert isinstance(inner, Libp2pTransport)
        node = Node(config, transport, bans, listen_addresses=inner.listen_addresses, network_info=inner.network_info,
                    user_loop=user_loop, pacing=pacing)
        try:
            write_hf_config(node.replica.model, config.data_dir)  # for `murmur export` of a Hugging Face model
        except OSError as exc:
            raise DataDirUnusable(config.data_dir, f"cannot write {HF_CONFIG}: {exc.strerror or exc}") from None
    except BaseException:
        lock.release()
        raise
    node.data_dir_lock = lock
    inner.known_peers = lambda: {p: e.addrs for p, e in node.table.members.items()}  # where relays are looked for
    return node
