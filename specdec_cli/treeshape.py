"""How wide each round's draft tree grows. The chain down its middle (how deep to
draft) is draftlength's choice; a tree policy adds the alternatives worth verifying
beside it, or none (None: the round drafts a chain).

A tree pays where verifying more tokens costs little more than verifying few (GPUs,
CPUs with spare compute): each extra node is one more token in the same target pass,
and it is accepted when the draft's first choice was wrong and this one right.
"""

from __future__ import annotations

from typing import Protocol

from specdec_cli.costmodel import Costs, verify_cost
from specdec_cli.drafters import Draft, TreeShape

MAX_WIDTH = 4  # nodes extended per depth, and children per node, at most


class TreePolicy(Protocol):
    def shape(self, k: int, limit: int) -> TreeShape | None:
        """The shape of a round drafting k deep with room for `limit` tokens."""
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

    def shape(self, k: int, limit: int) -> TreeShape | None:
        nodes = min(self.nodes, limit)
        if nodes <= k:
            return None
        width = spread(nodes, k)
        return TreeShape(nodes, width, width)

    def observe(self, draft: Draft, path: list[int]) -> None:
        pass


class AutoTree:
    """--tree auto: a node beside the chain is drafted only when it adds more expected
    tokens than its verification costs at the running rate.

    Tokens per unit of cost (one target token's time) of the rounds so far, R, come
    from the measured costs, not the clock, so that a seed reproduces its text. A node
    whose path the draft gives probability s adds about s tokens to a round; as the n-th
    token of the batch it costs dv(n), what the measured curve adds from n to n + 1
    tokens; it is worth it if s > R * dv(n), counting a compute graph rebuild for the
    first beyond the chain (the batch size changes). Where verification cost grows
    steeply with the batch (this kind of CPU), the bars are high and rounds stay
    chains; where it is flat up to some size (a GPU), trees fill it and stop there.
    """

    DECAY = 0.93  # per round, for the running rate

    def __init__(self, costs: Costs, max_nodes: int) -> None:
        self.costs = costs
        self.max_nodes = max_nodes
        self.rate = 1.0  # tokens per unit of cost: target-only to start

    def bars(self, k: int, nodes: int) -> tuple[float, ...]:
        """The smallest path probability the n-th draft token (n = 1..nodes) needs to pay
        for itself: the rate times what it adds to the batch's cost (the first beyond the
        k-token chain also changes the batch size: a graph rebuild)."""
        verify = self.costs.verify
        bars = []
        for n in range(1, nodes + 1):
            extra = verify_cost(verify, n + 1) - verify_cost(verify, n)
            extra += self.costs.switch if n == k + 1 else 0.0
            bars.append(self.rate * max(extra, 0.0))
        return tuple(bars)

    def shape(self, k: int, limit: int) -> TreeShape | None:
        nodes = min(self.max_nodes, limit)
        if nodes <= k:
            return None
        bars = self.bars(k, nodes)
        lowest = min(bars[k:])
        if lowest >= 1.0:  # no side node could pay: a chain
            return None
        return TreeShape(nodes, MAX_WIDTH, MAX_WIDTH, min_score=lowest, bars=bars)

    def observe(self, draft: Draft, path: list[int]) -> None:
        if not draft.tokens:
            return
        costs, batch = self.costs, len(draft.tokens) + 1
        cost = draft.calls * costs.draft_over_target + verify_cost(costs.verify, batch)
        self.rate += (1.0 - self.DECAY) * ((len(path) + 1) / cost - self.rate)
