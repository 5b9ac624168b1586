"""How wide each round's draft tree grows. The chain down its middle (how deep to
draft) is draftlength's choice; a tree policy adds the alternatives worth verifying
beside it, or none (None: the round drafts a chain).

A tree pays where verifying more tokens costs little more than verifying few (GPUs,
CPUs with spare compute): each extra node is one more token in the same target pass,
and it is accepted when the draft's first choice was wrong and this one right.
"""

from __future__ import annotations

from typing import Protocol

from specdec_cli.decoding.costmodel import Costs, verify_cost
from specdec_cli.decoding.draft import Draft, TreeShape
from specdec_cli.decoding.draftlength import Calibration

MAX_WIDTH = 4  # nodes extended per depth, and children per node, at most
# Verifying more tokens for at most this much more (in one-token target passes) than
# the chain's batch counts as free: how AutoTree judges how wide a tree is worth growing.
FLAT_EXTRA = 0.05


class NodeOdds:
    """The chance that the target takes a draft node, its parent taken, for the scores
    a tree's nodes are kept by (and AutoTree cuts by): a path's score is the chance that
    the target takes all of it.

    The draft's probabilities are that chance only for a well-calibrated draft; a draft
    unsure even where it is right (a random-weight 152k one here) gave deep nodes far
    too little, so trees spent their nodes near the root. So a first choice scores what
    first choices of its probability were worth in this generation's rounds so far
    (`Calibration`). Alternatives keep the draft's probability: calibrated the same way,
    by rank, they made trees worse on a trained draft (see benchmarks/README.md).
    """

    def __init__(self) -> None:
        self.begin()

    def begin(self) -> None:
        self.first_choices = Calibration()

    def chance(self, rank: int, probability: float) -> float:
        """The rank-th child (0: the draft's first choice) with the draft's `probability`."""
        return self.first_choices(probability) if rank == 0 else probability

    def observe(self, draft: Draft, path: list[int]) -> None:
        """Count the first choices the target was offered (their parent taken) and
        which of them it took."""
        if len(draft.confidences) != len(draft.tokens):
            return  # no probabilities to file them under (a lookup's, or a chain no one asked)
        taken = {-1, *path}
        has_first_child: set[int] = set()
        for node, parent in enumerate(draft.parent_list()):
            if parent in taken and parent not in has_first_child:
                self.first_choices.record(draft.confidences[node], node in taken)
            has_first_child.add(parent)


class TreePolicy(Protocol):
    def begin(self, invariant: bool = False) -> None:
        """A new generation: what the policy learnt is this generation's alone, so that
        a seed gives the same text in any generation (the shapes decide which random
        numbers each token uses). `invariant`: no draft changes its text (greedy,
        coupled)."""
        ...

    def shape(self, k: int, limit: int, beside: int = 0) -> TreeShape | None:
        """The shape of a round drafting k deep with room for `limit` tokens, beside
        `beside` tokens of other slots in the same target call."""
        ...

    def observe(self, draft: Draft, path: list[int]) -> None:
        """What the target accepted of the draft: the nodes of the accepted path."""
        ...


