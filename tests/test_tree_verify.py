"""Tree verification alone: no model. Greedy paths and the rows they read; sampling that
stays exactly the target's distribution whatever the tree's shape and proposals, checked
by chi-square, with negative controls showing the same check sees a wrong rule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pytest
from scipy.stats import chisquare

from specdec_cli.decoding.sampling import (
    DenseDist,
    Dist,
    chain_parents,
    residual,
    verify_tree_greedy,
    verify_tree_sampled,
)

N_VOCAB = 6
N_TRIALS = 12_000
P_OK = 1e-3  # fixed seeds make every test deterministic; this guards real mismatches
P_WRONG = 1e-6  # what a negative control must reach

T = TypeVar("T")
Verifier = Callable[
    [Sequence[int], Sequence[int], Sequence[Dist], Callable[[int], Dist], np.random.Generator],
    tuple[list[int], int],
]


def recording(rows: Callable[[int], T], asked: list[int]) -> Callable[[int], T]:
    """`rows`, noting every row it is asked for in `asked`."""

    def read(row: int) -> T:
        asked.append(row)
        return rows(row)

    return read


def path_rows(path: list[int]) -> list[int]:
    """The rows a verifier may read for an accepted path: the root's, then each node's."""
    return [0] + [j + 1 for j in path]


# Greedy. Each case: tokens, parents, the target's argmax at the rows it may read, the
# expected path and next token. A row outside the dict raises KeyError.
GREEDY_CASES = {
    "chain, stops at the 3rd": ([4, 7, 1, 9], [-1, 0, 1, 2], {0: 4, 1: 7, 2: 2}, [0, 1], 2),
    "chain, all accepted": ([4, 7, 1], [-1, 0, 1], {0: 4, 1: 7, 2: 1, 3: 3}, [0, 1, 2], 3),
    "empty draft": ([], [], {0: 5}, [], 5),
    "star, 3rd child": ([5, 6, 7], [-1, -1, -1], {0: 7, 3: 8}, [2], 8),
    "star, none": ([5, 6, 7], [-1, -1, -1], {0: 9}, [], 9),
    # Breadth-first: the root's children 0, 1; node 0's 2, 3; node 1's 4, 5.
    "two levels, 2nd then 2nd": (
        [1, 2, 3, 4, 5, 6],
        [-1, -1, 0, 0, 1, 1],
        {0: 2, 2: 6, 6: 0},
        [1, 5],
        0,
    ),
    "two levels, 1st then none": ([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 1], {0: 1, 1: 5}, [0], 5),
    "two levels, none": ([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 1], {0: 9}, [], 9),
    # Depth-first order: the root's children 0, 5, 8; node 0's 1, 4; node 1's 2, 3;
    # node 5's 6, 7.
    "depth first, 2nd then 2nd": (
        [1, 4, 7, 8, 5, 2, 6, 9, 3],
        [-1, 0, 1, 1, 0, -1, 5, 5, -1],
        {0: 2, 6: 9, 8: 4},
        [5, 7],
        4,
    ),
    "depth first, 1st then 2nd": (
        [1, 4, 7, 8, 5, 2, 6, 9, 3],
        [-1, 0, 1, 1, 0, -1, 5, 5, -1],
        {0: 1, 1: 5, 5: 0},
        [0, 4],
        0,
    ),
    # 3rd of 3, 2nd of 3, 2nd of 2, the only child, then the bonus token.
    "deep, later siblings": (
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [-1, -1, -1, 2, 2, 2, 4, 4, 7],
        {0: 3, 3: 5, 5: 8, 8: 9, 9: 0},
        [2, 4, 7, 8],
        0,
    ),
    "duplicate siblings: the first": ([3, 3], [-1, -1], {0: 3, 1: 1}, [0], 1),
}


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_tree_greedy_accepts_longest_argmax_path(case: str) -> None:
    tokens, parents, argmax, path, nxt = GREEDY_CASES[case]
    asked: list[int] = []
    assert verify_tree_greedy(tokens, parents, recording(argmax.__getitem__, asked)) == (
        path,
        nxt,
    )
    assert asked == path_rows(path)  # lazily: only along the path, each row once


def test_tree_rejects_malformed_trees() -> None:
    with pytest.raises(ValueError, match="parent"):
        verify_tree_greedy([1, 2], [-1, 1], lambda r: 0)  # a node its own parent
    with pytest.raises(ValueError, match="one entry per node"):
        verify_tree_greedy([1, 2], [-1], lambda r: 0)
    with pytest.raises(ValueError, match="one entry per node"):
        verify_tree_sampled([1], [-1], [], lambda r: Dist.point(1), np.random.default_rng())


# Chains: the same results and the same use of the random stream as the chain verifier
# before trees (copied here as the reference), so seeds reproduce text.
def old_verify_greedy(draft: Sequence[int], target_argmax: Callable[[int], int]) -> tuple[int, int]:
    for i, token in enumerate(draft):
        choice = target_argmax(i)
        if choice != token:
            return i, choice
    return len(draft), target_argmax(len(draft))


def old_verify_sampled(
    draft: Sequence[int],
    draft_dists: Sequence[Dist],
    target_dist: Callable[[int], Dist],
    rng: np.random.Generator,
) -> tuple[int, int]:
    for i, (token, q) in enumerate(zip(draft, draft_dists, strict=True)):
        p = target_dist(i)
        if rng.random() * q.prob(token) < p.prob(token):
            continue
        return i, residual(p, q).sample(rng)
    return len(draft), target_dist(len(draft)).sample(rng)


def random_dist(rng: np.random.Generator, alpha: float = 1.0, n_zero: int = 0) -> Dist:
    """A Dirichlet draw over N_VOCAB tokens, `n_zero` of them (random) left out."""
    ids = np.sort(rng.choice(N_VOCAB, N_VOCAB - n_zero, replace=False))
    return Dist(ids, rng.dirichlet(np.full(len(ids), alpha)))


def test_chain_matches_the_chain_verifier() -> None:
    rng = np.random.default_rng(11)
    accepted = []
    for seed in range(400):
        k = int(rng.integers(0, 6))
        p_rows = [random_dist(rng, 0.5, int(rng.integers(0, 3))) for _ in range(k + 1)]
        # Proposals as the drafters make them: a model's q, a point, or (often, for long
        # accepted runs) p itself.
        kinds = rng.choice(3, k, p=[0.3, 0.1, 0.6])
        dists = [
            (random_dist(rng, 0.5), Dist.point(int(rng.integers(N_VOCAB))), p)[kind]
            for kind, p in zip(kinds, p_rows[:k], strict=True)
        ]
        tokens = [q.sample(rng) for q in dists]
        old_rng, new_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        n, nxt = old_verify_sampled(tokens, dists, p_rows.__getitem__, old_rng)
        path, new_nxt = verify_tree_sampled(
            tokens, chain_parents(k), dists, p_rows.__getitem__, new_rng
        )
        assert (path, new_nxt) == (list(range(n)), nxt)
        assert old_rng.random() == new_rng.random()  # the stream is at the same place
        argmax = [int(p.ids[np.argmax(p.probs)]) for p in p_rows]
        n, nxt = old_verify_greedy(tokens, argmax.__getitem__)
        assert verify_tree_greedy(tokens, chain_parents(k), argmax.__getitem__) == (
            list(range(n)),
            nxt,
        )
        accepted.append(n)
    assert 0 in accepted and max(accepted) >= 4  # rejections early and late both seen


# Sampling over trees. A toy language model gives a distribution after every context of
# up to two tokens, so every row of the target depends on the path to it.
Model = dict[tuple[int, ...], Dist]


def toy_target(rng: np.random.Generator) -> Model:
    """Every row leaves out one token, as the target's filters would."""
    contexts = [(), *((a,) for a in range(N_VOCAB))]
    contexts += [(a, b) for a in range(N_VOCAB) for b in range(N_VOCAB)]
    return {c: random_dist(rng, alpha=2.0, n_zero=1) for c in contexts}


