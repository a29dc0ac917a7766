"""Through real NAT: `murmur run` peers in network namespaces, two of them behind NAT routers (iptables MASQUERADE).

Proves: NATed peers cannot be dialed; AutoNAT says private for them and public for the others; relays are
found without being named; DCUtR makes the NATed pair's connection direct and models move over it; behind
a NAT that punching cannot pass they keep training through a relay, and a killed relay costs at most one
exchange; the smallest deployment (one public bootstrap with `--relay-service`, NATed peers given only
`--bootstrap`) works as well; nothing is left behind. (~60-90 s each on 2 cores.)
"""

import subprocess

import pytest

from lab.natswarm import NatSwarm
from lab.netns import netns_unavailable_reason
from murmur.node.averaging.outcome import Result

_reason = netns_unavailable_reason(need_iptables=True)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _reachability(swarm: NatSwarm) -> dict[str, str]:
    return {name: swarm.network(name).reachability for name in ("boot", "relay", "a", "b")}


def _connection(swarm: NatSwarm, name: str, partner: str) -> str | None:
    return swarm.network(name).connections.get(swarm.peer_id(partner))


def test_nated_peers_punch_a_hole_and_exchange_models_directly(tmp_path) -> None:
    with NatSwarm(tmp_path, duration=120) as swarm:
        names = {ns.name for ns in swarm.net.namespaces}
        for name in ("a", "b"):
            nat = swarm.nat_a if name == "a" else swarm.nat_b
            assert not swarm.can_dial("boot", nat.address), f"{name}'s NAT forwards unsolicited connections"
            assert not swarm.can_dial("boot", swarm.hosts[name].address), f"{name} is routable from outside"
        swarm.wait_until(lambda: _reachability(swarm) == {"boot": "public", "relay": "public", "a": "private", "b": "private"},
                         "reachability public, public, private, private", 120)
        for name in ("a", "b"):  # relays were found, not configured, and only circuits are advertised
            swarm.wait_until(lambda n=name: len(swarm.network(n).relays) == 2, f"two relays for {name}", 60)
            assert all("/p2p-circuit/" in a for a in swarm.status(name).addrs)
        swarm.wait_until(lambda: _connection(swarm, "a", "b") == "direct" and _connection(swarm, "b", "a") == "direct",
                         "a direct a-b connection", 90)
        swarm.wait_until(lambda: (Result.MERGED, "direct") in swarm.exchanges("a", "b") + swarm.exchanges("b", "a"),
                         "a model exchange over the punched connection", 60)
        swarm.wait_until(lambda: swarm.network("a").hole_punched + swarm.network("b").hole_punched >= 1,
                         "status counting the punched hole", 10)
    assert not names & _namespaces()
    assert not any(p.alive() for p in swarm.peers.values())


def test_unpunchable_nat_falls_back_to_the_relay_and_survives_losing_it(tmp_path) -> None:
    with NatSwarm(tmp_path, unpunchable=True, spare_relay=True, duration=150) as swarm:
        swarm.wait_until(lambda: all(len(swarm.network(n).relays) == 2 for n in ("a", "b")),
                         "two relay reservations each", 150)
        swarm.wait_until(lambda: sum(r == Result.MERGED for r, _ in swarm.exchanges("a", "b")) >= 3,
                         "three a-b exchanges", 90)
        assert _connection(swarm, "a", "b") == "relayed", swarm.network("a").connections
        assert (Result.MERGED, "direct") not in swarm.exchanges("a", "b")
        victim_id = swarm.network("a").relayed_via[swarm.peer_id("b")]  # the relay carrying a-b
        victim = next(name for name in swarm.public if swarm.peer_id(name) == victim_id)
        before = len(swarm.exchanges("a", "b"))
        swarm.kill(victim)
        swarm.wait_until(lambda: sum(r == Result.MERGED for r, _ in swarm.exchanges("a", "b")[before:]) >= 3,
                         f"three a-b exchanges after killing {victim}", 90)
        after = swarm.exchanges("a", "b")[before:]
        results = [r for r, _ in after]
        lost = results[: results.index(Result.MERGED)].count(Result.FAILED)  # a busy partner lost nothing
        assert lost <= 1, f"more than one exchange lost to the dead relay: {after}"

        def re_reserved(name: str) -> bool:  # two reservations again, none on the dead relay
            relays = swarm.network(name).relays
            return len(relays) == 2 and not any(victim_id in r for r in relays)

        swarm.wait_until(lambda: re_reserved("a") and re_reserved("b"), "two live reservations each again", 60)
        assert _connection(swarm, "a", "b") == "relayed", swarm.network("a").connections
    assert not any(p.alive() for p in swarm.peers.values())


class _OnePublicNode(NatSwarm):
    """The smallest deployment: the bootstrap ("boot", `--relay-service`) is the only reachable peer and the only relay."""

    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.public = ("boot",)


def _merged_with(swarm: NatSwarm, name: str, partner: str) -> bool:
    partner_id = swarm.peer_id(partner)
    status = swarm.status(name)
    return status is not None and any(
        o.result == Result.MERGED and o.partner == partner_id for o in status.recent_exchanges)


def test_one_public_bootstrap_is_enough_for_nated_peers(tmp_path) -> None:
    with _OnePublicNode(tmp_path, duration=150) as swarm:
        names = {ns.name for ns in swarm.net.namespaces}
        boot_id = swarm.peer_id("boot")
        both = lambda condition: all(condition(n) for n in ("a", "b"))
        t_private = swarm.wait_until(lambda: both(lambda n: swarm.network(n).reachability == "private"),
                                     "a and b private", 90)
        for name in ("a", "b"):  # decided on the bootstrap's word alone: it is the only public peer
            assert "bootstrap" in swarm.network(name).reachability_reason, swarm.network(name).reachability_reason
        t_reserved = swarm.wait_until(lambda: both(lambda n: any(boot_id in r for r in swarm.network(n).relays)),
                                      "a and b reserved on the bootstrap", 60)
        t_met = swarm.wait_until(lambda: swarm.peer_id("b") in swarm.network("a").connections
                                 or swarm.peer_id("a") in swarm.network("b").connections, "an a-b connection", 90)
        t_merged = swarm.wait_until(lambda: _merged_with(swarm, "a", "b") or _merged_with(swarm, "b", "a"),
                                    "a merged a-b exchange", 90)
        t_direct = swarm.wait_until(lambda: _connection(swarm, "a", "b") == "direct" and _connection(swarm, "b", "a") == "direct",
                                    "a direct a-b connection (hole punched)", 60)
        swarm.wait_until(lambda: swarm.network("a").hole_punched + swarm.network("b").hole_punched >= 1,
                         "status counting the punched hole", 10)
        print(f"one public node: both private at {t_private:.1f} s, both reserved at {t_reserved:.1f} s, "
              f"a-b connected at {t_met:.1f} s, merged at {t_merged:.1f} s, direct at {t_direct:.1f} s")
    assert not names & _namespaces()
    assert not any(p.alive() for p in swarm.peers.values())
