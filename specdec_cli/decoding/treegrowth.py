"""How a draft model (or a drafting head) grows one round's draft tree, depth by depth."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.decoding.draft import Draft, DraftSteps, KeepDrafting, TreeShape
from specdec_cli.decoding.sampling import chain_parents

if TYPE_CHECKING:
    from specdec_cli.decoding.modeldrafter import ModelDrafter


class TreeGrowth:
    """One round's draft tree, grown depth by depth by a draft model (or a drafting
    head, which reads beside each node its own state at the parent's row: see
    ModelDrafter.stage_nodes).

    The first child of each node is the token a chain would have drafted there; the
    path of first children from the root (the primary path) is what a chain is, and it
    stays in the draft's sequence 0. Other nodes get branches of their own (sequences
    forked from their parent's) when they are extended. At each depth the `width`
    likeliest nodes (the primary one first) are evaluated in one decode call, which
    gives their children. Finally the likeliest `nodes` are kept, the primary path
    first: whether a sampled token is kept must not depend on which token it is, and
    its score (its parent's times q's top probability) does not.
    """

    def __init__(
        self,
        drafter: ModelDrafter,
        base: int,
        shape: TreeShape,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None,
        start: int | None = None,
    ) -> None:
        """`base`: the text's length, where the draft starts; `start`: the position in
        the context's memory of the first draft token (None: base; a head's memory may
        lie a position behind the text, see HeadContext.shift)."""
        self.drafter, self.ctx = drafter, drafter.ctx
        self.base, self.shape, self.rng = base, shape, rng
        self.start = base if start is None else start
        self.keep_drafting = keep_drafting
        self.draft = Draft(source=drafter.name, parents=[])
        self.scores: list[float] = []
        self.primary: list[bool] = []
        self.seq_of = {-1: 0}  # the sequence of each evaluated node; -1: the root
        # The row of each node in the call that evaluated it, the root's in the call
        # before the tree (-1: its last): where its children's logits are.
        self.row_of = {-1: -1}
        self.n_seqs = 1

    def grow(self, k: int) -> DraftSteps:
        if self.shape.is_chain:
            return (yield from self._grow_chain(k))
        frontier = [-1]
        for depth in range(k):
            if depth:
                frontier = self._stage(frontier, depth)
                yield
            rows = range(len(frontier)) if depth else [-1]
            new: list[int] = []
            for row, node in zip(rows, frontier, strict=True):
                logits = self.ctx.logits(row)[: self.drafter.n_vocab]
                new += self._add_children(node, logits, depth)
            frontier = self._to_extend(new, self.shape.width)
            if not frontier:
                break
        return self._kept()

    def _grow_chain(self, k: int) -> DraftSteps:
        """A chain: the tree of one node a depth, grown without ranking a frontier. Node
        d - 1 (the last) is staged alone in sequence 0, and its row gives node d (the
        first depth's is the last row of the call before the tree)."""
        drafter, draft, row = self.drafter, self.draft, -1
        for depth in range(k):
            if depth:
                pos = self.start + depth - 1
                drafter.stage_nodes([draft.tokens[-1]], [pos], [0], [row])
                draft.calls += 1
                row = 0
                yield
            logits = self.ctx.logits(row)[: drafter.n_vocab]
            position = self.base + depth
            if not drafter.take_next(draft, logits, self.rng, position, self.keep_drafting):
                break
        return self._kept()

    def _add_children(self, node: int, logits: np.ndarray, depth: int) -> list[int]:
        shape, draft = self.shape, self.draft
        on_primary = node < 0 or self.primary[node]
        parent_score = self.scores[node] if node >= 0 else 1.0
        # Under a grammar, the children's mask is the one after the node's path.
        path = self.draft.path(node) if self.drafter.constraint else ()
        need_confidence = True  # a tree's ranks need every node's probability
        ids, probs, dists = self.drafter.children(
            logits, self.rng, shape.branch, need_confidence, self.base + depth, path
        )
        if on_primary and self.keep_drafting and not self.keep_drafting(depth, probs[0]):
            return []
        added = []
        for i, (token, prob, dist) in enumerate(zip(ids, probs, dists, strict=True)):
            score = parent_score * (shape.odds(i, prob) if shape.odds else prob)
            primary = on_primary and i == 0
            # (0: a token a grammar forbids, where it allows fewer than the branches)
            if not primary and (score < shape.min_score or not prob):
                continue
            added.append(len(draft.tokens))
            draft.tokens.append(token)
            draft.parents.append(node)  # type: ignore[union-attr]
            if dist is not None:
                draft.dists.append(dist)
            draft.confidences.append(prob)
            self.scores.append(score)
            self.primary.append(primary)
        return added

    def _rank(self, node: int) -> tuple[bool, float, int]:
        """Sorts the primary path first, then the likeliest paths; a parent before its
        children (a child's score is at most its parent's, and its index higher)."""
        return not self.primary[node], -self.scores[node], node

    def _to_extend(self, nodes: list[int], n: int) -> list[int]:
        """The n likeliest of `nodes`, the primary one first, then in index order."""
        ranked = sorted(nodes, key=self._rank)
        return sorted(ranked[:n])

    def _stage(self, frontier: list[int], depth: int) -> list[int]:
        """The frontier's nodes (all at `depth`) staged for one decode call, each in its
        own branch; returns the nodes staged (not those the context had no branch for)."""
        pos = self.start + depth - 1
        nodes, seqs, parent_rows, extended = [], [], [], set()
        for node in frontier:
            parent = self.draft.parents[node]  # type: ignore[index]
            seq = self.seq_of[parent]
            if seq in extended:  # a sibling went on in the parent's sequence
                if self.n_seqs >= self.ctx.n_seq_max:
                    continue
                self.ctx.fork(seq, self.n_seqs, pos)
                seq, self.n_seqs = self.n_seqs, self.n_seqs + 1
            extended.add(seq)
            self.seq_of[node], self.row_of[node] = seq, len(nodes)
            nodes.append(node)
            seqs.append(seq)
            parent_rows.append(self.row_of[parent])
        tokens = [self.draft.tokens[i] for i in nodes]
        self.drafter.stage_nodes(tokens, [pos] * len(nodes), seqs, parent_rows)
        self.draft.calls += 1
        return nodes

    def _worth_keeping(self, ranked: list[int]) -> int:
        """How many of the ranked nodes to keep: all the shape allows, or with its costs,
        the primary path and then as many others as make the most expected tokens per
        cost (a curve can be uneven: 4 tokens may cost less than 3)."""
        shape = self.shape
        n = min(len(ranked), shape.nodes)
        if not shape.verify:
            return n
        drafted = self.draft.calls * shape.draft_call
        best, best_rate, expected = 0, 0.0, 1.0
        for place, i in enumerate(ranked[:n]):
            expected += self.scores[i]
            rate = expected / (drafted + shape.verify[place + 1])
            if self.primary[i] or rate > best_rate:
                best, best_rate = place + 1, rate
        return best

    def _kept(self) -> Draft:
        """The draft cut to the likeliest `nodes` tokens, the primary path first."""
        draft, n = self.draft, len(self.draft.tokens)
        if self.shape.is_chain:
            draft.parents = None
            return draft
        ranked = sorted(range(n), key=self._rank)
        keep = sorted(ranked[: self._worth_keeping(ranked)])
        index = {old: new for new, old in enumerate(keep)}
        index[-1] = -1
        parents = [index[(draft.parents or [])[i]] for i in keep]
        return Draft(
            tokens=[draft.tokens[i] for i in keep],
            dists=[draft.dists[i] for i in keep] if draft.dists else [],
            confidences=[draft.confidences[i] for i in keep] if draft.confidences else [],
            calls=draft.calls,
            source=draft.source,
            parents=None if parents == chain_parents(len(keep)) else parents,
        )
