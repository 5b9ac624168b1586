"""Sampling and speculative verification: pure numpy, no model needed.

A next-token distribution is kept sparse, as the token ids that survive the
top-k / top-p / min-p filters and their probabilities. Speculative sampling
(Leviathan et al. 2023, Chen et al. 2023) only needs p(x), q(x) and the
residual max(0, p - q), and all of them live on those few ids. A draft may also be a
tree, several candidates per position (SpecInfer, Miao et al. 2023): siblings are tried
one after another, each against what the rejections before it left of p.

At a real vocabulary (152k-262k tokens) nothing here sorts or walks the whole row
one token at a time: finding the ids takes a few vectorised passes over the row,
and only candidates near its top are sorted. With every filter off the
distribution covers the whole vocabulary (`DenseDist`): a few vectorised passes
build it and block sums sample it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec_cli.llamacpp.rowexp import exp_sum, scratch_row

BLOCK = 1024  # tokens per block sum of a DenseDist
# From this vocabulary size on, the passes over a whole row (every token's exp) are
# float32: half the memory traffic and a faster exp than float64, with a relative error
# near 1e-7 that no sampling can detect. Smaller vocabularies (test models,
# stories260K) take the plain path: every token a candidate, float64, one sort.
LARGE_VOCAB = 4096
# min-p keeps logits >= max + ln(min_p). Candidates are taken a little below that (the
# comparison with a float32 row rounds), then tested exactly in float64.
MIN_P_SLACK = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults and "off" values: top_k=0, top_p=1, min_p=0 disable a filter."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    # Coupled sampling (see Noise): each position's token is the winner of a race run
    # with noise keyed by the seed and the position, and the draft races with the same
    # noise. The target's draw is then fixed before anything is drafted, so the text for
    # a seed is the same whatever is drafted, how much, and beside which other requests.
    coupled: bool = False

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def draft_invariant(self) -> bool:
        """Whether the text is the same whatever the drafts: greedy, or coupled. Then
        draft lengths may follow the clock and the batch, and verification is a match
        against the target's own choice (verify_tree_greedy)."""
        return self.greedy or self.coupled


GREEDY = SamplingParams(temp=0.0)


@dataclass(frozen=True)
class Dist:
    """A distribution over the tokens it lists: `ids` ascending, `probs` summing to 1."""

    ids: np.ndarray
    probs: np.ndarray

    @classmethod
    def point(cls, token: int) -> Dist:
        """All mass on one token: what a deterministic drafter (n-gram) proposes."""
        return cls(np.array([token], dtype=np.int64), np.ones(1))

    def find(self, tokens: np.ndarray) -> np.ndarray:
        """The index in `ids` of each token, -1 where it is outside the support."""
        idx = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[idx] == tokens, idx, -1)

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of many tokens at once (0 where a token is outside the support)."""
        idx = self.find(tokens)
        return np.where(idx >= 0, self.probs[idx], 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.ids[_draw(self.probs, rng)])

    def reweighted(self, weights: np.ndarray) -> Dist:
        """The same support with probabilities proportional to `weights`."""
        return Dist(self.ids, weights / weights.sum())

    def without(self, token: int) -> Dist | None:
        """This distribution with `token` taken out and the rest renormalised (what the
        next of several draws without replacement comes from); None if nothing is left."""
        weights = self.probs.copy()
        weights[self.find(np.array([token]))[0]] = 0.0
        return self.reweighted(weights) if weights.any() else None


@dataclass(frozen=True)
class DenseDist(Dist):
    """Every token of the vocabulary: `ids` is 0..n-1, so a token is its own index.

    Drawing a token takes two short cumulative sums, over the sums of each run of BLOCK
    consecutive tokens and then within the chosen run, instead of one over the whole
    vocabulary. The block sums are taken only when a token is drawn: most of a chain's
    target rows are only looked up, at the drafted token.
    """

    @classmethod
    def from_weights(cls, weights: np.ndarray, total: float | None = None) -> DenseDist:
        """Normalise `weights`, one per token, non-negative, summing to `total` (taken
        here if not given): the array is taken over and scaled in place."""
        if total is None:
            total = float(weights.sum())
        weights *= 1.0 / total
        return cls(_dense_layout(len(weights))[0], weights)

    def find(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(tokens)

    def prob(self, token: int) -> float:
        return float(self.probs[token])

    def block_masses(self) -> np.ndarray:
        """The mass of each run of BLOCK consecutive tokens."""
        return np.add.reduceat(self.probs, _dense_layout(len(self.probs))[1])

    def sample(self, rng: np.random.Generator) -> int:
        start = _draw(self.block_masses(), rng) * BLOCK
        return start + _draw(self.probs[start : start + BLOCK], rng)

    def reweighted(self, weights: np.ndarray) -> DenseDist:
        return DenseDist.from_weights(weights)


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability proportional to `weights` (never one of weight 0:
    u * total < total, and side="right" steps over entries that add nothing)."""
    cdf = np.cumsum(weights, dtype=np.float64)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)


