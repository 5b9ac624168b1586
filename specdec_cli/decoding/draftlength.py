"""How many tokens to draft each round, and when to stop a draft early.

The decode loop asks `choose(limit)` before each round and reports `observe(...)`
after it: what was drafted, how much was accepted (and of a tree, how much of its
primary path: the chain the draft length is chosen for), and how long drafting,
verification and the rest of the round (Python's work) took (None when sampling:
there the draft length decides which random numbers each token uses, so a k that
followed the clock would make one seed give different text from run to run; k then
follows acceptance alone). A drafter that knows how sure it is (a draft model) asks
`keep_drafting(i, confidence)` before adding draft token i (0-based), with its top
probability at that point.
"""

from __future__ import annotations

import math
from bisect import bisect
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from specdec_cli.decoding.costmodel import Costs, verify_cost
from specdec_cli.decoding.draft import Draft


class DraftLength(Protocol):
    uses_confidence: bool  # whether keep_drafting needs the draft's top probability

    def begin(self, invariant: bool = False) -> None:
        """A new generation: what the policy learnt is this generation's alone, so that
        a seed gives the same text in any generation (the draft lengths decide which
        random numbers each token uses). An `invariant` one's text is the same whatever
        the lengths (greedy, coupled): it may go on from what the last one learnt."""
        ...

    def choose(self, limit: int) -> int: ...

    def keep_drafting(self, i: int, confidence: float) -> bool: ...

    def observe(
        self,
        draft: Draft,
        accepted: int,
        draft_seconds: float | None,
        verify_seconds: float | None,
        other_seconds: float | None = None,
        beside: int = 0,
        chances: Sequence[float] = (),
        rollback_seconds: float | None = None,
    ) -> None:
        """`accepted`: the draft tokens the target took; `beside`: how many of them lie
        on a tree's branches, past where its path left the primary path; `chances`:
        of a sampled chain, each tested token's chance of acceptance (sampling.overlap);
        `rollback_seconds`: the time the target took to make the round's tokens undoable
        and to undo the rejected ones (Context.rollback_seconds), apart from
        `other_seconds` (the rest of the round's time outside the decode calls)."""
        ...


class FixedLength:
    """Always k (less near the end of -n or of the context), cut short only when the
    draft's confidence falls below p_min."""

    def __init__(self, k: int, p_min: float = 0.0) -> None:
        self.k = k
        self.p_min = p_min
        self.uses_confidence = p_min > 0.0

    def begin(self, invariant: bool = False) -> None:
        pass

    def choose(self, limit: int) -> int:
        return max(0, min(self.k, limit))

    def keep_drafting(self, i: int, confidence: float) -> bool:
        return i == 0 or confidence >= self.p_min

    def observe(self, *outcome: object, **details: object) -> None:
        """A fixed length learns nothing from a round (see DraftLength.observe)."""


class Calibration:
    """How often a draft token is accepted, as a function of the draft's confidence.

    A draft model's top probability is a signal, not a probability of acceptance (a
    small model is often right while unsure), so it is calibrated on what the target
    actually accepted, in bands, starting from the confidence itself as a prior
    (PRIOR_WEIGHT tokens' worth). The bands are finest at the low end, where a small
    draft of a 152k-262k vocabulary puts most of its first choices, and where how often
    they are accepted changes fastest (benchmarks/README.md, trees' first choices).
    """

    EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
    PRIOR_WEIGHT = 2.0

    def __init__(self) -> None:
        self.hits = [0.0] * (len(self.EDGES) + 1)
        self.seen = [0.0] * (len(self.EDGES) + 1)

    def __call__(self, confidence: float) -> float:
        band = bisect(self.EDGES, confidence)
        prior = self.PRIOR_WEIGHT
        return (self.hits[band] + prior * confidence) / (self.seen[band] + prior)

    def record(self, confidence: float, accepted: bool) -> None:
        band = bisect(self.EDGES, confidence)
        self.seen[band] += 1.0
        self.hits[band] += accepted


