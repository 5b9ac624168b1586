"""The verification math alone: no model, exact distributions, many samples."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from specdec_cli.decoding import sampling
from specdec_cli.decoding.sampling import (
    NEAR_MARGINS,
    DenseDist,
    Dist,
    Noise,
    SamplingParams,
    chain_parents,
    distribution,
    overlap,
    residual,
    top_k_ids,
    verify_tree_greedy,
    verify_tree_sampled,
)

N_VOCAB = 12
N_SAMPLES = 40_000
P_VALUE = 1e-3  # fixed seeds make every test deterministic; this guards real mismatches


def verify_greedy(draft: list[int], target_argmax) -> tuple[int, int]:
    """A chain through the tree verifier: (number accepted, next token)."""
    path, token = verify_tree_greedy(draft, chain_parents(len(draft)), target_argmax)
    return len(path), token


def verify_sampled(draft: list[int], dists, target_dist, rng) -> tuple[int, int]:
    path, token = verify_tree_sampled(draft, chain_parents(len(draft)), dists, target_dist, rng)
    return len(path), token


def dense(d: Dist, n: int = N_VOCAB) -> np.ndarray:
    out = np.zeros(n)
    out[d.ids] = d.probs
    return out


def reference(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The same transform written the slow, obvious way: sort everything, cut, temper."""
    order = np.argsort(-logits, kind="stable")
    keep = order[: params.top_k] if params.top_k > 0 else order
    p = np.exp(logits[keep] - logits[keep].max())
    p /= p.sum()
    if params.top_p < 1.0:
        n = next(i + 1 for i in range(len(p)) if p[: i + 1].sum() >= params.top_p)
        keep, p = keep[:n], p[:n]
    if params.min_p > 0.0:
        mask = p >= params.min_p * p.max()
        keep = keep[mask]
    out = np.zeros(len(logits))
    z = np.exp((logits[keep] - logits[keep].max()) / params.temp)
    out[keep] = z / z.sum()
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temp=0.7, top_k=5, top_p=1.0, min_p=0.0),
        SamplingParams(temp=1.3, top_k=0, top_p=0.8, min_p=0.0),
        SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.2),
        SamplingParams(),  # llama.cpp's defaults: 0.8, 40, 0.95, 0.05
    ],
)
def test_distribution_matches_reference(params: SamplingParams) -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = rng.normal(0, 2, N_VOCAB).astype(np.float32)
        d = distribution(logits, params)
        assert np.all(np.diff(d.ids) > 0)
        np.testing.assert_allclose(
            dense(d), reference(logits.astype(np.float64), params), atol=1e-9
        )


@pytest.mark.parametrize("spread", [0.5, 5.0, 60.0])
def test_top_k_ids_are_exactly_the_k_largest(spread: float) -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(0, spread, 5000).astype(np.float32)
    logits[rng.integers(0, 5000, 50)] = -np.inf  # masked tokens never count
    for k in (1, 40, 300):
        assert set(top_k_ids(logits, k)) == set(np.argsort(-logits, kind="stable")[:k])


def test_filters_cut_what_they_should() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(distribution(logits, SamplingParams(1.0, 2, 1.0, 0.0)).ids) == {0, 1}
    assert set(distribution(logits, SamplingParams(1.0, 0, 0.75, 0.0)).ids) == {0, 1}
    assert set(distribution(logits, SamplingParams(1.0, 0, 0.85, 0.0)).ids) == {0, 1, 2}
    assert set(distribution(logits, SamplingParams(1.0, 0, 1.0, 0.3)).ids) == {0, 1, 2}
    assert set(distribution(logits, SamplingParams(1.0, 0, 0.0, 0.0)).ids) == {0}


def test_residual_is_normalized_positive_part() -> None:
    p = Dist(np.array([0, 1, 2]), np.array([0.5, 0.3, 0.2]))
    q = Dist(np.array([1, 2, 3]), np.array([0.6, 0.1, 0.3]))
    r = residual(p, q)
    np.testing.assert_allclose(dense(r), np.array([0.5, 0, 0.1, 0] + [0] * 8) / 0.6)