def toy_draft(target: Model, rng: np.random.Generator) -> Model:
    """A draft that puts 0.4 on the token the target leaves out and spreads the rest
    partly as the target, partly at random: its first guesses are often rejected, so the
    later siblings, the residuals and the depth-2 nodes all do work. A wrong verifier
    then goes wrong by a lot (the negative controls below)."""
    out = {}
    for context, p in target.items():
        target_row = dense(p)
        noise = rng.dirichlet(np.full(N_VOCAB, 0.5))
        row = 0.4 * (target_row == 0) + 0.6 * (0.3 * target_row + 0.7 * noise)
        out[context] = Dist(np.arange(N_VOCAB), row)
    return out


def without(q: Dist, token: int) -> Dist:
    """q with `token` removed, renormalised: how a distinct next sibling is drawn."""
    keep = q.ids != token
    return Dist(q.ids[keep], q.probs[keep] / q.probs[keep].sum())


@dataclass
class Tree:
    """A draft tree as it is drawn. `dists` are the true proposals; `naive` the draft
    model's distribution at each node's parent, a proposal a wrong verifier might use."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)
    naive: list[Dist] = field(default_factory=list)

    def add(self, parent: int, token: int, dist: Dist, naive: Dist) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.dists.append(dist)
        self.naive.append(naive)

    def context(self, node: int) -> tuple[int, ...]:
        """The tokens from the root's first child down to `node` (-1: none)."""
        out: list[int] = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return tuple(reversed(out))


