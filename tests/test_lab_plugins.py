"""The lab's plugins: link-speed partner choice and averaged optimizer state, registered through the product's seams."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from partner_sampling import frequencies, members

from lab.plugins import LinkSpeedPartners, register
from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import OPTIMIZER_STATE, make_rule
from murmur.node.net.partners import PARTNER_CHOICES
from murmur.node.net.peers import PeerTable
from murmur.node.ops.run import build_run_parser


def test_link_speed_picks_in_proportion_to_measured_speed() -> None:
    # 50, 20 and 10 Mbit/s partners: each gets about the same share of this peer's exchange time.
    freq = frequencies(LinkSpeedPartners(), members(6.25e6, 2.5e6, 1.25e6))
    assert freq == pytest.approx({"p0": 0.625, "p1": 0.25, "p2": 0.125}, abs=0.02)


def test_an_unmeasured_member_counts_as_the_fastest_so_it_gets_measured() -> None:
    freq = frequencies(LinkSpeedPartners(), members(4e6, 1e6, None))
    assert freq == pytest.approx({"p0": 4 / 9, "p1": 1 / 9, "p2": 4 / 9}, abs=0.02)


def test_link_speed_without_any_measurement_is_uniform_and_says_so() -> None:
    unmeasured = members(None, None)
    entry, reason = LinkSpeedPartners().pick(unmeasured, random.Random(0))
    assert entry in unmeasured and reason == "random pick among 2 live peers (no link measured yet)"
    assert frequencies(LinkSpeedPartners(), unmeasured) == pytest.approx({"p0": 0.5, "p1": 0.5}, abs=0.02)


def test_the_reason_states_the_pick_and_its_probability() -> None:
    _, reason = LinkSpeedPartners().pick(members(3e6), random.Random(0))
    assert reason == "link-speed pick among 1 live peers (its exchanges: 3.00 MB/s; p=1.00)"


def test_registered_options_become_choices_of_murmur_run_and_of_the_node() -> None:
    register()
    args = build_run_parser().parse_args(["--partners", "link-speed", "--optimizer-state", "average"])
    assert (args.partners, args.optimizer_state) == ("link-speed", "average")
    table = PeerTable("self", liveness_timeout=30.0, partners=PARTNER_CHOICES[args.partners]())
    for peer_id in ("fast", "slow"):
        table.observe(peer_id, [f"/dns/{peer_id}/tcp/1"], now=0.0)
    table.record_exchange("fast", 9_000_000, 1.0, now=1.0)
    table.record_exchange("slow", 1_000_000, 1.0, now=1.0)
    rng = random.Random(0)
    picks = Counter(table.select_partner(rng, set())[0].peer_id for _ in range(5_000))  # type: ignore[union-attr]
    assert picks["fast"] / 5_000 == pytest.approx(0.9, abs=0.02)


def test_averaged_optimizer_state_travels_with_the_model() -> None:
    register()
    model = torch.nn.Linear(3, 2)
    replica = Replica("t", model, torch.optim.Adam(model.parameters()), rule=make_rule("work", optimizer_state="average"))
    assert sorted(n for n in replica.exchanged if n.startswith("optimizer.")) == [
        "optimizer.bias.exp_avg", "optimizer.bias.exp_avg_sq", "optimizer.weight.exp_avg", "optimizer.weight.exp_avg_sq",
    ]