def spread(nodes: int, k: int) -> int:
    """Width and branching for `nodes` tokens about k deep: enough alternatives per
    depth to spend the nodes on, at least 2 (a tree), at most MAX_WIDTH."""
    return max(2, min(MAX_WIDTH, nodes // max(1, k)))


class FixedTree:
    """--tree N: up to N nodes every round, the likeliest paths first."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.odds = NodeOdds()

    def begin(self, invariant: bool = False) -> None:
        self.odds.begin()

    def shape(self, k: int, limit: int, beside: int = 0) -> TreeShape | None:
        nodes = min(self.nodes, limit)
        if nodes <= k:
            return None
        width = spread(nodes, k)
        return TreeShape(nodes, width, width, odds=self.odds.chance)

    def observe(self, draft: Draft, path: list[int]) -> None:
        self.odds.observe(draft, path)


Curves = dict[int, tuple[float, ...]]  # AutoTree.verify's, by the tokens beside
Plans = dict[tuple[int, int, int], tuple[float, int]]  # AutoTree._plan's


class AutoTree:
    """--tree auto: a node beside the chain is drafted only when it adds more expected
    tokens than its verification costs at the running rate.

    A node whose path the draft gives probability s adds about s tokens to a round.
    Once drafted, the tree is cut to the size that makes the most expected tokens per
    unit of cost (one target token's time), from the measured cost of each batch size:
    where verification is flat up to some size (a GPU), trees fill it and stop there.
    Before drafting, if even a token the draft is sure of could not pay for its place
    at the running rate R (tokens per unit of cost, from the measured costs, not the
    clock, so that a seed reproduces its text), the round is a chain; and after a tree
    was cut back to a chain, trees pause for a while (see PROBE_GAP). Where each token
    more in a batch costs a good part of a pass (this kind of CPU), rounds stay chains
    at next to no extra work.

    Beside other slots in one target call, a round's tokens cost what they add to the
    batch the others make: the flat part of the curve is shared, and where the others
    fill it, trees shrink to chains.
    """

    DECAY = 0.93  # per round, for the running rate
    # A round whose tree was cut back to a chain (nothing beside it paid) pauses trees
    # for PROBE_GAP rounds, doubling up to MAX_PROBE_GAP while that goes on: growing a
    # tree is work (draft calls over several branches, per-node probabilities). A chain
    # whose alternatives were lost in translation says nothing of what they pay.
    PROBE_GAP = 8
    MAX_PROBE_GAP = 64

    def __init__(self, costs: Costs, max_nodes: int, first: Costs | None = None) -> None:
        """`first`: what a rejection-sampled generation prices with (None: `costs`), the
        same in every run, as for AutoLength."""
        self.max_nodes = max_nodes
        # Per kind of generation (invariant or not): its costs, and what they decide,
        # worked out as asked: the curves (see verify) and plans (see _plan).
        self._pricings: dict[bool, tuple[Costs, Curves, Plans]] = {
            True: (costs, {}, {}),
            False: (first or costs, {}, {}),
        }
        self.odds = NodeOdds()
        self.begin()

    def begin(self, invariant: bool = False) -> None:
        self.costs, self._curves, self._plans = self._pricings[invariant]
        self.odds.begin()
        self.rate = 1.0  # tokens per unit of cost: target-only to start
        self._gap = self.PROBE_GAP
        self._wait = 0  # chain rounds left before the next tree
        self._trying = False  # this round was offered a tree

    def verify(self, beside: int = 0) -> tuple[float, ...]:
        """verify[n]: the cost of a target call that holds a round of n draft tokens (a
        batch of n + 1) and `beside` tokens of other slots; extrapolated where unmeasured.
        What a node costs is a difference of two of these: the slope where the call is."""
        if beside not in self._curves:
            sizes = range(beside + 1, beside + self.max_nodes + 2)
            self._curves[beside] = tuple(verify_cost(self.costs.verify, n) for n in sizes)
        return self._curves[beside]

    def shape(self, k: int, limit: int, beside: int = 0) -> TreeShape | None:
        nodes = min(self.max_nodes, limit)
        if nodes <= k:
            return None
        extra, width = self._plan(k, nodes, beside)
        bar = self.rate * extra
        if bar >= 1.0:  # not even a certain token beside the chain would pay: a chain
            return None
        if self._wait:
            self._wait -= 1
            return None
        self._trying = True
        return TreeShape(
            nodes,
            width,
            width,
            min_score=max(0.0, bar),
            verify=self.verify(beside)[: nodes + 1],
            draft_call=self.costs.draft_over_target,
            odds=self.odds.chance,
        )

    def _plan(self, k: int, nodes: int, beside: int) -> tuple[float, int]:
        """cheapest_extra, and the width (as for --tree N, from flat_nodes), of a round
        k deep with room for `nodes` beside `beside` tokens: asked every round, for a
        few (k, nodes, beside), worked out once each."""
        key = (k, nodes, beside)
        if key not in self._plans:
            width = spread(self.flat_nodes(k, nodes, beside), k)
            self._plans[key] = self.cheapest_extra(k, nodes, beside), width
        return self._plans[key]

    def cheapest_extra(self, k: int, nodes: int, beside: int = 0) -> float:
        """The least that a token beside a k-token chain adds to the verification, on
        average over the ones added with it (a curve can be uneven), counting the graph
        rebuild that leaving the chain's batch size costs."""
        verify, switch = self.verify(beside), self.costs.switch
        base = verify[k]
        return min((verify[n] - base + switch) / (n - k) for n in range(k + 1, nodes + 1))

    def flat_nodes(self, k: int, nodes: int, beside: int = 0) -> int:
        """The most draft tokens (k at least, `nodes` at most) that verify for about
        the price of the k-token chain's batch.

        The width follows from it as for --tree N (`spread`). Replayed under a GPU-like
        curve, a tree of mostly chain with a second choice per depth beat one with four
        alternatives per node, ranked by the draft's path probabilities, wherever the
        chain was deep (see benchmarks/README.md)."""
        verify = self.verify(beside)
        return max(n for n in range(k, nodes + 1) if verify[n] - verify[k] <= FLAT_EXTRA)

    def observe(self, draft: Draft, path: list[int]) -> None:
        trying, self._trying = self._trying, False
        if not draft.tokens:
            return
        self.odds.observe(draft, path)
        costs, batch = self.costs, len(draft.tokens) + 1
        cost = draft.calls * costs.draft_over_target + verify_cost(costs.verify, batch)
        self.rate += (1.0 - self.DECAY) * ((len(path) + 1) / cost - self.rate)
        if trying:
            if draft.parents is None and not draft.alternatives_lost:  # cut back to a chain
                self._wait, self._gap = self._gap, min(2 * self._gap, self.MAX_PROBE_GAP)
            else:
                self._gap = self.PROBE_GAP