def sampled(
    tree: Tree, parent: int, n: int, draft: Model, rng: np.random.Generator, distinct: bool
) -> None:
    """n children drawn from the draft: i.i.d., or each from what earlier ones left."""
    q = draft[tree.context(parent)]
    proposal = q
    for _ in range(n):
        token = proposal.sample(rng)
        tree.add(parent, token, proposal, q)
        if distinct:
            if len(proposal.ids) == 1:
                return
            proposal = without(proposal, token)


def sampled_then_best(
    tree: Tree, parent: int, n: int, draft: Model, rng: np.random.Generator
) -> None:
    """One child drawn from the draft, then its n - 1 likeliest other tokens as points."""
    q = draft[tree.context(parent)]
    token = q.sample(rng)
    tree.add(parent, token, q, q)
    best_points(tree, parent, n - 1, draft, skip=token)


def best_points(tree: Tree, parent: int, n: int, draft: Model, skip: int = -1) -> None:
    """The draft's n likeliest tokens (but `skip`) as deterministic children."""
    q = draft[tree.context(parent)]
    best = [int(t) for t in q.ids[np.argsort(-q.probs, kind="stable")] if t != skip]
    for token in best[:n]:
        tree.add(parent, token, Dist.point(token), q)


def depth_two(draft: Model, rng: np.random.Generator) -> Tree:
    """Three distinct children of the root; two distinct sampled children under the
    first, the draft's two likeliest tokens as points under the second, none under the
    third (a leaf: its bonus token)."""
    tree = Tree()
    sampled(tree, -1, 3, draft, rng, distinct=True)
    sampled(tree, 0, 2, draft, rng, distinct=True)
    best_points(tree, 1, 2, draft)
    return tree


SHAPES: dict[str, Callable[[Model, np.random.Generator], Tree]] = {
    "3 i.i.d. children": lambda d, r: _build(sampled, d, r, 3, distinct=False),
    "3 distinct children": lambda d, r: _build(sampled, d, r, 3, distinct=True),
    "sampled + 2 points": lambda d, r: _build(sampled_then_best, d, r, 3),
    "depth 2": depth_two,
}


def _build(
    children: Callable[..., None], draft: Model, rng: np.random.Generator, n: int, **kw: bool
) -> Tree:
    tree = Tree()
    children(tree, -1, n, draft, rng, **kw)
    return tree


