"""Draft length policies, without a model: hand-made costs and acceptance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.draft import Draft
from specdec_cli.decoding.draftlength import AutoLength, Calibration, FixedLength, RoundCosts

# A target pass over n tokens costs 1 + 0.1 (n - 1) of one token (memory-bound), a draft
# call 0.05: long drafts are cheap, so acceptance alone decides.
CHEAP = Costs(
    target_seconds=0.01,
    draft_over_target=0.05,
    verify={n: 1.0 + 0.1 * (n - 1) for n in range(1, 18)},
)


def draft_of(n: int, confidence: float = 0.9) -> Draft:
    return Draft(tokens=list(range(n)), confidences=[confidence] * n, calls=n)


def feed(policy: AutoLength, acceptance: float, rounds: int = 60) -> list[int]:
    """Run rounds where each draft token is accepted with a fixed pattern."""
    chosen = []
    for r in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        n = 0
        while n < k and (n + r) % round(1 / (1 - acceptance)) != 0:
            n += 1  # accept until the pattern says reject
        t = CHEAP.target_seconds
        policy.observe(draft_of(k), n, k * CHEAP.draft_over_target * t, CHEAP.verify[k + 1] * t)
    return chosen


def test_fixed_length_respects_limit_and_p_min() -> None:
    policy = FixedLength(5, p_min=0.5)
    assert policy.choose(3) == 3 and policy.choose(10) == 5 and policy.choose(0) == 0
    assert policy.uses_confidence
    assert policy.keep_drafting(0, 0.1)  # the first token is always drafted
    assert not policy.keep_drafting(2, 0.4)
    assert policy.keep_drafting(2, 0.6)
    assert not FixedLength(5).uses_confidence


def test_calibration_starts_at_confidence_and_learns() -> None:
    calibration = Calibration()
    assert abs(calibration(0.35) - 0.35) < 1e-9
    for _ in range(200):
        calibration.record(0.35, True)  # an unsure draft that is nonetheless always right
    assert calibration(0.35) > 0.95
    assert abs(calibration(0.85) - 0.85) < 1e-9  # other bins untouched
    for _ in range(200):
        calibration.record(0.03, True)  # a small draft of a large vocabulary
    assert calibration(0.03) > 0.95
    assert abs(calibration(0.07) - 0.07) < 1e-9  # the low end is banded finely


def test_auto_drafts_long_when_accepted_and_short_when_not() -> None:
    easy = feed(AutoLength(CHEAP, 0, 16, uses_confidence=False), acceptance=0.95)
    hard = feed(AutoLength(CHEAP, 0, 16, uses_confidence=False), acceptance=0.5)
    assert sum(easy[-20:]) / 20 > 2 * sum(hard[-20:]) / 20
    assert max(easy) <= 16


def test_python_time_per_round_favours_longer_drafts() -> None:
    """A round's time outside llama.cpp is the same for any k: a policy that leaves it
    out takes short drafts for cheaper than they run."""
    steep = Costs(0.01, 0.05, {n: 1.0 + 0.45 * (n - 1) for n in range(1, 18)})

    def steady_k(other_seconds: float | None) -> int:
        policy = AutoLength(steep, 0, 16, uses_confidence=False)
        for r in range(80):
            k = policy.choose(100)
            n = 0
            while n < k and (n + r) % 4 != 0:
                n += 1  # three in four accepted
            t = steep.target_seconds
            seconds = (k * steep.draft_over_target * t, steep.verify[k + 1] * t)
            policy.observe(draft_of(k), n, *seconds, other_seconds)
        return k

    untimed, fast, slow = steady_k(None), steady_k(0.0), steady_k(0.02)
    assert untimed == fast == 2
    assert slow == 3  # two target tokens' worth of Python a round: one more token pays


def late_drafting_share(
    python: tuple[float, float],
    rollback_seconds: float = 0.0,
    missed: int = 0,
    slope: float = 0.1,
) -> float:
    """The share of late rounds that draft, where a round spends python[0] seconds
    outside the decode calls without a draft and python[1] with one, a drafting round
    `rollback_seconds` undoing, and its draft tokens are accepted three in four after
    the first `missed` rounds (none accepted before); a target pass over n tokens costs
    1 + slope (n - 1) of one token (0.1: memory-bound)."""
    costs = Costs(0.01, 0.05, {n: 1.0 + slope * (n - 1) for n in range(1, 18)})
    policy = AutoLength(costs, 0, 8, uses_confidence=False)
    policy.begin(invariant=True)
    chosen = []
    for r in range(missed + 160):
        k = policy.choose(100)
        chosen.append(k)
        n = 0
        while r >= missed and n < k and (n + r) % 4 != 0:
            n += 1  # three in four accepted
        t = costs.target_seconds
        seconds = (k * costs.draft_over_target * t, costs.verify[k + 1] * t)
        other = python[k > 0]
        policy.observe(draft_of(k), n, *seconds, other, rollback_seconds=rollback_seconds)
    late = chosen[-80:]
    return sum(k > 0 for k in late) / len(late)


def test_drafting_rounds_pay_their_rollback_alone() -> None:
    """Making a draft undoable and undoing it (a recurrent state's copies: over RPC, a
    round trip each) only drafting rounds pay. Taken for time that every round pays
    (Python's), -k auto drafted on where that made it slower than the target alone."""
    assert late_drafting_share((0.0, 0.0)) == 1.0
    assert late_drafting_share((0.03, 0.03)) == 1.0  # three target tokens a round
    assert late_drafting_share((0.0, 0.0), rollback_seconds=0.03) < 0.2  # probes only


def test_drafting_rounds_pay_their_own_python_time() -> None:
    """A drafting round spends more time outside the decode calls than one without a
    draft (the drafter's own work, the draft staged, its rows read). Priced at one mean
    for both, -k auto drafted where the draft paid by the decode calls alone, slower
    than the target alone (the Q4_0 pair, benchmarks/README.md "Draft length")."""
    # Where verifying 2 tokens costs 1.45 of one, rounds of both kinds are timed once a
    # stretch the draft missed stopped drafting.
    steep = {"missed": 40, "slope": 0.45}
    assert late_drafting_share((0.02, 0.02), **steep) == 1.0
    assert late_drafting_share((0.004, 0.004), **steep) == 1.0
    assert late_drafting_share((0.004, 0.02), **steep) < 0.2  # probes only
    # A policy that never went without a draft has only its drafting rounds to go by.
    assert late_drafting_share((0.004, 0.02), slope=0.45) == 1.0


def test_a_rounds_choice_prices_only_the_lengths_it_may_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round, -k auto prices the lengths it may step to (the useful ones) and its
    own, not every length up to k_max: on a steep curve few lengths are ever the best,
    and pricing all 17 was most of its time a round."""
    steep = {1: 1.0, 2: 1.81, 3: 2.13, 4: 2.31, 5: 3.46}
    costs = Costs(0.01, 0.0, {n: steep.get(n, 3.5 + 0.3 * (n - 5)) for n in range(1, 18)})
    policy = AutoLength(costs, 0, 16, uses_confidence=False)
    policy.begin(invariant=True)
    priced: list[int] = []
    of = RoundCosts.of

    def counted(self: RoundCosts, k: int, survive: float = 0.0) -> float:
        priced.append(k)
        return of(self, k, survive)

    monkeypatch.setattr(RoundCosts, "of", counted)
    for _ in range(3):
        priced.clear()
        k = policy.choose(100)
        policy.observe(draft_of(k), k, 0.0, costs.verify[k + 1] * 0.01)
        assert set(priced) <= {*policy.ladder, k}
        assert len(priced) <= len(policy.ladder) + 2  # (and the gain of a step)


def test_a_decoders_policies_price_rounds_without_a_draft_alike() -> None:
    """The rounds without a draft fall to one policy of a decoder (a model's, beside a
    lookup's): the others price such rounds as it learns them."""
    model, lookup = (AutoLength(CHEAP, 0, 8, uses_confidence=False) for _ in range(2))
    lookup.share_plain_rounds(model)
    for policy in (model, lookup):
        policy.begin(invariant=True)
    model.observe(draft_of(0), 0, 0.0, 0.01, 0.005)
    lookup.observe(draft_of(3), 3, 0.0015, 0.012, 0.05)
    assert (lookup.costs.python(0), lookup.costs.python(3)) == (0.005, 0.05)
    assert (model.costs.python(0), model.costs.python(3)) == (0.005, 0.005)


def test_auto_stops_drafting_a_useless_draft_but_probes() -> None:
    costly = Costs(0.01, 0.5, {n: 1.0 + 0.5 * (n - 1) for n in range(1, 18)})
    policy = AutoLength(costly, 0, 8, uses_confidence=False)
    chosen = []
    for _ in range(240):
        k = policy.choose(100)
        chosen.append(k)
        policy.observe(draft_of(k), 0, k * 0.005, costly.verify[k + 1] * 0.01)
    late = chosen[40:]
    # Nothing is ever accepted: rounds with a draft cost at most 3 % (probes that fail
    # grow further apart)...
    assert late.count(0) >= 0.97 * len(late)
    assert 1 in late  # ...but an occasional probe, so it can notice a change


def test_auto_respects_draft_min_and_limit() -> None:
    policy = AutoLength(CHEAP, 2, 6, uses_confidence=False)
    assert 2 <= policy.choose(100) <= 6
    assert policy.choose(1) == 1  # never past the end of -n or the context


def test_confidence_cuts_an_expensive_draft_short() -> None:
    costly = Costs(0.01, 0.3, {n: 1.0 + 0.2 * (n - 1) for n in range(1, 18)})
    policy = AutoLength(costly, 0, 8, uses_confidence=True, prior=0.9)
    k = policy.choose(100)
    assert k > 2
    assert policy.keep_drafting(0, 0.95)
    assert policy.keep_drafting(1, 0.95)
    assert not policy.keep_drafting(2, 0.05)  # unsure: the rest is not worth its cost


def test_p_min_is_a_hard_floor() -> None:
    policy = AutoLength(CHEAP, 0, 8, p_min=0.8, uses_confidence=True, prior=0.9)
    policy.choose(100)
    assert policy.keep_drafting(0, 0.5)  # at least one token
    assert not policy.keep_drafting(1, 0.7)


def test_auto_follows_a_slope_of_small_steps() -> None:
    """With verification flat (a GPU), neighbouring lengths differ by less than the
    5 % a change must promise, so stepping only where the next length promised that
    left auto wherever it started; it walks to where the estimates say is best."""
    flat = Costs(0.01, 0.05, {n: 1.0 if n == 1 else 1.05 for n in range(1, 18)})
    policy = AutoLength(flat, 0, 16, uses_confidence=False, prior=0.95)
    rng = np.random.default_rng(0)
    first = policy.choose(100)
    chosen = []
    for _ in range(300):
        k = policy.choose(100)
        chosen.append(k)
        accepted = next((i for i in range(k) if rng.random() >= 0.6), k)
        t = flat.target_seconds
        policy.observe(draft_of(k), accepted, k * flat.draft_over_target * t, 1.05 * t)
    # At 60 % acceptance the best length is 4 (1.84 tokens per pass-time against 1.35
    # at 16, the first choice); auto settles within MIN_GAIN of that, at 5-7.
    assert first == 16
    assert 4 <= np.median(chosen[-100:]) <= 7
    rung = {k: i for i, k in enumerate(policy.ladder)}
    assert all(abs(rung[b] - rung[a]) <= 1 for a, b in itertools.pairwise(chosen))


# Costs as measured on the benchmark pair: uneven in n (2 tokens cost less than 1), and
# a change of batch size costs a graph rebuild of 0.1 token.
MEASURED = Costs(
    target_seconds=0.005,
    draft_over_target=0.036,
    verify={1: 1.0, 2: 0.77, 3: 1.0, 4: 1.14, 5: 1.45, 6: 1.66, 7: 1.88, 8: 2.05, 9: 2.34},
    switch=0.1,
)


def test_auto_steps_to_a_neighbouring_useful_length() -> None:
    policy = AutoLength(CHEAP, 0, 16, uses_confidence=False)
    chosen = feed(policy, acceptance=0.95, rounds=80)
    rung = {k: i for i, k in enumerate(policy.ladder)}
    assert all(abs(rung[b] - rung[a]) <= 1 for a, b in itertools.pairwise(chosen))
    assert chosen[-1] >= 6  # and still gets far


def random_rounds(policy: AutoLength, acceptance: float, rounds: int, seed: int = 0) -> list[int]:
    """Rounds where each draft token is accepted with the same probability."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        n = 0
        while n < k and rng.random() < acceptance:
            n += 1
        t = MEASURED.target_seconds
        draft_seconds = k * MEASURED.draft_over_target * t
        policy.observe(draft_of(k), n, draft_seconds, MEASURED.verify[k + 1] * t)
    return chosen


def test_auto_keeps_a_steady_k_when_changing_does_not_pay() -> None:
    # At 80 % acceptance, k=1 and k=3 are close (k=2 is never best with these costs):
    # without the rebuild cost in the rule, k flips 64 times over these runs.
    changes = 0
    for seed in range(5):
        policy = AutoLength(MEASURED, 0, 8, uses_confidence=False)
        settled = random_rounds(policy, 0.8, 240, seed)[40:]
        changes += sum(a != b for a, b in itertools.pairwise(settled))
    assert changes <= 16  # each change pays a graph rebuild


def test_auto_follows_the_text() -> None:
    policy = AutoLength(CHEAP, 0, 16, uses_confidence=False)
    easy = feed(policy, acceptance=0.95)
    hard = feed(policy, acceptance=0.5)
    assert hard[-1] < easy[-1] / 2


def test_auto_steps_over_lengths_that_are_never_best() -> None:
    policy = AutoLength(MEASURED, 0, 8, uses_confidence=False, prior=0.6)
    assert policy.ladder[:2] == [1, 3]  # 2 tokens cost less than 1, so k=2 is never best
    chosen = random_rounds(policy, 0.9, 60)
    assert chosen[0] == 1  # a prior of 60 % starts it short
    assert set(chosen[-20:]) >= {3} and 2 not in chosen


def all_or_nothing(policy: AutoLength, costs: Costs, rounds: int, accept: bool) -> list[int]:
    """Rounds whose drafts are accepted whole, or not at all, timed at `costs`."""
    chosen = []
    t = costs.target_seconds
    for _ in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        seconds = (k * costs.draft_over_target * t, costs.verify[k + 1] * t)
        policy.observe(draft_of(k), k if accept else 0, *seconds)
    return chosen


def clocked_rounds(policy: AutoLength, slowdown: float | None, rounds: int = 80) -> list[int]:
    """Rounds with a fixed acceptance pattern, timed as on a machine `slowdown` times
    slower at drafting than the measured costs say (None: untimed, as when sampling)."""
    chosen = []
    t = CHEAP.target_seconds
    for r in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        accepted = min(k, r % 5)
        if slowdown is None:
            policy.observe(draft_of(k), accepted, None, None)
        else:
            draft_seconds = slowdown * k * CHEAP.draft_over_target * t
            policy.observe(draft_of(k), accepted, draft_seconds, CHEAP.verify[k + 1] * t)
    return chosen


def test_untimed_rounds_are_judged_by_the_measured_costs() -> None:
    """Sampled rounds come untimed (their k must not follow the clock): the policy then
    charges them the measured costs, as a machine running exactly at those would."""

    def run(slowdown: float | None) -> list[int]:
        return clocked_rounds(AutoLength(CHEAP, 0, 16, uses_confidence=False), slowdown)

    assert run(None) == run(1.0)
    assert run(1.0) != run(40.0)  # timed rounds do follow the clock


def test_auto_drafts_again_where_the_shortest_useful_draft_is_long() -> None:
    """At a large vocabulary, verifying 2 or 3 tokens can cost far more than 4 (every
    row of logits is vocabulary-sized, and ggml's kernels change at 4): k=1 is then
    never worth drafting and the ladder goes 0, 3. After a stretch of useless drafts,
    the climb back must go straight to 3, or drafting never resumes."""
    steep = {1: 1.0, 2: 1.6, 3: 2.5, 4: 2.1} | {n: 2.1 + 0.3 * (n - 4) for n in range(5, 18)}
    costs = Costs(0.01, 0.1, steep)
    policy = AutoLength(costs, 0, 8, uses_confidence=False)
    assert policy.ladder[:2] == [0, 3]
    assert all_or_nothing(policy, costs, 40, accept=False)[-8:].count(0) >= 7  # useless: stops
    recovered = all_or_nothing(policy, costs, 150, accept=True)
    assert all(k >= 3 for k in recovered[-20:])  # the text turned easy: drafting again


def test_auto_climbs_past_a_gap_in_the_ladder() -> None:
    """A measured curve with a bump (here an EAGLE-3 target's on two cores: 5 and 6
    tokens never the best length) leaves a gap in the ladder, 4 then 7. A climb goes
    at most MAX_CLIMB tokens a step, and only to rungs: back from a hard stretch on an
    easy text, it stopped at 4 for good, 16 % slower than 7."""
    bumpy = {1: 1.0, 2: 1.16, 3: 1.27, 4: 1.43, 5: 1.54, 6: 1.67, 7: 1.70, 8: 1.73, 9: 1.80}
    bumpy |= {n: 1.80 + 0.08 * (n - 9) for n in range(10, 18)}
    costs = Costs(0.01, 0.036, bumpy)
    policy = AutoLength(costs, 0, 16, uses_confidence=False)
    assert 5 not in policy.ladder and 6 not in policy.ladder and 4 in policy.ladder
    assert all_or_nothing(policy, costs, 40, accept=False)[-8:].count(0) >= 7  # hard: stops
    easy_again = all_or_nothing(policy, costs, 150, accept=True)
    assert min(easy_again[-20:]) >= 7


def one_step_head_rounds(bayes_weight: bool, rounds: int = 200) -> list[int]:
    """-k auto over a head trained for one step (the EAGLE-3 and DFlash known-answer
    heads): its first guess right three times in four, its later ones never; priced as
    the EAGLE-3 one's target on two cores, where k=1 runs 12 % faster than k=2."""
    costs = Costs(0.01, 0.036, {1: 1.0, 2: 1.16, 3: 1.27, 4: 1.43, 5: 1.54, 6: 1.67, 7: 1.70})
    policy = AutoLength(costs, 0, 6, uses_confidence=False, bayes_weight=bayes_weight)
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        accepted = int(k > 0 and rng.random() < 0.75)
        t = costs.target_seconds
        seconds = (k * costs.draft_over_target * t, costs.verify[k + 1] * t)
        policy.observe(draft_of(k), accepted, *seconds)
    return chosen


def test_a_heads_policy_drafts_one_where_its_second_guess_is_never_right() -> None:
    """Leaning on the first position, the never-right second read a third to half as
    right, and -k auto drafted 2 or more in most rounds (the control). A head's policy
    weighs each test by how well its own estimate and the lean foretold it."""
    assert one_step_head_rounds(bayes_weight=False)[-100:].count(1) < 30
    assert one_step_head_rounds(bayes_weight=True)[-100:].count(1) >= 65


def test_auto_drafts_again_soon_after_the_text_turns_easy() -> None:
    """Rounds without a draft move the text on: after a hard stretch stopped drafting,
    a probe that is accepted whole must count for the rounds it stood for. Counted as
    one round among many before it, probes accepted whole every 8 rounds never brought
    drafting back (a 152k-vocabulary pair, where 2 tokens cost twice one)."""
    curve = {1: 1.0, 2: 2.1, 3: 2.3, 4: 2.4} | {n: 2.4 + 0.3 * (n - 4) for n in range(5, 18)}
    costs = Costs(0.01, 0.09, curve)
    policy = AutoLength(costs, 0, 8, uses_confidence=False)
    assert min(all_or_nothing(policy, costs, 60, accept=True)[-10:]) >= 3  # easy: drafting
    assert all_or_nothing(policy, costs, 30, accept=False)[-6:] == [0] * 6  # hard: not
    easy_again = all_or_nothing(policy, costs, 30, accept=True)
    assert min(easy_again[-15:]) >= 3  # drafting again after the first probe or two


def test_rounds_a_drafter_had_nothing_for_teach_nothing() -> None:
    """A lookup without a match drafts nothing although k > 0: those rounds are not
    rounds the policy chose not to draft, and must not make the next miss weigh more."""

    def after_a_miss(empty_rounds: int) -> list[float]:
        policy = AutoLength(CHEAP, 0, 8, uses_confidence=False)
        all_or_nothing(policy, CHEAP, 20, accept=True)
        for _ in range(empty_rounds):
            assert policy.choose(100) > 0
            policy.observe(Draft(), 0, 0.0, CHEAP.verify[1] * CHEAP.target_seconds)
        policy.choose(100)
        policy.observe(draft_of(4), 0, 0.0, CHEAP.verify[5] * CHEAP.target_seconds)
        return policy.positions.accept

    assert after_a_miss(20) == after_a_miss(0)


def test_auto_learns_the_chain_from_a_trees_rounds() -> None:
    """A tree whose path left its primary path at the first token rescued a round the
    chain would have lost: the chain's estimates must see that miss, or k grows for
    acceptance that only the tree's width bought."""
    tree = Draft([1, 2, 3, 4], calls=2, parents=[-1, 0, -1, 2])  # primary 1, 2; beside: 3, 4
    as_tree, as_chain = (AutoLength(CHEAP, 0, 16, uses_confidence=False) for _ in range(2))
    for _ in range(50):
        as_tree.observe(tree, 2, None, None, beside=2)  # the target took 3, 4
        as_chain.observe(tree, 2, None, None)
    assert as_tree.positions.estimates(2)[0] < 0.1
    assert as_chain.positions.estimates(2)[0] > 0.9


# Verifying 2 tokens costs 1.38x one (a 262k-vocabulary target on this kind of CPU): a
# draft token pays only where it is accepted more than about 0.4 of the time.
STEEP = Costs(0.01, 0.02, {1: 1.0, 2: 1.38, 3: 1.54, 4: 1.79} | {n: 2.5 for n in range(5, 18)})


def until_stopped(policy: AutoLength, chance: float, *, known: bool) -> None:
    """Rounds in which nothing is accepted, each token having had `chance` (told to the
    policy when `known`), until the policy stops drafting."""
    for _ in range(50):
        k = policy.choose(100)
        if k == 0:
            return
        policy.observe(draft_of(k), 0, None, None, chances=[chance] if known else ())
    raise AssertionError("never stopped drafting")


def after_a_lucky_probe(known: bool) -> list[int]:
    """The draft lengths of the 7 rounds after a probe whose one token was accepted
    against a chance of 0.2 (the draft is no better than before)."""
    policy = AutoLength(STEEP, 0, 8, uses_confidence=False, prior=0.5)
    until_stopped(policy, 0.2, known=known)
    while (k := policy.choose(100)) == 0:
        policy.observe(draft_of(0), 0, None, None)
    policy.observe(draft_of(k), 1, None, None, chances=[0.2] if known else ())
    chosen = []
    for _ in range(7):
        chosen.append(k := policy.choose(100))
        policy.observe(draft_of(k), 0, None, None, chances=[0.2] if known else ())
    return chosen


def test_a_lucky_probe_does_not_bring_drafting_back() -> None:
    """Sampling, each tested token's chance of acceptance is known (sum(min(p, q))):
    a probe accepted by luck says what its chance says, and drafting stays off. Counted
    as accepted, it looks like text turned easy: a fresh start after the idle rounds."""
    assert after_a_lucky_probe(known=True) == [0] * 7
    assert after_a_lucky_probe(known=False)[0] > 0  # the control: by luck, drafting again


def test_drafting_brought_back_by_one_probe_stops_soon() -> None:
    """A probe's success after a stretch without drafts stands on one round: if the
    rounds after it miss, drafting stops again within two of them, not after the many
    a long-run average would need."""
    assert sum(k > 0 for k in after_a_lucky_probe(known=False)) <= 2


def test_lucky_probes_that_leave_drafting_unpaid_come_ever_rarer() -> None:
    """Sampled probes accepted every time, by the luck of a 0.2 chance: drafting never
    pays, and each probe doubles the gap to the next, as a missed probe does. Reset to
    PROBE_GAP after each, they cost a probe every 9 rounds."""
    policy = AutoLength(STEEP, 0, 8, uses_confidence=False, prior=0.5)
    until_stopped(policy, 0.2, known=True)
    probes = 0
    for _ in range(300):
        k = policy.choose(100)
        probes += k > 0
        policy.observe(draft_of(k), min(k, 1), None, None, chances=[0.2] * min(k, 1))
    assert probes <= 300 // AutoLength.MAX_PROBE_GAP + 4


def test_a_translated_draft_is_priced_by_its_calls() -> None:
    """A draft of another vocabulary takes several calls to draft one target token: a
    k-token round is priced at that many calls a token, and the clock, which times
    calls, keeps teaching a call's price (priced per target token, every timed round
    taught that price down to a call's)."""
    costs = Costs(0.01, 0.1, {n: 1.0 + 0.1 * (n - 1) for n in range(1, 18)}, calls_per_token=3.0)
    policy = AutoLength(costs, 0, 8, uses_confidence=False)
    call = 0.1 * 0.01
    assert abs(policy.costs.of(2) - (2 * 3 * call + 1.2 * 0.01)) < 1e-12
    for _ in range(200):
        policy.observe(Draft(tokens=[1, 2], calls=6), 1, 6 * call, 1.2 * 0.01)
    assert abs(policy.costs.draft_seconds - call) < 0.01 * call


# A draft of another vocabulary on a GPU: a call costs half a target token, 3.5 calls
# draft one, and a change of batch size costs a pass.
GPU_TRANSLATED = Costs(
    0.001, 0.45, {n: 1.0 + 0.07 * (n - 1) for n in range(1, 18)}, 1.0, calls_per_token=3.5
)


def wasted_share(policy: AutoLength, costs: Costs, rounds: int) -> float:
    """Rounds in which nothing is ever accepted: the share of the time spent beyond
    rounds without a draft (drafting, longer passes, two rebuilds a probe)."""
    t, wasted = costs.target_seconds, 0.0
    for _ in range(rounds):
        k = policy.choose(100)
        calls = round((k + 1) * costs.calls_per_token) if k else 0
        seconds = (calls * costs.draft_over_target * t, costs.verify[k + 1] * t)
        policy.observe(Draft(tokens=list(range(k)), calls=calls), 0, *seconds)
        wasted += sum(seconds) - t + (2 * costs.switch * t if k else 0.0)
    return wasted / (rounds * t)


def test_probes_that_cost_many_rounds_come_rarely() -> None:
    """Each probe here costs some six rounds without a draft: 64 rounds apart, probing
    took a tenth of the time of a draft that never pays."""
    policy = AutoLength(GPU_TRANSLATED, 0, 8, uses_confidence=False, prior=0.5)
    assert wasted_share(policy, GPU_TRANSLATED, 3000) < 0.03


def probe_rounds(policy: AutoLength, greedy: bool, rounds: int) -> list[int]:
    """A generation in which nothing is accepted: the rounds that probed."""
    policy.begin(greedy)
    probes = []
    for r in range(rounds):
        k = policy.choose(100)
        if k:
            probes.append(r)
        policy.observe(draft_of(k), 0, None, None)
    return probes


def test_greedy_generations_go_on_probing_where_the_last_left_off() -> None:
    """A draft that stopped paying in one greedy generation is not probed afresh eight
    rounds into the next (in a short generation on a GPU, that one probe cost more than
    speculation could win). A sampled one starts afresh, as its seed must, and leaves
    the greedy schedule as it was."""

    def policy_of_a_useless_draft() -> AutoLength:
        return AutoLength(GPU_TRANSLATED, 0, 8, uses_confidence=False, prior=0.5)

    policy = policy_of_a_useless_draft()
    fresh = probe_rounds(policy_of_a_useless_draft(), False, 60)
    assert fresh and probe_rounds(policy, True, 300)[0] == fresh[0]
    assert probe_rounds(policy, True, 60) == []
    assert probe_rounds(policy, False, 60) == fresh
    assert probe_rounds(policy, True, 60) not in ([], fresh)  # on from where it was


def test_greedy_generations_go_on_from_what_the_last_learnt() -> None:
    """A draft the target rarely takes, where verification is dear: the first greedy
    generation learns it from the optimistic prior, drafting for a while; the next one
    starts where it left off and does not draft it again, but a sampled generation starts
    from the prior as if alone, and leaves what the greedy ones learnt as it was."""
    steep = Costs(0.01, 0.0, {n: 1.0 + 0.45 * (n - 1) for n in range(1, 18)})

    def first_rounds(policy: AutoLength, invariant: bool) -> list[int]:
        policy.begin(invariant)
        chosen = []
        for _ in range(6):
            k = policy.choose(100)
            chosen.append(k)
            policy.observe(draft_of(k), 0, None, None)  # never taken
        return chosen

    policy = AutoLength(steep, 0, 8, uses_confidence=False)
    alone = first_rounds(AutoLength(steep, 0, 8, uses_confidence=False), True)
    assert sum(alone) >= 5  # the prior says drafting pays, for a few rounds
    assert first_rounds(policy, True) == alone
    assert sum(first_rounds(policy, True)) <= 1  # a probe of the schedule at most
    assert first_rounds(policy, False) == alone
    assert sum(first_rounds(policy, True)) <= 1


def test_a_fresh_schedule_spaces_its_first_probe_by_what_a_probe_costs() -> None:
    """A probe of a translated draft on a GPU costs some five rounds without a draft
    (drafting, catching up, two rebuilds): a generation's first probe waits as many
    times PROBE_GAP, as the probes after it do. A cheap probe still comes after
    PROBE_GAP rounds."""
    expensive = probe_rounds(AutoLength(GPU_TRANSLATED, 0, 8, uses_confidence=False), False, 100)
    assert expensive[0] >= 4 * AutoLength.PROBE_GAP
    cheap = AutoLength(STEEP, 0, 8, uses_confidence=False, prior=0.1)
    assert probe_rounds(cheap, False, 100)[0] == AutoLength.PROBE_GAP - 1


def rounds_at_chance(chance: float, margin: float) -> list[int]:
    """60 sampled rounds on STEEP costs whose tested tokens each had `chance`."""
    policy = AutoLength(STEEP, 0, 8, uses_confidence=False, prior=0.5, margin=margin)
    chosen = []
    for _ in range(60):
        chosen.append(k := policy.choose(100))
        accepted = 1 if k > 1 else 0
        policy.observe(draft_of(k), accepted, None, None, chances=[chance] * min(k, accepted + 1))
    return chosen


def test_drafting_that_promises_less_than_the_margin_stops() -> None:
    """At a 0.42 chance every draft length promises about 1 % over no draft on STEEP
    costs. With a margin (a drafter whose rounds cost more than priced), drafting stops;
    without one, k stays where the prior left it (2), as no step promises MIN_GAIN over
    staying."""
    with_margin = rounds_at_chance(0.42, AutoLength.MIN_GAIN)
    assert with_margin[0] > 0
    assert sum(k > 0 for k in with_margin[20:]) <= 2  # a probe at most, after it stops
    assert all(k > 0 for k in rounds_at_chance(0.42, 0.0))


def test_drafting_that_promises_more_than_the_margin_goes_on() -> None:
    """At a 0.6 chance k=2 promises a fifth more than no draft: the margin stops nothing."""
    assert all(k > 0 for k in rounds_at_chance(0.6, AutoLength.MIN_GAIN))