@functools.cache
def _dense_layout(n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids 0..n-1 and the first id of each block, shared by every DenseDist of n."""
    ids, starts = np.arange(n_vocab), np.arange(0, n_vocab, BLOCK)
    ids.flags.writeable = starts.flags.writeable = False
    return ids, starts


def distribution(logits: np.ndarray, params: SamplingParams) -> Dist:
    """Turn one row of logits into the distribution llama.cpp's default chain samples from.

    The order is llama.cpp's: top-k, then top-p and min-p measured on the untempered
    softmax, then temperature. Target and draft go through this same function, which is
    what makes p and q comparable in the acceptance test. Ties are broken towards the
    lower token id, as a stable sort of the row would.
    """
    n_vocab = logits.shape[0]
    if 0 < params.top_k < n_vocab:
        ids = top_k_ids(logits, params.top_k)
        return _filtered(ids, logits[ids].astype(np.float64), params)
    if n_vocab < LARGE_VOCAB:
        return _filtered(np.arange(n_vocab), logits.astype(np.float64), params)
    if params.top_p < 1.0 or params.min_p > 0.0:
        return _nucleus(logits, params)
    return _softmax(logits, params.temp)


def _softmax(logits: np.ndarray, temp: float) -> DenseDist:
    """softmax(logits / temp) over the whole vocabulary, computed in the array it returns."""
    weights = np.multiply(logits, np.float32(1.0 / temp))
    top = float(weights.max())
    return DenseDist.from_weights(weights, exp_sum(weights, top, out=weights))


def _nucleus(logits: np.ndarray, params: SamplingParams) -> Dist:
    """top-p and min-p over the whole vocabulary (top-k off).

    top-p's cut depends on the total mass of the row, but rarely on its exact value:
    the tokens near the top hold the candidates, and every other token weighs less than
    the cutoff, which bounds the total from both sides (`_nucleus_near`). Only when the
    cut falls between the bounds is the total taken exactly, by one exp over every
    token in float32 (a kept buffer): then the cut can differ from an all-float64 one
    only where the mass before it is within about 1e-7 of top_p.
    """
    top = float(logits.max())
    for margin in NEAR_MARGINS:
        dist = _nucleus_near(logits, top, margin, params)
        if dist is not None:
            return dist
    weights = scratch_row(len(logits))
    total = exp_sum(logits, top, out=weights)
    ids = _candidates(logits, weights, top, total, params)
    beyond = total - float(weights[ids].sum())  # the mass of the other tokens
    dist = _filter(ids, logits[ids].astype(np.float64), params, (beyond, beyond))
    assert dist is not None  # the total is exact and the candidates hold the cut
    return dist


def _candidates(
    logits: np.ndarray, weights: np.ndarray, top: float, total: float, params: SamplingParams
) -> np.ndarray:
    """The ids (ascending) of every token above a logit cutoff low enough to hold all
    that top-p and min-p keep, given the row's total mass and each token's (`weights`).

    Both keep a prefix of the tokens by decreasing logit. min-p's is bounded by a logit;
    top-p's is looked for within a margin of the top, widened until the tokens above it
    hold top_p of the mass: usually a few hundred tokens, not the row.
    """
    floor = _min_p_floor(top, params.min_p)
    for margin in (4.0, 16.0, 64.0):
        cutoff = max(top - margin, floor)
        ids = np.flatnonzero(logits >= cutoff)
        if cutoff == floor or weights[ids].sum() >= params.top_p * total:
            return ids
    return np.flatnonzero(logits >= floor)


def _min_p_floor(top: float, min_p: float) -> float:
    """A logit below every token min-p keeps (it keeps logits >= top + ln(min_p)); the
    comparison with a float32 row rounds, so a little lower, and tested exactly later."""
    return top + math.log(min_p) - MIN_P_SLACK if min_p > 0.0 else -math.inf


def _nucleus_near(
    logits: np.ndarray, top: float, margin: float, params: SamplingParams
) -> Dist | None:
    """The distribution from the tokens within `margin` of the top logit alone, or None
    when they do not settle it.

    Measured in the top token's mass, each of the n_far tokens below the candidates
    weighs less than exp(-margin): together, between 0 and n_far * exp(-margin). Whatever
    they weigh within that, min-p and top-p keep the same tokens when (a) every token
    min-p keeps is a candidate and top-p cuts nothing even if they weigh nothing, or (b)
    top-p cuts within the candidates at the same token for both ends.
    """
    cutoff = top - margin
    ids = np.flatnonzero(logits >= cutoff)
    # Far tokens are below float32(cutoff), which can round up by a hair: 1e-3 covers it.
    far_most = (len(logits) - len(ids)) * math.exp(1e-3 - margin)
    complete = _min_p_floor(top, params.min_p) >= cutoff
    return _filter(ids, logits[ids].astype(np.float64), params, (0.0, far_most), complete)


NEAR_MARGINS = (8.0, 16.0, 32.0)  # logits below the top that _nucleus_near tries, in turn


def _filtered(ids: np.ndarray, kept: np.ndarray, params: SamplingParams) -> Dist:
    """min-p and top-p over candidate tokens that are all the filters choose from, then
    temperature (see _filter)."""
    dist = _filter(ids, kept, params)
    assert dist is not None  # the total is exact and every token is a candidate
    return dist


def _filter(
    ids: np.ndarray,
    kept: np.ndarray,
    params: SamplingParams,
    beyond: tuple[float, float] = (0.0, 0.0),
    complete: bool = True,
) -> Dist | None:
    """min-p and top-p over candidate tokens, then temperature.

    `ids` ascending, `kept` their logits in float64. The filters measure probabilities
    against the untempered mass of all the tokens they choose from, in units of the top
    token's: the candidates' own, plus that of the tokens beyond them, which `beyond`
    bounds (least, most). `complete`: the candidates include every token min-p keeps.
    Returns None when the kept tokens depend on where the total lies within its bounds
    (or, the candidates not complete, top-p's cut may fall outside them). min-p keeps a
    prefix of the tokens by decreasing probability, so top-p's prefix, if shorter, lies
    within it.
    """
    top = kept.max()
    mass = np.exp(kept - top)
    own = float(mass.sum())
    least, most = own + beyond[0], own + beyond[1]
    if params.min_p > 0.0:
        # p_i >= min_p * p_max, and the top token's mass is exactly 1.
        keep = mass >= params.min_p
        ids, kept, mass = ids[keep], kept[keep], mass[keep]
    kept_mass = float(mass.sum())
    cuts = params.top_p < 1.0 and kept_mass >= params.top_p * least
    if params.top_p < 1.0 and kept_mass >= params.top_p * most:
        # The smallest prefix by decreasing probability whose mass reaches top_p (at least
        # one token).
        order, cum = _leading(kept, mass, params.top_p * most)
        n = int(np.searchsorted(cum, params.top_p * least)) + 1
        if n != int(np.searchsorted(cum, params.top_p * most)) + 1:
            return None
        keep = np.sort(order[:n])
        ids, kept = ids[keep], kept[keep]
    elif cuts or not complete:  # top-p cuts for some totals only, or beyond the candidates
        return None
    probs = np.exp((kept - top) / params.temp)
    return Dist(ids, probs / probs.sum())


def _leading(kept: np.ndarray, mass: np.ndarray, reach: float) -> tuple[np.ndarray, np.ndarray]:
    """The first candidates by decreasing logit, the lower index first among equals (what
    a stable sort of ascending ids gives), enough of them to hold `reach` of the mass
    (or all), and their running mass.

    A top-p cut is usually a few hundred tokens in, among candidates that can be tens of
    thousands: the first TOP_P_FIRST are found as top_k_ids finds them and only those
    sorted, four times as many each time they fall short.
    """
    m = TOP_P_FIRST
    while True:
        first = top_k_ids(kept, m) if m < len(kept) else np.arange(len(kept))
        order = first[np.argsort(-kept[first], kind="stable")]
        cum = np.cumsum(mass[order])
        if cum[-1] >= reach or len(order) == len(kept):
            return order, cum
        m *= 4


TOP_P_FIRST = 64  # see _leading


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits, ascending; of equal logits at the edge, the lowest
    ids (what a stable sort of the row keeps).

    The row is read as TOP_K_ROWS rows of equal width, and each column's largest value
    taken (one vectorised pass, about as cheap as the row's maximum). The k-th largest
    of those column maxima is a logit that at least k tokens reach, so the k largest
    tokens all lie in the columns that reach it: a few thousand values, not the row.
    A k too large for that (or a small vocabulary) partitions the whole row.
    """
    ids = _top_k_candidates(logits, k)
    if len(ids) == k:
        return ids
    values = logits[ids]
    kth = np.partition(values, len(ids) - k)[len(ids) - k]
    keep = values > kth
    keep[np.flatnonzero(values == kth)[: k - np.count_nonzero(keep)]] = True
    return ids[keep]


def _top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids, ascending, among which the k largest logits are (see top_k_ids)."""
    n = len(logits)
    width = n // TOP_K_ROWS
    if width < 2 * k:
        return np.arange(n)
    body = TOP_K_ROWS * width
    grid = logits[:body].reshape(TOP_K_ROWS, width)
    column_max = grid.max(axis=0)
    floor = np.partition(column_max, width - k)[width - k]
    columns = np.flatnonzero(column_max >= floor)
    rows, at = np.nonzero(grid[:, columns] >= floor)  # row by row: ids ascending
    ids = rows * width + columns[at]
    tail = body + np.flatnonzero(logits[body:] >= floor)  # the few ids past the grid
    return np.concatenate([ids, tail]) if len(tail) else ids


TOP_K_ROWS = 32  # see top_k_ids


def residual(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)): where to sample after the draft token was rejected.

    Its support is inside p's, so p's ids are enough. If p and q are equal (a rejection
    then has probability zero, but floating point can still get here), fall back to p.
    """
    if isinstance(p, DenseDist) and isinstance(q, DenseDist):
        r = np.subtract(p.probs, q.probs)
        # Against an array of zeros: numpy's maximum with a scalar is not vectorised.
        np.maximum(r, _zeros(len(r)), out=r)
        total = float(r.sum())
        return DenseDist.from_weights(r, total) if total > 0.0 else p
    r = p.probs.copy()
    if len(q.ids) < len(p.ids):  # q's few tokens looked up in p (an n-gram's point)
        at = p.find(q.ids)
        hit = at >= 0
        r[at[hit]] -= q.probs[hit]
    else:
        r -= q.probs_at(p.ids)
    np.maximum(r, 0.0, out=r)
    if not r.any():
        return p
    return p.reweighted(r)


@functools.cache
def _zeros(n_vocab: int) -> np.ndarray:
    zeros = np.zeros(n_vocab, np.float32)
    zeros.flags.writeable = False
    return zeros


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SPLITMIX = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))  # shifts, factors
_BLOCK_SALT = 0x5851F42D4C957F2D  # the blocks' race has noise of its own