class PositionAcceptance:
    """The chance that draft token i is accepted once the ones before it were, per
    position: running averages that forget old rounds (`decay`), so that they follow
    the text, starting from `prior`.

    A position not tested lately leans on the one before (`weight` is the trust in its
    own estimate), as a lookup's deep positions must: how far a guess runs is the
    text's. A head's acceptance by depth is its training's: one trained for a single
    step can have a second guess that is never right, which, leaning so, reads as often
    right, and -k auto drafts two tokens where one is best. With `bayes_weight` (a
    head's), a test also moves that trust by Bayes' rule, by how well the position's
    own estimate and the lean each foretold its outcome: a miss where the estimate said
    miss gives back the trust the untested rounds took."""

    # The prior weighs as much as this many rounds while evidence builds up: less, and
    # a few early misses send a fresh run to k=1 for a while.
    PRIOR_ROUNDS = 2
    # The least likelihood an estimate gives an outcome: one surprise never makes an
    # estimate worthless.
    LEAST_LIKELIHOOD = 0.02

    def __init__(self, n: int, prior: float, decay: float, bayes_weight: bool = False) -> None:
        self.prior, self.decay, self.bayes_weight = prior, decay, bayes_weight
        self.accept = [prior] * n  # the running estimate per draft position
        self.weight = [0.0] * n  # how recent the evidence behind each estimate is
        # How many rounds each estimate is a mean of (the prior's to start), forgotten
        # as the text moves on.
        self.evidence = [float(self.PRIOR_ROUNDS)] * n
        self._undrafted = 0  # rounds the policy chose not to draft since the last drafted

    def estimates(self, n: int) -> list[float]:
        """Acceptance per position; one not drafted lately leans on the one before."""
        out, previous = [], self.prior
        for i in range(n):
            w = self.weight[i]
            previous = w * self.accept[i] + (1.0 - w) * previous
            out.append(previous)
        return out

    def record(
        self, drafted: int, accepted: int, planned: bool, chances: Sequence[float] = ()
    ) -> None:
        """A round's draft of `drafted` tokens, of which the first `accepted` were taken
        (tokens up to the first rejection were tested, the ones after it were not).
        `planned`: the policy chose to draft this round. `chances`: where sampling knew
        them, the chance each tested token had of being accepted (sampling.overlap), learnt
        instead of whether it was: the same mean, without the luck of one draw.

        Acceptance follows the text, and rounds the policy chose not to draft move the
        text on too. So after such rounds, what the rounds before them showed is stale
        by as much: the first round drafted after them weighs at least as much as they
        and it would have (without this, probes accepted whole every 8 rounds could not
        bring drafting back after a hard stretch), and the evidence behind the estimates
        shrinks, so that the rounds after it weigh as much (a lucky probe that brought
        drafting back is undone in a round or two, not in the many that a long-run
        average would take). A drafter that had nothing to offer (a lookup without a
        match) says nothing of the text: such rounds do not count."""
        if not drafted:
            self._undrafted += not planned
            return
        stale = self.decay**self._undrafted
        self._undrafted = 0
        fresh = 1.0 - self.decay * stale  # the least weight of what this round tested
        tested = min(drafted, accepted + 1)
        # What each position leaned on before this round (the one before's estimate).
        leans = [self.prior, *self.estimates(tested - 1)] if self.bayes_weight else []
        for i in range(len(self.accept)):
            self.evidence[i] *= stale
            if i < tested:
                hit = chances[i] if i < len(chances) else float(i < accepted)
                # A plain mean over the evidence (and the prior), so that the start is
                # quick; a decayed one once there is enough.
                step = max(fresh, 1.0 / (self.decay * self.evidence[i] + 1.0))
                weight = self.weight[i] + step * (1.0 - self.weight[i])
                if leans:
                    own = self._likelihood(self.accept[i], hit) * weight
                    lean = self._likelihood(leans[i], hit) * (1.0 - weight)
                    weight = max(weight, own / (own + lean))
                self.weight[i] = weight
                self.accept[i] += step * (hit - self.accept[i])
                self.evidence[i] = 1.0 / step
            else:  # drafted, but not this far: the evidence is a round older
                self.weight[i] *= self.decay

    def _likelihood(self, estimate: float, hit: float) -> float:
        """How likely `estimate` made the outcome `hit` (a chance, where sampling knew
        it)."""
        return max(self.LEAST_LIKELIHOOD, estimate * hit + (1.0 - estimate) * (1.0 - hit))


class RunningMean:
    """A mean of what the rounds show: plain at first (a generation is too short to
    wait for a slow one), then forgetting old rounds at `rate`."""

    def __init__(self) -> None:
        self.value, self._n = 0.0, 0

    @property
    def seen(self) -> bool:
        return self._n > 0

    def add(self, sample: float, rate: float) -> None:
        self._n += 1
        self.value += max(rate, 1.0 / self._n) * (sample - self.value)