def first_two_tokens(
    shape: str, verify: Verifier, naive: bool, n_trials: int, seed: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the first two output tokens over fresh trees, and their exact target
    probabilities. The second token is the path's or the verifier's next; when only one
    token came out, it is drawn from the target after it, as plain decoding would."""
    rng = np.random.default_rng(seed)
    target = toy_target(rng)
    draft = toy_draft(target, rng)
    counts = np.zeros((N_VOCAB, N_VOCAB))
    for _ in range(n_trials):
        tree = SHAPES[shape](draft, rng)
        asked: list[int] = []
        rows = recording(lambda r, t=tree: target[t.context(r - 1)], asked)
        dists = tree.naive if naive else tree.dists
        path, nxt = verify(tree.tokens, tree.parents, dists, rows, rng)
        assert asked == path_rows(path)
        out = [*(tree.tokens[j] for j in path[:2]), nxt]
        if len(out) < 2:
            out.append(target[(out[0],)].sample(rng))
        counts[out[0], out[1]] += 1
    after_first = np.array([dense(target[(a,)]) for a in range(N_VOCAB)])
    return counts, dense(target[()])[:, None] * after_first


def dense(d: Dist, n: int = N_VOCAB) -> np.ndarray:
    out = np.zeros(n)
    out[d.ids] = d.probs
    return out


def fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs on probs' support (none may fall off it)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target excludes"
    return float(chisquare(counts[support], probs[support] * counts.sum()).pvalue)


def p_values(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(first token, the pair of the first two)."""
    return fit(counts.sum(axis=1), expected.sum(axis=1)), fit(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_sampling_matches_target(shape: str) -> None:
    first, pair = p_values(*first_two_tokens(shape, verify_tree_sampled, False, N_TRIALS))
    print(f"{shape}: p first {first:.3g}, pair {pair:.3g}")
    assert first > P_OK
    assert pair > P_OK


def skipping_residual(skip: Callable[[Dist], bool]) -> Verifier:
    """verify_tree_sampled with one mistake: after rejecting a sibling whose proposal
    `skip` picks, the next sibling is tested against the same p, not the residual."""

    def verify(
        tokens: Sequence[int],
        parents: Sequence[int],
        dists: Sequence[Dist],
        target_dist: Callable[[int], Dist],
        rng: np.random.Generator,
    ) -> tuple[list[int], int]:
        kids = [[j for j, a in enumerate(parents) if a == r - 1] for r in range(len(parents) + 1)]
        path: list[int] = []
        row = 0
        while True:
            p = target_dist(row)
            for j in kids[row]:
                if rng.random() * dists[j].prob(tokens[j]) < p.prob(tokens[j]):
                    path.append(j)
                    row = j + 1
                    break
                if not skip(dists[j]):
                    p = residual(p, dists[j])
            else:
                return path, p.sample(rng)

    return verify


# (tree shape, verifier, whether the verifier is given the naive proposals)
MISTAKES: dict[str, tuple[str, Verifier, bool]] = {
    "p kept after every rejection": (
        "3 distinct children",
        skipping_residual(lambda q: True),
        False,
    ),
    "p kept after a rejected point": (
        "sampled + 2 points",
        skipping_residual(lambda q: len(q.ids) == 1),
        False,
    ),
    "earlier siblings not removed from q": ("3 distinct children", verify_tree_sampled, True),
    "points verified as drawn from q": ("sampled + 2 points", verify_tree_sampled, True),
    "depth 2, p kept after every rejection": ("depth 2", skipping_residual(lambda q: True), False),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_chi_square_detects_a_wrong_tree_rule(mistake: str) -> None:
    shape, verify, naive = MISTAKES[mistake]
    first, pair = p_values(*first_two_tokens(shape, verify, naive, N_TRIALS // 4))
    print(f"{mistake}: p first {first:.3g}, pair {pair:.3g}")
    assert min(first, pair) < P_WRONG


def test_all_points_rejected_sample_from_the_residual() -> None:
    """Rejected point candidates are out of the residual: never the next token."""
    rng = np.random.default_rng(9)
    candidates = [1, 2, 3]
    points = [Dist.point(t) for t in candidates]
    p = Dist(np.arange(N_VOCAB), np.array([0.1, 0.2, 0.15, 0.05, 0.3, 0.2]))
    residual_counts = np.zeros(N_VOCAB)
    for _ in range(2000):
        path, nxt = verify_tree_sampled(candidates, [-1] * 3, points, lambda r: p, rng)
        if not path:
            residual_counts[nxt] += 1
    assert 0 < residual_counts.sum() < 2000  # some accepted, some all rejected
    assert not residual_counts[candidates].any()
    # What is left of p: its other tokens, in proportion.
    assert fit(residual_counts, np.array([0.1, 0, 0, 0, 0.3, 0.2]) / 0.6) > P_OK
    # The target excludes them all: every one is rejected, only row 0 is read.
    p = Dist(np.array([0, 4, 5]), np.array([0.2, 0.5, 0.3]))
    for _ in range(200):
        asked: list[int] = []
        path, nxt = verify_tree_sampled(
            candidates, [-1] * 3, points, recording(lambda r: p, asked), rng
        )
        assert (path, asked) == ([], [0])
        assert nxt in (0, 4, 5)


def test_dense_target_with_sparse_and_point_proposals() -> None:
    """A whole-vocabulary p (DenseDist) against a sparse draft q and two points: the
    first token still follows p (bins: the strong tokens, the rest in four runs)."""
    n = 5000
    rng = np.random.default_rng(12)
    weights = rng.random(n)
    strong = np.array([0, 17, 1023, 1024, 2500, n - 1])
    weights[strong] = [400, 900, 300, 600, 500, 200]
    p = DenseDist.from_weights(weights)
    q = Dist(np.sort(np.append(strong[:4], [5, 3000])), np.full(6, 1 / 6))
    counts = np.zeros(n)
    for _ in range(N_TRIALS // 3):
        first = q.sample(rng)
        others = [int(t) for t in (17, 1024, 2500) if t != first][:2]
        tokens = [first, *others]
        dists = [q, *(Dist.point(t) for t in others)]
        path, nxt = verify_tree_sampled(tokens, [-1] * 3, dists, lambda r: p, rng)
        if not path:
            assert nxt not in others
        counts[tokens[path[0]] if path else nxt] += 1
    bins = np.searchsorted([1250, 2500, 3750], np.arange(n), side="right") + len(strong)
    bins[strong] = np.arange(len(strong))
    observed = np.bincount(bins, weights=counts)
    expected = np.bincount(bins, weights=dense(p, n))
    assert fit(observed, expected) > P_OK
