"""Sampling and speculative verification: pure numpy, no model needed.

A next-token distribution is kept sparse, as the token ids that survive the
top-k / top-p / min-p filters and their probabilities. Speculative sampling
(Leviathan et al. 2023, Chen et al. 2023) only needs p(x), q(x) and the
residual max(0, p - q), and all of them live on those few ids, so nothing here
allocates a vocabulary-sized array unless the filters are switched off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults and "off" values: top_k=0, top_p=1, min_p=0 disable a filter."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


GREEDY = SamplingParams(temp=0.0)


@dataclass(frozen=True)
class Dist:
    """A sparse distribution: `ids` ascending, `probs` summing to 1."""

    ids: np.ndarray
    probs: np.ndarray

    @classmethod
    def point(cls, token: int) -> Dist:
        """All mass on one token: what a deterministic drafter (n-gram) proposes."""
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of many tokens at once (0 where a token is outside the support)."""
        idx = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[idx] == tokens, self.probs[idx], 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        cdf = np.cumsum(self.probs)
        i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])


def distribution(logits: np.ndarray, params: SamplingParams) -> Dist:
    """Turn one row of logits into the distribution llama.cpp's default chain samples from.

    The order is llama.cpp's: top-k, then top-p and min-p measured on the untempered
    softmax, then temperature. Target and draft go through this same function, which is
    what makes p and q comparable in the acceptance test.
    """
    n_vocab = logits.shape[0]
    top_k = 0 < params.top_k < n_vocab
    ids = top_k_ids(logits, params.top_k) if top_k else np.arange(n_vocab)
    kept = logits[ids].astype(np.float64)

    if params.top_p < 1.0 or params.min_p > 0.0:
        order = np.argsort(-kept, kind="stable")
        ids, kept = ids[order], kept[order]
        p = np.exp(kept - kept[0])
        p /= p.sum()
        n = len(p)
        if params.top_p < 1.0:
            # The smallest prefix whose mass reaches top_p (at least one token).
            n = min(n, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
        if params.min_p > 0.0:
            # p is sorted descending and p[0] is the maximum.
            n = min(n, max(1, int(np.count_nonzero(p >= params.min_p * p[0]))))
        ids, kept = ids[:n], kept[:n]

    scaled = (kept - kept.max()) / params.temp
    probs = np.exp(scaled)
    probs /= probs.sum()
    order = np.argsort(ids)
    return Dist(ids[order].astype(np.int64), probs[order])


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, in no particular order.

    Almost all of a vocabulary sits far below its best logits, so the k are looked for
    among the tokens within a margin of the maximum, and the margin widened only if
    fewer than k are there: exact, and much cheaper than partitioning the whole row.
    """
    top = logits.max()
    for margin in (8.0, 32.0, 128.0):
        near = np.flatnonzero(logits >= top - margin)
        if len(near) >= k:
            break
    else:
        near = np.arange(len(logits))
    if len(near) > k:
        near = near[np.argpartition(logits[near], len(near) - k)[len(near) - k :]]
    return near


def residual(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)): where to sample after the draft token was rejected.

    Its support is inside p's, so p's ids are enough. If p and q are equal (a rejection
    then has probability zero, but floating point can still get here), fall back to p.
    """
    r = np.maximum(p.probs - q.probs_at(p.ids), 0.0)
    total = r.sum()
    if total <= 0.0:
        return p
    return Dist(p.ids, r / total)


def verify_greedy(draft: Sequence[int], target_argmax: Callable[[int], int]) -> tuple[int, int]:
    """Accept the longest prefix where the draft equals the target's argmax.

    `target_argmax(i)` is the target's choice after the context plus draft[:i]. Rows
    past the first mismatch are never read. Returns (number accepted, next token).
    """
    for i, token in enumerate(draft):
        choice = target_argmax(i)
        if choice != token:
            return i, choice
    return len(draft), target_argmax(len(draft))


def verify_sampled(
    draft: Sequence[int],
    draft_dists: Sequence[Dist],
    target_dist: Callable[[int], Dist],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling: the result is distributed exactly as sampling the target.

    Draft token x, proposed from q, is kept with probability min(1, p(x)/q(x)); on the
    first rejection the replacement comes from normalize(max(0, p - q)); if every draft
    token is kept, the bonus token comes from the target's next distribution.
    Returns (number accepted, next token).
    """
    for i, (token, q) in enumerate(zip(draft, draft_dists, strict=True)):
        p = target_dist(i)
        # u < p/q, written without the division (q(x) > 0 since x was drawn from q).
        if rng.random() * q.prob(token) < p.prob(token):
            continue
        return i, residual(p, q).sample(rng)
    return len(draft), target_dist(len(draft)).sample(rng)