class RoundCosts:
    """What a round costs, in seconds, on the machine as the rounds show it.

    The relative costs of the batch sizes keep their measured values, which were taken
    side by side (learning them one size at a time would mix in the machine's drift);
    the seconds of a target token and of a draft call follow the machine as it runs,
    and so does a round's time outside llama.cpp (Python's), which favours longer drafts
    (left out, short ones looked cheaper than they ran). A drafting round spends more of
    it than one without a draft (the drafter's own work, the draft staged, its rows
    read), about the same whatever its length: once rounds of both kinds were timed,
    they are priced apart (priced as one, a draft that only broke even by the decode
    calls kept drafting, slower than the target alone). Until then, the one kind seen
    stands for both. A round without a draft costs the same whichever policy had it:
    every policy of a decoder learns from the one `plain` mean (a lookup's policy beside
    a model's never has such a round). So does
    the time the target takes to make a draft undoable and to undo its rejected tokens,
    which only drafting rounds pay: next to nothing for an attention cache, but where a
    recurrent state must be copied (a family without llama.cpp's snapshots, a draft
    longer than they cover) the copies run where its layers do, over RPC a round trip
    each.
    """

    def __init__(self, costs: Costs, plain: RunningMean | None = None) -> None:
        self.target_seconds = t = costs.target_seconds
        self.draft_seconds = costs.draft_over_target * t  # a draft call's
        self.calls_per_token = costs.calls_per_token
        self.calls_per_round = costs.calls_per_round
        self.verify = costs.verify
        self.switch = costs.switch
        # A round's time outside the decode calls, without a draft and with one
        self.plain = RunningMean() if plain is None else plain
        self.drafting = RunningMean()
        self.rollback = RunningMean()  # a drafting round's undoing (see the class)
        self._last_batch = -1  # the last verification's batch size

    def of(self, k: int, survive: float = 0.0) -> float:
        """Seconds for a round drafting k tokens (without a graph rebuild), when the
        previous round's draft was accepted whole with probability `survive`: then the
        draft model has two tokens to catch up on instead of one (each a target token's
        worth of calls, for a draft of another vocabulary)."""
        verifying = self.verify[k + 1] * self.target_seconds + self.python(k)
        if not k:
            return verifying
        calls = (k + survive) * self.calls_per_token + self.calls_per_round
        return calls * self.draft_seconds + self.rollback.value + verifying

    def python(self, k: int) -> float:
        """A round's time outside the decode calls, drafting k tokens (see the class)."""
        mine, other = (self.drafting, self.plain) if k else (self.plain, self.drafting)
        return (mine if mine.seen else other).value

    def modelled(self, calls: int, batch: int) -> tuple[float, float]:
        """Drafting's and verification's seconds for a round that was not timed."""
        return calls * self.draft_seconds, verify_cost(self.verify, batch) * self.target_seconds

    def learn(
        self,
        calls: int,
        batch: int,
        seconds: tuple[float, float],
        other_seconds: float | None,
        rate: float,
        rollback_seconds: float | None = None,
    ) -> None:
        """A round's draft calls, batch size, and drafting's and verification's seconds;
        `rate`: how fast acceptance is learnt (costs learn at a tenth of it: they drift
        slowly, with the machine, and one noisy round must not move them much);
        `rollback_seconds`: making its tokens undoable and undoing the rejected ones
        took that (None: it drafted nothing, or was not timed)."""
        draft_seconds, verify_seconds = seconds
        slow = rate / 10
        if calls:
            self.draft_seconds += slow * (draft_seconds / calls - self.draft_seconds)
        if batch == self._last_batch:  # a pass at a new batch size also pays a rebuild
            per_token = verify_seconds / verify_cost(self.verify, batch)
            self.target_seconds += slow * (per_token - self.target_seconds)
        self._last_batch = batch
        if other_seconds is not None:  # (a batch of one drafted nothing)
            python = self.drafting if batch > 1 else self.plain
            python.add(max(0.0, other_seconds), rate)
        if rollback_seconds is not None:
            self.rollback.add(rollback_seconds, rate)