def test_verify_greedy_accepts_longest_matching_prefix() -> None:
    target = [4, 7, 1, 9, 3]
    read: list[int] = []

    def argmax(i: int) -> int:
        read.append(i)
        return target[i]

    assert verify_greedy([4, 7, 2, 9], argmax) == (2, 1)
    assert read == [0, 1, 2]  # rows after the first mismatch are never read
    assert verify_greedy([4, 7, 1, 9], lambda i: target[i]) == (4, 3)
    assert verify_greedy([5], lambda i: target[i]) == (0, 4)
    assert verify_greedy([], lambda i: target[i]) == (0, 4)


def random_dist(rng: np.random.Generator, params: SamplingParams) -> Dist:
    return distribution(rng.normal(0, 1.5, N_VOCAB), params)


def sample_first_two(
    p_rows: list[Dist], q_rows: list[Dist], rng: np.random.Generator, accept_all: bool = False
) -> tuple[int, int]:
    """One speculative round with a 2-token draft whose dists do not depend on context;
    returns the first two output tokens (a third row makes the bonus token possible)."""
    draft = [q_rows[0].sample(rng), q_rows[1].sample(rng)]
    if accept_all:
        return draft[0], draft[1]
    n, nxt = verify_sampled(draft, q_rows[:2], lambda i: p_rows[i], rng)
    out = [*draft[:n], nxt]
    if len(out) < 2:  # rejected at once: the next token is the target's own, from row 1
        out.append(p_rows[1].sample(rng))
    return out[0], out[1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temp=0.8, top_k=6, top_p=0.9, min_p=0.05),
    ],
)
def test_speculative_sampling_matches_target_distribution(params: SamplingParams) -> None:
    rng = np.random.default_rng(7)
    p_rows = [random_dist(rng, params) for _ in range(3)]
    q_rows = [random_dist(rng, params) for _ in range(2)]
    firsts = np.zeros(N_VOCAB)
    seconds = np.zeros(N_VOCAB)
    for _ in range(N_SAMPLES):
        a, b = sample_first_two(p_rows, q_rows, rng)
        firsts[a] += 1
        seconds[b] += 1
    for counts, p in ((firsts, dense(p_rows[0])), (seconds, dense(p_rows[1]))):
        support = p > 0
        assert counts[~support].sum() == 0, "sampled a token the target's filters removed"
        assert chisquare(counts[support], p[support] * N_SAMPLES).pvalue > P_VALUE


def test_chi_square_detects_a_wrong_acceptance_rule() -> None:
    """Negative control: accepting every draft gives q, not p, and the test sees it."""
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(7)
    p_rows = [random_dist(rng, params) for _ in range(3)]
    q_rows = [random_dist(rng, params) for _ in range(2)]
    counts = np.zeros(N_VOCAB)
    for _ in range(N_SAMPLES // 4):
        counts[sample_first_two(p_rows, q_rows, rng, accept_all=True)[0]] += 1
    assert chisquare(counts, dense(p_rows[0]) * counts.sum()).pvalue < P_VALUE


def test_point_mass_proposal_is_lossless() -> None:
    """An n-gram draft proposes a fixed token (q = 1 there): kept with probability p(x)."""
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(3)
    p = random_dist(rng, params)
    proposal = int(p.ids[np.argmax(p.probs)])
    counts = np.zeros(N_VOCAB)
    for _ in range(N_SAMPLES):
        n, nxt = verify_sampled([proposal], [Dist.point(proposal)], lambda i: p, rng)
        counts[proposal if n else nxt] += 1
    assert chisquare(counts, dense(p) * N_SAMPLES).pvalue > P_VALUE


def test_identical_draft_is_always_accepted() -> None:
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(5)
    p = random_dist(rng, params)
    draft = [p.sample(rng) for _ in range(4)]
    assert verify_sampled(draft, [p] * 4, lambda i: p, rng)[0] == 4


# Real vocabularies: the fast paths (candidates near the top, float32 passes over the
# row, DenseDist) only run at these sizes.
QWEN2_VOCAB = 151_936
GEMMA_VOCAB = 262_144
FLAT_VOCAB = 32_768  # flat rows: the reference's top-p loop is quadratic in its cut

SETTINGS = {
    "defaults": SamplingParams(),
    "top-k 0": SamplingParams(top_k=0),
    "plain softmax": SamplingParams(top_k=0, top_p=1.0, min_p=0.0),
    "top-p 0.8 top-k 20": SamplingParams(top_p=0.8, top_k=20),
    "min-p 0.1": SamplingParams(min_p=0.1),
    "top-p alone": SamplingParams(temp=1.3, top_k=0, top_p=0.8, min_p=0.0),
    "min-p alone": SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.2),
}