@dataclass(frozen=True)
class Noise:
    """Coupled sampling's noise for one generation: a uniform u for every (position,
    token), hashed from `key` (splitmix64), never stored. At a position, each token of a
    distribution p runs a race with time -ln(u) / p(token), and the first to finish is
    drawn: exactly a draw from p (the exponential race, Gumbel-max), and independent of
    every other position's.

    The target's token is the winner under its p, the draft's under its q, with the
    same u: they agree with a chance a little below the best coupling's sum(min(p, q)),
    and exactly p(token) for a deterministic guess (a lookup). Only the tokens of a
    distribution's support are hashed: a few dozen under the default filters. A whole
    vocabulary (DenseDist) races in two rounds instead (see _ranked_dense)."""

    key: int

    @classmethod
    def draw(cls, rng: np.random.Generator) -> Noise:
        return cls(int(rng.integers(1 << 63)))

    def choose(self, dist: Dist, position: int) -> int:
        return self.ranked(dist, position)[0]

    def ranked(self, dist: Dist, position: int, n: int = 1) -> list[int]:
        """The first n tokens of `dist` to finish the race at `position`: the winner
        first, then the runners-up (draws without replacement, Gumbel-top-k; of a whole
        vocabulary, the runners-up of the winner's block)."""
        if isinstance(dist, DenseDist):
            return self._ranked_dense(dist, position, n)
        return self._ranked(dist.ids, dist.probs, position, n)

    def _ranked(
        self, ids: np.ndarray, probs: np.ndarray, position: int, n: int, salt: int = 0
    ) -> list[int]:
        scores = probs / self._exponentials(position, ids, salt)
        if n == 1:
            return [int(ids[int(np.argmax(scores))])]
        n = min(n, len(scores))
        top = np.argpartition(-scores, n - 1)[:n]
        return [int(ids[i]) for i in top[np.argsort(-scores[top], kind="stable")]]

    def _ranked_dense(self, dist: DenseDist, position: int, n: int) -> list[int]:
        """First a race of the blocks of BLOCK tokens, each run at its mass with noise of
        its own, then one of the winning block's tokens: a block wins with its mass and
        a token within it with its share, so the winner is still a draw from p, and a
        262k vocabulary hashes 256 blocks and 1024 tokens, not 262k."""
        masses = dist.block_masses()
        block = self._ranked(np.arange(len(masses)), masses, position, 1, _BLOCK_SALT)[0]
        start = block * BLOCK
        within = dist.probs[start : start + BLOCK]
        return self._ranked(dist.ids[start : start + len(within)], within, position, n)

    def _exponentials(self, position: int, ids: np.ndarray, salt: int = 0) -> np.ndarray:
        # One stream per position (and salt), from the key, in Python ints (a few numpy
        # calls on one word would cost more than the tokens' own); one word per token
        # within it (an odd multiplier and a bijective mix keep distinct tokens' words
        # distinct).
        stream = _mix(_mix(position * _GOLDEN & _MASK) ^ self.key ^ salt)
        words = _mix(np.asarray(ids).astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(stream))
        # The top 53 bits, as a float in (0, 1): never 0, whose log is -inf.
        uniforms = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        return -np.log(uniforms)