def expected_rounds(acceptance: list[float]) -> Iterator[tuple[int, tuple[float, float]]]:
    """For k from 0 to len(acceptance): k, and for a round drafting k tokens its expected
    tokens (1 + a1 + a1*a2 + ...: the target's own, and each draft token that survives)
    and the chance that all k are accepted, when draft token i is accepted with
    acceptance[i] once the ones before it were."""
    survive = expected = 1.0
    yield 0, (expected, survive)
    for k, a in enumerate(acceptance, start=1):
        survive *= a
        expected += survive
        yield k, (expected, survive)


@dataclass(frozen=True)
class Pricing:
    """What measured costs decide for -k auto before any round (see AutoLength)."""

    costs: Costs
    ladder: list[int]  # the useful lengths
    first_rung: int  # where drafting starts again after a stretch without
    first_k: int  # the steady choice's start
    first_gap: int  # rounds before a fresh schedule's first probe


class Learnt(NamedTuple):
    """What -k auto has learnt in a generation (see AutoLength.begin)."""

    costs: RoundCosts
    positions: PositionAcceptance
    calibration: Calibration
    rate: float  # tokens/s
    idle: int  # rounds without a draft since the last probe
    probe_gap: int  # rounds before the next probe
    k: int  # the steady choice


class AutoLength:
    """Draft as many tokens as maximise the expected tokens per second.

    Expected tokens of a k-token draft: 1 + a1 + a1*a2 + ... + a1*...*ak, where ai is
    the chance that draft token i is accepted once the ones before it were. Its cost:
    k draft calls (one more after a round accepted whole) and one target pass over k+1
    tokens: the measured `costs`, rescaled as the rounds show the machine speeding up
    or slowing down. The ai are running
    averages per position that forget old rounds (`decay`), so k follows the text.

    k moves one step at a time, towards the length the estimates rate best, and only
    when going there pays for itself: every change of batch size costs llama.cpp a
    rebuild of its compute graph, which a steady k never pays, and the estimates
    beyond the positions drafted lately are guesses. A step goes to the next length
    that is the best for some acceptance rate (batch costs are uneven: on the
    benchmark pair k=2 never is). Replayed on real acceptance patterns
    (benchmarks/replay_draft_length.py), choosing the best k afresh each round, or
    holding each choice for a few rounds, lost 1-7 % to the best fixed k; this rule
    drafts what the best fixed k drafts on the benchmark pair, and comes within about
    1 % of the best fixed k where that changes from prompt to prompt.

    With `uses_confidence` (a draft model and --draft-p-min), the draft's confidence
    refines the plan while drafting: it stops early when the tokens it would still
    add, judged by its confidence in the next one (calibrated against what the target
    accepted), are worth less than the time their verification would take at the
    running rate (tokens per second). Measured on the benchmark pair, that early stop
    cost more in graph rebuilds than it saved, so it is only on where p_min asks for
    confidence anyway.
    """

    # A change of k must win back the two graph rebuilds it costs (now, and when k
    # changes again) within this many rounds.
    PAYBACK_ROUNDS = 6
    # ...and must promise at least this much: measured batch costs vary by about as
    # much between measurements (the machine drifts), so a smaller gain is noise.
    MIN_GAIN = 0.05
    # Nor does it grow by more than this in one step: the estimates past the drafted
    # positions are extrapolated, and a long jump on them chases a lucky streak.
    MAX_CLIMB = 2
    # Not drafting, a probe every PROBE_GAP rounds; each probe after which the estimates
    # still say drafting does not pay doubles the gap, up to MAX_PROBE_GAP: a draft that
    # never pays then costs a few percent at most. A probe's own acceptance is no
    # success: a draft can agree and still cost more than it saves, and a sampled probe
    # is accepted by luck as often as its chance says. Only drafting that pays again
    # brings the gap back.
    PROBE_GAP = 8
    MAX_PROBE_GAP = 64
    # A probe that costs several rounds (beyond a round without a draft) is spaced as
    # many times PROBE_GAP at least, and doubles on as far as keeps probing under
    # PROBE_SHARE of the time (at most MOST_PROBE_GAP rounds apart): a draft of another
    # vocabulary on a GPU, where one draft call costs half a target token, reads the
    # text since its last probe and drafts 3-4 calls a target token, and the batch size
    # changes twice (benchmarks/README.md, "On a GPU: Gemma 3 270M").
    PROBE_SHARE = 0.02
    MOST_PROBE_GAP = 1024
    PRIOR = 0.8  # the acceptance a fresh run starts from

    def __init__(
        self,
        costs: Costs,
        k_min: int,
        k_max: int,
        p_min: float = 0.0,
        uses_confidence: bool = True,
        decay: float = 0.93,
        prior: float = PRIOR,
        margin: float = 0.0,
        first: Costs | None = None,
        bayes_weight: bool = False,
    ) -> None:
        """`margin`: how much more than no draft drafting must promise to go on, for a
        drafter whose rounds cost more than the costs price (0: drafting goes on while
        it is the best choice, or within MIN_GAIN of it, as any k does). `bayes_weight`:
        a drafting head's (see PositionAcceptance).

        `first`: what a rejection-sampled generation prices with (None: `costs`). Its
        text follows its draft lengths, so a seed reproduces it only while its costs stay
        the same from run to run: the first measurement kept, where `costs` (the median
        of the measurements, see costcache) move in the first runs."""
        self.margin = margin
        # Never draft past the batch sizes whose cost is known.
        self.k_max = min(k_max, max(costs.verify) - 1)
        self.k_min, self.p_min = min(k_min, self.k_max), p_min
        self.uses_confidence = uses_confidence
        self.prior, self.decay, self.bayes_weight = prior, decay, bayes_weight
        self.learn = 1.0 - decay  # how fast the rate and the costs follow the rounds
        # Python's time in a round without a draft, as the generations whose text no
        # draft changes show it (see RoundCosts and share_plain_rounds).
        self._plain = RunningMean()
        # What the measured costs alone decide, the same at every generation's start;
        # for generations whose text no draft changes (invariant), and for the others.
        settled = self._pricing(costs)
        alone = settled if first in (None, costs) else self._pricing(first)
        self._pricings = {True: settled, False: alone}
        # Where the last invariant generation left its schedule: idle rounds, and the gap.
        self._invariant = False
        self._invariant_learnt: Learnt | None = None  # where the last invariant one ended
        self.begin()

    def _pricing(self, costs: Costs) -> Pricing:
        """What these measured costs decide before any round (priced by the methods
        that price rounds, so with them as this generation's costs until `begin`)."""
        self.costs = RoundCosts(costs)
        ladder = self._useful_lengths()
        # Where drafting starts again after a stretch without: the shortest useful length
        # (with a large vocabulary, verifying 2 tokens can cost more than 4: then it is 3).
        first_rung = min([n for n in ladder if n > 0], default=1)
        # The gap before a fresh schedule's first probe, priced as the measured costs
        # price a probe (the shortest, reading the text since the last one in one more
        # call), as the gaps after a probe are: a sampled generation starts its schedule
        # afresh, and on a GPU probes at 8, 24 and 56 rounds cost a 128-token one a tenth.
        # (Python's time per round is not known yet: `of` counts none of it.)
        probe = self.costs.of(first_rung, survive=1.0)
        first_gap = self._priced_gap(self._probe_extra(probe))
        # The steady choice's start: the best k under the prior alone.
        first_k = self._best_at(self.prior)
        return Pricing(costs, ladder, first_rung, first_k, first_gap)

    @property
    def ladder(self) -> list[int]:
        """The useful lengths of this generation's pricing."""
        return self.pricing.ladder

    def begin(self, invariant: bool = False) -> None:
        """A rejection-sampled generation starts again from the measured costs and the
        prior: its text follows its draft lengths, and must be what it would be alone.
        An invariant generation (greedy, coupled: its text is the same whatever k) goes
        on from where the last invariant one left off: the acceptance it learnt, the
        costs it followed on the clock, and its probing. The same drafter on the same
        model guesses as well in the next request, and relearning it from the optimistic
        prior at every request's start drafted where it did not pay, over and over (a
        lookup whose guesses the target took two times in five on real prompts, priced
        at first as if it were four in five); a draft that stopped paying must not be
        probed afresh either."""
        if self._invariant:
            self._invariant_learnt = self._learnt()
        self._invariant = invariant
        # This generation's pricing: its kind's measured costs, and what they decide.
        self.pricing = self._pricings[invariant]
        kept = self._invariant_learnt if invariant else None
        if kept is None:
            kept = Learnt(
                RoundCosts(self.pricing.costs, self._plain if invariant else None),
                PositionAcceptance(self.k_max, self.prior, self.decay, self.bayes_weight),
                Calibration(),
                1.0 / self.pricing.costs.target_seconds,  # tokens/s; target-only to start
                0,
                self.pricing.first_gap,
                self.pricing.first_k,
            )
        self.costs, self.positions, self.calibration, self.rate = kept[:4]
        # Rounds without a draft since the last probe, and before the next one; the
        # steady choice of k.
        self._idle, self._probe_gap, self._k = kept[4:]
        self._probing = False
        # The current round: its planned length, position estimates, and the chance
        # that the draft so far is accepted whole.
        self._plan = 0
        self._estimates: list[float] = []
        self._survive = 1.0

    def share_plain_rounds(self, other: AutoLength) -> None:
        """Price a round without a draft as `other` learns it: another policy of the same
        decoder, which may be the one those rounds fall to (see RoundCosts). Before the
        first generation."""
        self._plain = other._plain

    def _learnt(self) -> Learnt:
        return Learnt(
            self.costs,
            self.positions,
            self.calibration,
            self.rate,
            self._idle,
            self._probe_gap,
            self._k,
        )

    def _best_at(self, acceptance: float) -> int:
        """The best k if every draft token were accepted at this rate."""
        rates = self.expected_rates([acceptance] * self.k_max, self.k_max)
        return max(range(self.k_min, self.k_max + 1), key=rates.__getitem__)

    def _useful_lengths(self) -> list[int]:
        """The draft lengths that are the best for some acceptance rate. k steps over
        the others: a climb from 1 to 3 would stall at a never-best 2."""
        return sorted({self._best_at(i / 100) for i in range(100)})

    def expected_rates(self, estimates: list[float], top: int) -> list[float]:
        """Expected tokens per second of k-token drafts, for every k from 0 to `top`."""
        return list(self.rates_at(estimates, range(top + 1)).values())  # in k's order

    def rates_at(self, estimates: list[float], lengths: Collection[int]) -> dict[int, float]:
        """Expected tokens per second of k-token drafts, for each k of `lengths` (each at
        most len(estimates)): a round's choice prices its few candidates, not every
        length up to k_max (pricing them all was most of -k auto's Python a round)."""
        rounds = expected_rounds(estimates[: max(lengths)])
        return {
            k: expected / self.costs.of(k, survive)
            for k, (expected, survive) in rounds
            if k in lengths
        }

    def expected_tokens(self, top: int) -> list[float]:
        """Expected tokens of a round drafting k tokens, for every k from 0 to `top`, on
        the estimates as they stand (for fitting several slots' drafts to one batch)."""
        return [expected for _, (expected, _) in expected_rounds(self.positions.estimates(top))]

    def choose(self, limit: int) -> int:
        top = min(self.k_max, limit)
        estimates = self.positions.estimates(top)
        k = self._step(estimates, min(self._k, top), top)
        if top >= self._k:  # a round cut short by -n or the context is no choice
            self._k = k
        if k == 0 and top > 0:
            # Estimates only move when something is drafted: probe now and then, for
            # one round.
            self._idle += 1
            self._probing = self._idle >= self._probe_gap
            if self._probing:
                self._idle, k = 0, self._probe_length(estimates, top)
        self._plan, self._estimates, self._survive = k, estimates, 1.0
        return k

    def _probe_length(self, estimates: list[float], top: int) -> int:
        """A probe's length, up to the first rung: the one the estimates rate best.
        Where they are low (a draft that never agrees) that is the cheapest; where they
        are middling, a longer probe also tests the positions past the first, and
        yields more if the text has turned easy."""
        longest = min(self.pricing.first_rung, top)
        rates = self.expected_rates(estimates, longest)
        return max(range(1, longest + 1), key=rates.__getitem__)

    def _step(self, estimates: list[float], k: int, top: int) -> int:
        """k, or the next useful length towards the best one if going there is worth
        the change. Each step is judged again on the rounds it drafts; a slope of small
        steps (a flat cost curve) is followed too, which steps judged one by one did
        not (none promised MIN_GAIN)."""
        floor = min(self.k_min, top)
        if k < floor:
            return floor
        rungs = [n for n in self.ladder if floor <= n <= top]
        if not rungs:
            return k
        rates = self.rates_at(estimates, {k, *rungs})
        now = rates[k]
        rate, best = max((rates[n], n) for n in rungs)
        if k and rungs[0] == 0 and rate < rates[0] * (1.0 + self.margin):
            # Drafting that promises less than `margin` over none stops, whatever a
            # change costs (no draft is never slower than the target alone).
            return max(n for n in rungs if n < k)
        costs = self.costs
        gain = (rate - now) * costs.of(best)  # tokens a round
        rebuilds = 2 * costs.switch * costs.target_seconds * now  # tokens two rebuilds cost
        worth_it = rate > now * (1.0 + self.MIN_GAIN) and gain * self.PAYBACK_ROUNDS > rebuilds
        if not worth_it or best == k:
            return k
        step = max(n for n in rungs if n < k) if best < k else min(n for n in rungs if n > k)
        # (Starting to draft again goes straight to the first rung, however long.)
        if step <= max(k + self.MAX_CLIMB, self.pricing.first_rung):
            return step
        # The next rung lies further than a climb goes (measured curves have bumps: a
        # ladder 0-4, then 7): climb as far as one may, where that rates above k, or k
        # would stay below the gap for good.
        reach = k + self.MAX_CLIMB
        return reach if self.rates_at(estimates, {reach})[reach] > now else k

    def keep_drafting(self, i: int, confidence: float) -> bool:
        if i >= max(1, self.k_min) and confidence < self.p_min:
            return False
        a = self.calibration(confidence)
        if i >= max(1, self.k_min):
            # Stopping here saves the rest of the plan's drafting and verification (less
            # two graph rebuilds: to the unplanned batch size and back) and loses what
            # the rest of the draft would add.
            rest, chain = 1.0, 1.0
            for later in self._estimates[i + 1 : self._plan]:
                chain *= later
                rest += chain
            lost = self._survive * a * rest
            c = self.costs
            saved = (self._plan - i) * c.draft_seconds + (
                c.verify[self._plan + 1] - c.verify[i + 1] - 2 * c.switch
            ) * c.target_seconds
            if lost < self.rate * saved:
                return False
        self._survive *= a
        return True

    def observe(
        self,
        draft: Draft,
        accepted: int,
        draft_seconds: float | None,
        verify_seconds: float | None,
        other_seconds: float | None = None,
        beside: int = 0,
        chances: Sequence[float] = (),
        rollback_seconds: float | None = None,
    ) -> None:
        # A tree's depth is the chain length it stands for; its batch is all its nodes.
        n, batch = draft.depth, len(draft.tokens) + 1
        if draft_seconds is None or verify_seconds is None:  # untimed: the modelled costs
            seconds = self.costs.modelled(draft.calls, batch)
        else:
            seconds = (draft_seconds, verify_seconds)
        self.rate += self.learn * ((accepted + 1) / sum(seconds) - self.rate)
        rollback = rollback_seconds if n else None
        self.costs.learn(draft.calls, batch, seconds, other_seconds, self.learn, rollback)
        # The estimates are the chain's: a tree's path that leaves its primary path
        # counts as the chain's miss there. Counted whole, the tree's rescues made every
        # position look surer and k deeper, and a tree's nodes go to width instead.
        chain = accepted - beside
        if draft.parents is None:  # a tree's confidences are per node, not position
            for i, confidence in enumerate(draft.confidences[: min(n, chain + 1)]):
                self.calibration.record(confidence, i < chain)
        self.positions.record(n, chain, self._plan > 0, chances)
        self._after_probe(n, sum(seconds))

    def _after_probe(self, n: int, seconds: float) -> None:
        """The gap before the next probe, after a round that drafted n tokens and took
        `seconds` (drafting and verification)."""
        if self._probing:
            self._probing = False
            estimates = self.positions.estimates(self.k_max)
            if self._step(estimates, 0, self.k_max) > 0:
                self._probe_gap = self.PROBE_GAP
                return
            extra = self._probe_extra(seconds)
            priced = min(math.ceil(extra / self.PROBE_SHARE), self.MOST_PROBE_GAP)
            gap = max(2 * self._probe_gap, self._priced_gap(extra))
            self._probe_gap = min(gap, max(self.MAX_PROBE_GAP, priced))
        elif n:
            self._probe_gap = self.PROBE_GAP

    def _priced_gap(self, extra: float) -> int:
        """PROBE_GAP rounds, or as many times more as a probe costs `extra` rounds."""
        return max(self.PROBE_GAP, math.ceil(extra * self.PROBE_GAP))

    def _probe_extra(self, seconds: float) -> float:
        """What a probe that took `seconds` (drafting and verification) cost beyond a
        round without a draft, in such rounds: the rebuilds to its batch size and back
        counted."""
        costs = self.costs
        plain = costs.of(0)
        rebuilds = 2 * costs.switch * costs.target_seconds
        return max(0.0, (seconds + rebuilds + costs.python(1)) / plain - 1.0)