def logits_row(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """A row of float32 logits of one of the shapes sampling has to get right."""
    rng = np.random.default_rng(seed)
    if kind == "equal":
        return np.full(n, 1.5, np.float32)
    if kind == "flat":
        return rng.normal(0, 0.3, n).astype(np.float32)
    if kind == "random model":  # a random-weight model's spread (tests/ggufgen.py)
        return rng.normal(0, 4, n).astype(np.float32)
    # A trained model's: a long normal tail and a few strong tokens above it.
    row = rng.normal(0, 2.5, n)
    row[rng.choice(n, 8, replace=False)] = row.max() + rng.uniform(-1, 5, 8)
    if kind == "ties":  # many equal logits, at the top, at the top-k edge, everywhere
        row = np.round(row * 4) / 4
    if kind == "masked":  # tokens a model never emits, whole blocks of them included
        row[rng.random(n) < 0.3] = -np.inf
        row[5000:9000] = -np.inf
    return row.astype(np.float32)


@pytest.mark.parametrize(
    ("kind", "n"),
    [
        *[
            (kind, n)
            for kind in ("model", "random model", "ties", "masked")
            for n in (QWEN2_VOCAB, GEMMA_VOCAB)
        ],
        ("flat", FLAT_VOCAB),
        ("equal", FLAT_VOCAB),
    ],
)
@pytest.mark.parametrize("margins", [NEAR_MARGINS, (8.0,), ()], ids=["near", "one", "exact"])
def test_distribution_matches_reference_at_real_sizes(
    kind: str, n: int, margins: tuple[float, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sampler setting, against the sort-everything reference. The filtered
    distributions are float64 on their few tokens; the plain softmax is float32 over the
    vocabulary, hence the relative tolerance. With top-k off, top-p and min-p are settled
    from the tokens near the top where they can be, else from the exact total: `margins`
    limits the first (none: always the exact total)."""
    monkeypatch.setattr(sampling, "NEAR_MARGINS", margins)
    logits = logits_row(kind, n)
    for name, params in SETTINGS.items():
        d = distribution(logits, params)
        expected = reference(logits.astype(np.float64), params)
        got = dense(d, n)
        assert np.all(np.diff(d.ids) > 0), name
        np.testing.assert_array_equal(got > 0, expected > 0, err_msg=f"{name}: support")
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-12, err_msg=name)
        assert abs(d.probs.sum() - 1.0) < 1e-5, name


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.9])
def test_top_p_counts_the_mass_far_below_the_top(top_p: float) -> None:
    """Eight tokens at the top, every other one 9 below: far enough not to be a
    candidate near the top, and together heavier than the top eight. top-p's cut falls
    among the far tokens (lowest ids first): it is wrong if their mass is left out of
    the total, or bounded too low."""
    logits = np.full(QWEN2_VOCAB, -9.0, np.float32)
    top = np.arange(8) * 1000 + 7
    logits[top] = 0.0
    mass = np.exp(logits.astype(np.float64))
    n_far = int(np.ceil((top_p * mass.sum() - 8.0) / np.exp(-9.0)))
    far = np.setdiff1d(np.arange(QWEN2_VOCAB), top)[:n_far] if n_far > 0 else []
    expected = np.union1d(top[: int(np.ceil(top_p * mass.sum()))] if n_far <= 0 else top, far)
    d = distribution(logits, SamplingParams(temp=1.0, top_k=0, top_p=top_p, min_p=0.0))
    np.testing.assert_array_equal(d.ids, expected)


def test_min_p_keeps_tokens_below_the_near_candidates() -> None:
    """min-p 1e-5 keeps every token within ln(1e5) = 11.5 of the top: here all of
    them, 10 below it, further down than the first candidates looked at."""
    logits = np.full(QWEN2_VOCAB, -10.0, np.float32)
    logits[[3, 5000]] = 0.0
    d = distribution(logits, SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=1e-5))
    np.testing.assert_array_equal(d.ids, np.arange(QWEN2_VOCAB))


def test_top_p_waits_for_bounds_that_settle_it() -> None:
    """21 tokens near the top, the rest far below (mass 3e-4 in all): top-p 0.95 drops
    the last of the 21. Counting each far token at the most it could weigh at the first
    margin (e^-8), top-p would cut nothing: the cut must wait for tighter bounds."""
    logits = np.full(QWEN2_VOCAB, -20.0, np.float32)
    near = np.arange(21) * 7000
    logits[near] = -1.0
    logits[near[0]] = 0.0
    d = distribution(logits, SamplingParams(temp=1.0, top_k=0, top_p=0.95, min_p=0.05))
    np.testing.assert_array_equal(d.ids, near[:20])


def test_top_k_ids_keep_the_lowest_ids_among_ties() -> None:
    logits = np.zeros(5000, np.float32)
    logits[[10, 4000, 4999]] = 2.0
    np.testing.assert_array_equal(top_k_ids(logits, 5), [0, 1, 10, 4000, 4999])
    np.testing.assert_array_equal(top_k_ids(np.ones(5000, np.float32), 3), [0, 1, 2])


def strong_at_block_edges(n: int = QWEN2_VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """A whole-vocabulary distribution with strong tokens where block arithmetic can slip
    (first and last ids, either side of block boundaries) and a masked stretch."""
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, n).astype(np.float32)
    strong = np.array([0, 1023, 1024, 2047, 2048, 77777, n - 1])
    logits[strong] = rng.uniform(8.5, 9.5, len(strong))
    logits[3072:9000] = -np.inf
    return logits, strong


def sampled_counts(
    d: Dist, strong: np.ndarray, n_samples: int, shift: int = 0, coupled: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts in bins: each strong token alone, the rest in 20 runs of ids of about equal
    mass. `shift` moves every sample to a neighbouring id (the negative control);
    `coupled`: the samples are races' winners, one key each."""
    rng = np.random.default_rng(8)
    n = len(d.ids)
    draws = (Noise(i).choose(d, 3) if coupled else d.sample(rng) for i in range(n_samples))
    samples = np.array([(token + shift) % n for token in draws])
    probs = dense(d, n)
    probs /= probs.sum()  # a float32 row sums to 1 only to its rounding; draws are in proportion
    rest = np.ones(n, bool)
    rest[strong] = False
    edges = np.searchsorted(
        np.cumsum(np.where(rest, probs, 0.0)), np.linspace(0, 1, 21)[1:-1] * probs[rest].sum()
    )
    bin_of = np.searchsorted(edges, np.arange(n), side="right") + len(strong)
    bin_of[strong] = np.arange(len(strong))
    counts = np.bincount(bin_of[samples], minlength=len(strong) + 20)
    expected = np.bincount(bin_of, weights=probs, minlength=len(strong) + 20) * n_samples
    return samples, counts, expected


@pytest.mark.parametrize("coupled", [False, True], ids=["drawn", "coupled"])
def test_dense_sampling_matches_its_probabilities(coupled: bool) -> None:
    """Drawn by block sums, or by the race in two rounds (blocks, then tokens)."""
    logits, strong = strong_at_block_edges()
    d = distribution(logits, SETTINGS["plain softmax"])
    assert isinstance(d, DenseDist)
    samples, counts, expected = sampled_counts(d, strong, N_SAMPLES, coupled=coupled)
    assert not np.any((samples >= 3072) & (samples < 9000)), "sampled a masked token"
    assert chisquare(counts, expected).pvalue > P_VALUE


@pytest.mark.parametrize("coupled", [False, True], ids=["drawn", "coupled"])
def test_dense_chi_square_detects_an_off_by_one(coupled: bool) -> None:
    """Negative control: the same samples moved to the next id."""
    logits, strong = strong_at_block_edges()
    d = distribution(logits, SETTINGS["plain softmax"])
    _, counts, expected = sampled_counts(d, strong, N_SAMPLES // 4, shift=1, coupled=coupled)
    assert chisquare(counts, expected).pvalue < P_VALUE


@pytest.mark.parametrize(
    ("p_setting", "q_setting"),
    [
        ("plain softmax", "plain softmax"),  # the model drafter, every filter off
        ("plain softmax", "point"),  # an n-gram's guess against a whole-vocabulary p
        ("top-k 0", "top-k 0"),
        ("top-k 0", "point"),
        ("top-p alone", "plain softmax"),
    ],
)
def test_residual_at_real_size(p_setting: str, q_setting: str) -> None:
    n = QWEN2_VOCAB
    logits = logits_row("random model", n, seed=1)
    p = distribution(logits, SETTINGS[p_setting])
    if q_setting == "point":
        q = Dist.point(int(p.ids[np.argsort(p.probs)[-2]]))  # p's second most likely
    else:
        noise = np.random.default_rng(2).normal(0, 0.5, n).astype(np.float32)
        q = distribution(logits + noise, SETTINGS[q_setting])
    expected = np.maximum(dense(p, n) - dense(q, n), 0.0)
    expected /= expected.sum()
    r = residual(p, q)
    assert type(r) is type(p)
    assert np.abs(dense(r, n) - expected).sum() < 1e-5  # total variation
    assert not np.any(dense(r, n)[expected == 0]), "residual outside max(0, p - q)"


N_KEYS = 20_000


def coupled_draws(dist: Dist, position: int, n: int = 1, keys: range = range(N_KEYS)) -> np.ndarray:
    """The race's first n at `position`, one row per key."""
    return np.array([Noise(key).ranked(dist, position, n) for key in keys])


def test_coupled_draws_follow_the_distribution() -> None:
    """The race's winner is a draw from p, and its runner-up a draw from p without the
    winner: P(second = y) = sum over x != y of p(x) p(y) / (1 - p(x))."""
    p = random_dist(np.random.default_rng(3), SamplingParams(temp=1.0, top_k=0, min_p=0.0))
    draws = coupled_draws(p, position=17, n=2)
    dense_p = dense(p)
    counts = np.bincount(draws[:, 0], minlength=N_VOCAB)
    assert chisquare(counts[p.ids], dense_p[p.ids] * N_KEYS).pvalue > P_VALUE
    pairs = dense_p[:, None] * dense_p[None, :] / (1.0 - dense_p[:, None])
    np.fill_diagonal(pairs, 0.0)
    second = np.bincount(draws[:, 1], minlength=N_VOCAB)
    assert chisquare(second[p.ids], pairs.sum(axis=0)[p.ids] * N_KEYS).pvalue > P_VALUE
    # The control: the winners are no draw from a slightly sharper distribution.
    sharper = dense_p[p.ids] ** 1.2 / (dense_p[p.ids] ** 1.2).sum()
    assert chisquare(counts[p.ids], sharper * N_KEYS).pvalue < P_VALUE


def test_coupled_positions_are_independent() -> None:
    """Two positions of one key draw independently (a contingency table of the pairs),
    and the same position twice does not (the control)."""
    p = Dist(np.arange(4), np.array([0.4, 0.3, 0.2, 0.1]))
    keys = range(5_000)
    first, second, again = (coupled_draws(p, pos, keys=keys)[:, 0] for pos in (5, 6, 5))
    table = np.zeros((4, 4))
    np.add.at(table, (first, second), 1)
    assert chi2_contingency(table).pvalue > P_VALUE
    same = np.zeros((4, 4))
    np.add.at(same, (first, again), 1)
    assert chi2_contingency(same).pvalue < P_VALUE


def test_coupled_draws_agree_as_the_distributions_do() -> None:
    """Draft and target race with the same noise: identical distributions always agree,
    and a point guess wins exactly as often as the target gives it (a lookup loses
    nothing to coupling); two different distributions agree less often."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temp=1.0, top_k=0, min_p=0.0)
    p, q = random_dist(rng, params), random_dist(rng, params)
    keys = range(4_000)
    target = coupled_draws(p, 9, keys=keys)[:, 0]
    assert np.array_equal(coupled_draws(p, 9, keys=keys)[:, 0], target)
    guess = int(p.ids[np.argmax(p.probs)])
    assert abs(np.mean(target == guess) - p.prob(guess)) < 0.03
    agree = np.mean(coupled_draws(q, 9, keys=keys)[:, 0] == target)
    assert agree < overlap(p, q) + 0.03