def _mix(x: Any) -> Any:
    """splitmix64's finaliser, of a Python int or a uint64 array (whose arithmetic wraps:
    the mask only keeps an int to 64 bits)."""
    for shift, factor in _SPLITMIX:
        x = ((x ^ (x >> shift)) * factor) & _MASK
    return x ^ (x >> 31)


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of n draft tokens (each the child of the one before): how a
    single-candidate draft is passed to the tree verifiers."""
    return list(range(-1, n - 1))


def _children(parents: Sequence[int], *per_node: Sequence[object]) -> list[list[int]]:
    """The children of each node, ascending, listed by the node's target row: entry 0 is
    the root's (the last accepted token), entry j + 1 node j's.

    Built in one pass, so walking a path never scans the tree for a node's children.
    `per_node` (tokens, proposals) are checked to have one entry per node.
    """
    if any(len(seq) != len(parents) for seq in per_node):
        raise ValueError("tokens, parents and proposals need one entry per node")
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"node {j}: parent {parent} is neither -1 nor an earlier node")
        kids[parent + 1].append(j)
    return kids


def verify_tree_greedy(
    tokens: Sequence[int], parents: Sequence[int], target_argmax: Callable[[int], int]
) -> tuple[list[int], int]:
    """Accept the longest path from the root whose every token is the target's argmax.

    `parents[j]` is node j's parent (-1: a child of the root, the last accepted token),
    always an earlier node. `target_argmax(r)` is the target's choice at row r: row 0
    follows the accepted context, row j + 1 follows node j. Only the rows along the
    accepted path are read, each once: any other row would be an argmax thrown away.
    Siblings are matched in ascending order (of equal tokens, the first is taken).
    Returns (the accepted nodes, root to leaf; the target's argmax after them).
    """
    kids = _children(parents, tokens)
    path: list[int] = []
    row = 0
    while True:
        choice = target_argmax(row)
        node = next((j for j in kids[row] if tokens[j] == choice), None)
        if node is None:
            return path, choice
        path.append(node)
        row = node + 1


def verify_tree_sampled(
    tokens: Sequence[int],
    parents: Sequence[int],
    dists: Sequence[Dist],
    target_dist: Callable[[int], Dist],
    rng: np.random.Generator,
    chances: list[float] | None = None,
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over a draft tree: the result is distributed
    exactly as sampling the target token by token.

    Tree and rows as in `verify_tree_greedy`; `dists[j]` is the proposal node j was drawn
    from, which may depend on anything before it (the draft's distribution with earlier
    siblings removed, a point for a deterministic candidate). At each node of the path,
    starting from the root with p its target row, the children are tried in order
    (`_accept_child`); the accepted child's row becomes p. When no child is accepted, or
    the node has none, the next token is drawn from p: what is left of the target after
    the rejections, or the whole row (the bonus token).

    A chain (`chain_parents`) takes one `rng.random()` per tried token and one sample,
    as the chain verifier always did, so a seed gives the same text either way.
    Returns (the accepted nodes, root to leaf; the next token). `chances`, if given,
    gets for each row on the path the chance its first child had of being accepted.
    """
    kids = _children(parents, tokens, dists)
    path: list[int] = []
    row = 0
    while True:
        p = target_dist(row)
        if chances is not None and kids[row]:
            chances.append(overlap(p, dists[kids[row][0]]))
        node, p = _accept_child(kids[row], tokens, dists, p, rng)
        if node is None:
            return path, p.sample(rng)
        path.append(node)
        row = node + 1


def overlap(p: Dist, q: Dist) -> float:
    """sum(min(p, q)): the chance that a token drawn from q is accepted where the target
    gives p. Known at every tested row, it says how good the draft is without the luck
    of one draw (a learner of acceptance that counts accepted tokens needs many rounds
    to tell a lucky draft from a good one)."""
    small, large = (p, q) if len(p.ids) <= len(q.ids) else (q, p)
    return float(np.minimum(small.probs, large.probs_at(small.ids)).sum())


def _accept_child(
    children: list[int],
    tokens: Sequence[int],
    dists: Sequence[Dist],
    p: Dist,
    rng: np.random.Generator,
) -> tuple[int | None, Dist]:
    """Recursive rejection sampling among siblings: child x, proposed from q, is accepted
    with probability min(1, p(x)/q(x)); a rejection replaces p by normalize(max(0, p - q)).

    Each step then yields p exactly: x with probability min(p, q)(x), the residual's
    share otherwise, whatever the next sibling's proposal is. Returns the accepted child
    (None if every one was rejected) and p as it stands.
    """
    for j in children:
        token, q = tokens[j], dists[j]
        # u < p/q, written without the division (q(x) > 0 since x was drawn from q).
        if rng.random() * q.prob(token) < p.prob(token):
            return j, p
        p = residual(p, q)
    return None, p
