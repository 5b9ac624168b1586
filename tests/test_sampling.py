"""The verification math alone: no model, exact distributions, many samples."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec_cli.sampling import (
    Dist,
    SamplingParams,
    distribution,
    residual,
    top_k_ids,
    verify_greedy,
    verify_sampled,
)

N_VOCAB = 12
N_SAMPLES = 40_000
P_VALUE = 1e-3  # fixed seeds make every test deterministic; this guards real mismatches


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
