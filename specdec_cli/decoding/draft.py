"""What a drafter proposes, and how its rounds run. The decode loop verifies drafts; a
drafter only guesses.

Every drafter answers `drafting(tokens, k, rng)`: given the whole accepted sequence
(prompt and output so far), up to k guesses for what comes next, with the
distribution each guess was drawn from when sampling (the acceptance rule needs q).
With a `shape` wider than a chain, the guesses form a tree: alternatives for the
same position, all verified in one target pass.

A draft model's round is a generator that stops at each of its decode calls: it
stages its tokens and yields, and whoever drives it decodes them. Run alone
(`propose`), each call is its own; run beside other slots' rounds (`draft_together`),
one call decodes every slot's next draft tokens, as one target call verifies them all.

The drafters: modeldrafter.py (a draft model; heads.py's drafting heads draft as one),
ngram.py (prompt lookup), lookupthenmodel.py (the one or the other, by their recent
hits) and translate.py (a draft of another vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.sampling import Dist, Noise, SamplingParams, chain_parents
from specdec_cli.llamacpp.llama import Context


@dataclass
class Draft:
    """Draft tokens; a tree when `parents` is given. Children of a node are tried in the
    order of their indices, and parents come before children."""

    tokens: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # q for each token; empty when greedy
    confidences: list[float] = field(default_factory=list)  # the draft's top probability
    calls: int = 0  # draft model decode calls it took
    source: str = ""
    # Each token's parent (its index; -1: the last accepted token). None: a chain.
    parents: list[int] | None = None
    # A chain only because the alternatives the drafter grew were lost on the way (a
    # translated tree whose paths spell the same target tokens), not because none paid.
    alternatives_lost: bool = False

    def parent_list(self) -> list[int]:
        if self.parents is None:
            return chain_parents(len(self.tokens))
        return self.parents

    def primary_nodes(self) -> list[int]:
        """The nodes down the first children: what a chain would have drafted."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        path, node = [], -1
        for i, parent in enumerate(self.parents):
            if parent == node:
                path.append(i)
                node = i
        return path

    def path(self, node: int) -> list[int]:
        """The tokens from the root to `node`, itself the last (none for the root, -1)."""
        parents = self.parent_list()
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = parents[node]
        return path[::-1]

    def primary_path(self) -> list[int]:
        return [self.tokens[i] for i in self.primary_nodes()]

    def beside_primary(self, path: list[int]) -> int:
        """How many nodes of an accepted path a chain would not have had: those from
        where it leaves the primary path."""
        if self.parents is None:
            return 0
        primary = self.primary_nodes()
        same = 0
        while same < min(len(path), len(primary)) and path[same] == primary[same]:
            same += 1
        return len(path) - same

    def depths(self) -> list[int]:
        """Each node's depth: 0 for a child of the last accepted token."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        """The longest path: what a chain of the same depth would be long."""
        return max(self.depths(), default=-1) + 1


def merge_into_tree(draft: Draft, continuations: list[list[int]], n_max: int) -> None:
    """The continuations as one tree (a trie: a shared start is one path), in order, up
    to n_max tokens. One continuation, or several alike, stay a chain."""
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for continuation in continuations:
        parent = -1
        for token in continuation:
            node = node_of.get((parent, token))
            if node is None:
                if len(draft.tokens) >= n_max:
                    break
                node = node_of[parent, token] = len(draft.tokens)
                draft.tokens.append(token)
                parents.append(parent)
            parent = node
    if parents != chain_parents(len(parents)):
        draft.parents = parents


@dataclass(frozen=True)
class TreeShape:
    """How one round's draft may grow. Depth d (from 0) adds children to the `width`
    likeliest nodes of depth d-1, up to `branch` each; at most `nodes` tokens are kept,
    the primary path (first children) first, then the likeliest others (a node's score
    is the chance that the target takes its whole path: the product of `odds(rank,
    probability)` down it, or of the draft's probabilities without `odds`). Side nodes
    (not first children) below `min_score` are not drafted. With `verify` (the target's
    cost of a batch of n tokens at n - 1, in one-token passes) and `draft_call` (a draft
    call's cost), the kept tokens are cut to the number that maximises the round's
    expected tokens per cost: 1 plus the kept scores, over the draft calls and the
    verification. A chain: nodes = k, width = branch = 1."""

    nodes: int
    width: int = 1
    branch: int = 1
    min_score: float = 0.0
    verify: tuple[float, ...] = ()
    draft_call: float = 0.0
    odds: Callable[[int, float], float] | None = None

    @property
    def is_chain(self) -> bool:
        return self.branch == 1


KeepDrafting = Callable[[int, float], bool]  # (index of the next token, draft confidence)
NO_DRAFT = Draft()  # a round that drafts nothing (never changed: every such round shares it)
# A drafter's round: it yields whenever it has staged tokens in its draft context for the
# driver to decode (Context.flush), and returns its draft.
DraftSteps = Generator[None, None, Draft]


@dataclass(frozen=True)
class DraftRequest:
    """What a round asks of a drafter: up to k tokens deep after `tokens` (the text so far),
    drawn with `rng` where it samples; a chain, or the tree `shape` allows; asking
    `keep_drafting` before each token where it knows its confidence; from `source` (one
    of its `sources`; None: the first)."""

    tokens: list[int]
    k: int
    rng: np.random.Generator
    keep_drafting: KeepDrafting | None = None
    shape: TreeShape | None = None
    source: str | None = None


class Drafter(Protocol):
    name: str
    ctx: Context | None  # the draft model's context, if it has one

    def begin(
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
    ) -> None:
        """A new generation from `prompt` (its text), sampling with `sampling` (None: as
        before); `noise`: its coupled sampling's (see sampling.Noise), None if not
        coupled; `media`: where the prompt's media lie, for a drafter that sees them
        (None: the prompt is all text)."""
        ...

    def sources(self, tokens: list[int]) -> list[str]:
        """Who may draft after `tokens` (drafters' names), the likeliest to guess right
        first: the decode loop takes the first whose own length policy drafts, as
        their guesses and their costs differ."""
        ...

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """The round's draft (see DraftRequest)."""
        ...


def propose(
    drafter: Drafter, tokens: list[int], k: int, rng: np.random.Generator, **options: Any
) -> Draft:
    """One drafter's round on its own (`options`: drafting's): each of its draft decode
    calls is its alone."""
    steps = drafter.drafting(DraftRequest(tokens, k, rng, **options))
    return draft_together([steps], [drafter.ctx])[0]


def draft_together(
    rounds: Sequence[DraftSteps | None], contexts: Iterable[Context | None]
) -> list[Draft]:
    """Several slots' rounds in lockstep (None: a slot that drafts nothing): each stages
    its next draft tokens, then one decode call takes them all (the slots' draft
    contexts are slots of one: `contexts` are flushed, and a flush with nothing staged
    costs nothing), until every round has its draft. The draft model then runs once a
    depth for the whole batch, not once a depth for each slot."""
    drafts = [NO_DRAFT] * len(rounds)
    running = [(i, steps) for i, steps in enumerate(rounds) if steps is not None]
    flushes = [ctx for ctx in contexts if ctx is not None]
    while running:
        staged = []
        for i, steps in running:
            try:
                next(steps)
            except StopIteration as done:
                drafts[i] = done.value
            else:
                staged.append((i, steps))
        if staged:
            for ctx in flushes:
                ctx.flush()
        running = staged
    return drafts
