"""Vetting a partner before a merge: its work claim, its model's distance, and, optionally, its model's score.

`Vetting.vet` is the whole decision the averager takes once both models have crossed
(and the lab's poisoning benchmark takes the same way): pure, given `now`, and
explained. It returns the merge to apply, or None to refuse it, with the reason, and
the offences (strikes) the partner committed on the way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from murmur.node.learn.replica import Snapshot
from murmur.node.learn.rules import MergeRule, MixDecision
from murmur.node.learn.scoring import MergeScorer, Score, Trust
from murmur.node.learn.screening import ClippedGossip, WorkClaimLimiter
from murmur.protocol.codec import WireState


@dataclass(frozen=True)
class Verdict:
    """The merge to apply (None: refuse it), why, and what the partner did that earns a strike.

    `distance` is the L2 distance to the partner's model when screening measured it;
    `score` is the scored merge's when one was scored.
    """

    decision: MixDecision | None
    reason: str
    offences: tuple[str, ...] = ()
    distance: float | None = None
    score: Score | None = None


@dataclass
class Vetting:
    """A partner's claim through `claims`, its model through `screening`, then through `scorer` if given.

    Which merges are scored is `trust`'s choice (drawn from `rng`); a peer that failed a
    score lately is refused unscored for a while, and one whose scores show no evidence of
    training (`Trust.lacks_evidence`) is refused too. A scored merge that would raise the
    held loss by more than `strike_factor` × the scorer's tolerance is an offence as well
    as a refusal: honest models never come near it.
    """

    claims: WorkClaimLimiter = field(default_factory=WorkClaimLimiter)
    screening: ClippedGossip = field(default_factory=ClippedGossip)
    scorer: MergeScorer | None = None
    trust: Trust = field(default_factory=Trust)
    rng: random.Random = field(default_factory=random.Random)
    strike_factor: float = 10.0

    def vet(
        self,
        peer_id: str,
        rule: MergeRule,
        snapshot: Snapshot,
        remote: WireState,
        claimed_work: float,
        fresh: tuple[float, float] | None,
        local_rate: float,
        now: float,
    ) -> Verdict:
        """Whether and how to merge `peer_id`'s `remote` model into ours (`snapshot`), by `rule`.

        `claimed_work` is the partner's stated work; `fresh` is (ours, the partner's stated)
        fresh work when both sides stated it. `local_rate` (our samples/s) and `now`
        (Unix seconds) bound the claim.
        """
        offences: list[str] = []
        claim = self.claims.credit(peer_id, claimed_work, snapshot.work, local_rate, now)
        if claim.offence:
            offences.append(claim.reason)
        # The claim's cap applies to the partner's fresh work too.
        credited_fresh = None if fresh is None else (fresh[0], min(fresh[1], claim.work))
        decision = rule.decide(snapshot.work, claim.work, credited_fresh)
        if not decision.screen:
            return Verdict(decision, claim.reason, tuple(offences))
        screening = self.screening.screen(snapshot.state, remote)
        if screening.offence:
            offences.append(f"rejected model: {screening.reason}")
        if screening.pull is None:
            return Verdict(None, screening.reason, tuple(offences), screening.distance)
        decision = replace(decision, remote_share=decision.remote_share * screening.pull)
        if self.scorer is None or decision.remote_share == 0:
            return Verdict(decision, screening.reason, tuple(offences), screening.distance)
        probation = self.trust.on_probation(peer_id)
        if probation:
            return Verdict(None, probation, tuple(offences), screening.distance)
        score = None
        if self.trust.should_score(peer_id, self.rng):
            score = self.scorer.score(snapshot.state, remote, decision.remote_share)
            self.trust.record(peer_id, score)
            if not score.passed:
                if score.change > self.strike_factor * self.scorer.tolerance:
                    offences.append(score.reason)
                return Verdict(None, score.reason, tuple(offences), screening.distance, score)
        idle = self.trust.lacks_evidence(peer_id)
        if idle:
            return Verdict(None, idle, tuple(offences), screening.distance, score)
        reason = f"{screening.reason}; {score.reason}" if score else screening.reason
        return Verdict(decision, reason, tuple(offences), screening.distance, score)
