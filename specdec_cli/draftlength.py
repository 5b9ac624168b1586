"""How many tokens to draft each round, and when to stop a draft early.

The decode loop asks `choose(limit)` before each round and reports `observe(draft,
accepted)` after it. A drafter that knows how sure it is (a draft model) asks
`keep_drafting(i, confidence)` before adding draft token i (0-based), with its top
probability at that point.
"""

from __future__ import annotations

from typing import Protocol

from specdec_cli.costmodel import Costs
from specdec_cli.drafters import Draft


class DraftLength(Protocol):
    uses_confidence: bool  # whether keep_drafting needs the draft's top probability

    def choose(self, limit: int) -> int: ...

    def keep_drafting(self, i: int, confidence: float) -> bool: ...

    def observe(self, draft: Draft, accepted: int) -> None: ...


class FixedLength:
    """Always k (less near the end of -n or of the context), cut short only when the
    draft's confidence falls below p_min."""

    def __init__(self, k: int, p_min: float = 0.0) -> None:
        self.k = k
        self.p_min = p_min
        self.uses_confidence = p_min > 0.0

    def choose(self, limit: int) -> int:
        return max(0, min(self.k, limit))

    def keep_drafting(self, i: int, confidence: float) -> bool:
        return i == 0 or confidence >= self.p_min

    def observe(self, draft: Draft, accepted: int) -> None:
        pass


class Calibration:
    """How often a draft token is accepted, as a function of the draft's confidence.

    A draft model's top probability is a signal, not a probability of acceptance (a
    small model is often right while unsure), so it is calibrated on what the target
    actually accepted, in bins, starting from the confidence itself as a prior.
    """

    BINS = 10
    PRIOR_WEIGHT = 4.0

    def __init__(self) -> None:
        self.hits = [0.0] * self.BINS
        self.seen = [0.0] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, int(confidence * self.BINS))

    def __call__(self, confidence: float) -> float:
        b = self._bin(confidence)
        prior = (b + 0.5) / self.BINS
        return (self.hits[b] + self.PRIOR_WEIGHT * prior) / (self.seen[b] + self.PRIOR_WEIGHT)

    def record(self, confidence: float, accepted: bool) -> None:
        b = self._bin(confidence)
        self.seen[b] += 1.0
        self.hits[b] += accepted


class AutoLength:
    """Draft as many tokens as maximise the expected tokens per unit of time.

    Expected tokens of a k-token draft: 1 + a1 + a1*a2 + ... + a1*...*ak, where ai is
    the chance that draft token i is accepted once the ones before it were. Its cost:
    k draft calls plus one target pass over k+1 tokens (`costs`, measured).

    With a draft model, ai comes from the draft's confidence in token i, calibrated
    against what the target accepted so far: drafting goes on while one more token
    raises the expected tokens per unit of time, so drafts run long through easy
    stretches and stop at the first hard token. Without confidences (n-gram lookup),
    ai is a running average per position that forgets old rounds (`decay`), and k is
    chosen before the round.
    """

    def __init__(
        self,
        costs: Costs,
        k_min: int,
        k_max: int,
        p_min: float = 0.0,
        uses_confidence: bool = True,
        decay: float = 0.9,
        prior: float = 0.6,
    ) -> None:
        self.c = costs.draft_over_target
        self.verify = costs.verify
        self.k_min, self.k_max, self.p_min = k_min, k_max, p_min
        self.uses_confidence = uses_confidence
        self.decay = decay
        self.prior = prior
        self.calibration = Calibration()
        self.accept = [prior] * k_max  # running acceptance estimate per draft position
        self.weight = [0.0] * k_max  # how recent the evidence behind each estimate is
        self._idle = 0
        self.rate = 1.0 / self.verify[1]  # tokens per unit of cost, as target-only
        self._survive = 1.0  # within a round: the chance the draft so far is all accepted

    def position_estimates(self, n: int) -> list[float]:
        """Acceptance per position; one not drafted lately leans on the one before."""
        out, previous = [], self.prior
        for i in range(n):
            w = self.weight[i]
            previous = w * self.accept[i] + (1.0 - w) * previous
            out.append(previous)
        return out

    def choose(self, limit: int) -> int:
        top = min(self.k_max, limit)
        self._survive = 1.0
        if self.uses_confidence:
            return max(0, top)  # keep_drafting decides where the draft ends
        best_k, best_rate = 0, 1.0 / self.verify[1]
        survive = expected = 1.0
        for k, a in enumerate(self.position_estimates(top), start=1):
            survive *= a
            expected += survive
            rate = expected / (k * self.c + self.verify[k + 1])
            if rate > best_rate:
                best_k, best_rate = k, rate
        k = max(best_k, min(self.k_min, top))
        if k == 0 and top > 0:
            # Estimates only move when something is drafted: probe now and then.
            self._idle += 1
            if self._idle % 8 == 0:
                k = 1
        return k

    def keep_drafting(self, i: int, confidence: float) -> bool:
        if i >= self.k_min and confidence < self.p_min:
            return False
        # One more token is worth it if what it is expected to add beats what the same
        # cost buys on average (Dinkelbach's rule for maximising a long-run ratio).
        gain = self._survive * self.calibration(confidence)
        extra = self.c + self.verify[i + 2] - self.verify[i + 1]
        if i >= max(1, self.k_min) and gain < self.rate * extra:
            return False
        self._survive = gain
        return True

    def observe(self, draft: Draft, accepted: int) -> None:
        n = len(draft.tokens)
        # The long-run rate, in tokens per unit of cost, that drafting must beat.
        round_rate = (accepted + 1) / (n * self.c + self.verify[n + 1])
        self.rate += (1.0 - self.decay) * (round_rate - self.rate)
        # Tokens up to the first rejection were tested; the ones after it were not.
        tested = min(n, accepted + 1)
        for i, confidence in enumerate(draft.confidences[:tested]):
            self.calibration.record(confidence, i < accepted)
        for i in range(self.k_max):
            if i < tested:
                hit = 1.0 if i < accepted else 0.0
                self.accept[i] += (1.0 - self.decay) * (hit - self.accept[i])
                self.weight[i] += (1.0 - self.decay) * (1.0 - self.weight[i])
            else:
                self.weight[i] *= self.decay
