"""Who proposes tokens. The decode loop verifies them; a drafter only guesses.

Every drafter answers `drafting(tokens, k, rng)`: given the whole accepted sequence
(prompt and output so far), up to k guesses for what comes next, with the
distribution each guess was drawn from when sampling (the acceptance rule needs q).
With a `shape` wider than a chain, the guesses form a tree: alternatives for the
same position, all verified in one target pass.

A draft model's round is a generator that stops at each of its decode calls: it
stages its tokens and yields, and whoever drives it decodes them. Run alone
(`propose`), each call is its own; run beside other slots' rounds (`draft_together`),
one call decodes every slot's next draft tokens, as one target call verifies them all.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from specdec_cli.decoding.sampling import (
    Dist,
    Noise,
    SamplingParams,
    chain_parents,
    distribution,
)
from specdec_cli.llamacpp.llama import Context
from specdec_cli.llamacpp.rowexp import exp_sum

if TYPE_CHECKING:
    from specdec_cli.decoding.grammar import Constraint


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
# A tree node's probability: the tokens within NEAR_TOP of the top logit exactly, the
# rest from every TAIL_STRIDE-th (see ModelDrafter._likeliest).
NEAR_TOP = 4.0
TAIL_STRIDE = 16


class Drafter(Protocol):
    name: str
    ctx: Context | None  # the draft model's context, if it has one

    def begin(
        self, prompt: list[int], sampling: SamplingParams | None = None, noise: Noise | None = None
    ) -> None:
        """A new generation from `prompt`, sampling with `sampling` (None: as before);
        `noise`: its coupled sampling's (see sampling.Noise), None if not coupled."""
        ...

    def sources(self, tokens: list[int]) -> list[str]:
        """Who may draft after `tokens` (drafters' names), the likeliest to guess right
        first: the decode loop takes the first whose own length policy drafts, as
        their guesses and their costs differ."""
        ...

    def drafting(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> DraftSteps:
        """Up to k tokens deep, from `source` (one of `sources`; None: the first)."""
        ...


def propose(
    drafter: Drafter, tokens: list[int], k: int, rng: np.random.Generator, **options: Any
) -> Draft:
    """One drafter's round on its own (`options`: drafting's): each of its draft decode
    calls is its alone."""
    steps = drafter.drafting(tokens, k, rng, **options)
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


class ModelDrafter:
    """A small model with the target's vocabulary, run autoregressively for k steps.

    Its KV cache always holds a prefix of the accepted sequence, plus the draft tokens
    it evaluated last round. On each call it keeps the part of that which was accepted,
    and feeds what it has not seen: the target's own token, and after a round where
    every draft was accepted also its own last draft (it never evaluated that one).
    """

    name = "model"

    def __init__(self, ctx: Context, sampling: SamplingParams, n_vocab: int | None = None) -> None:
        """`n_vocab`: the target's vocabulary size. A draft's vocabulary may be larger (as
        llama.cpp allows), and a token the target does not have must never be proposed."""
        self.ctx = ctx
        self.sampling = sampling
        self.n_vocab = n_vocab
        # The KV cache holds the first `_n_cached` accepted tokens, then `_unchecked`:
        # last round's draft tokens, which the target may or may not have accepted.
        self._n_cached = 0
        self._unchecked: list[int] = []
        self._scratch = np.empty(0, np.float32)
        # Tokens never drawn when sampling: those of a draft vocabulary whose text the
        # target's lacks (see translate.py). q is then renormalised over the rest.
        self.banned: np.ndarray | None = None
        self.noise: Noise | None = None
        # The round's grammar (set by the decode loop, see grammar.py): each node's
        # children are chosen from its row masked after its path (see children).
        self.constraint: Constraint | None = None

    def begin(
        self, prompt: list[int], sampling: SamplingParams | None = None, noise: Noise | None = None
    ) -> None:
        if sampling is not None:
            self.sampling = sampling
        self.noise = noise
        self.ctx.prefill(prompt[:-1])
        self._n_cached, self._unchecked = len(prompt) - 1, []

    def sources(self, tokens: list[int]) -> list[str]:
        return [self.name]

    def _sync(self, tokens: list[int]) -> int:
        """Drop the cached draft tokens that were not accepted; return the cache length
        (shorter, after a recurrent model's rewind to its checkpoint). The last token is
        always evaluated again if it was cached: its logits row must be this round's (a
        translated text can stop growing mid-character, and a slot's rows of an earlier
        call are another slot's by now)."""
        n = self._n_cached
        for token in self._unchecked:
            if n >= len(tokens) or tokens[n] != token:
                break
            n += 1
        return self.ctx.rewind(min(n, len(tokens) - 1))

    def drafting(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> DraftSteps:
        """Up to k tokens deep; a chain, or the tree `shape` allows."""
        calls = yield from self._catch_up(tokens)
        if k > 1:
            self.ctx.checkpoint()  # the drafts it evaluates may be rejected
        draft = yield from self._grow(len(tokens), k, rng, keep_drafting, shape)
        draft.calls += calls
        # The draft tokens evaluated in sequence 0 (all of the chain but its last
        # token, usually) stay cached: next round keeps those the target accepted.
        self._n_cached, self._unchecked = len(tokens), self.ctx.tokens[len(tokens) :]
        self.ctx.drop_branches()
        return draft

    def _grow(
        self,
        base: int,
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None,
        shape: TreeShape | None,
        start: int | None = None,
    ) -> DraftSteps:
        """Up to k tokens deep after a text of `base` tokens, from the logits of the
        context's last call (see _Growth for `start`)."""
        growth = _Growth(self, base, shape or TreeShape(k), rng, keep_drafting, start)
        return (yield from growth.grow(k))

    def stage_nodes(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        parent_rows: Sequence[int],
    ) -> None:
        """Stage one depth of a draft tree (see Context.stage_branches). `parent_rows`:
        the rows of the last call whose logits gave each token, where a drafting head
        reads its state (see HeadDrafter); a draft model reads the tokens alone."""
        self.ctx.stage_branches(tokens, positions, seqs)

    def _catch_up(self, tokens: list[int]) -> Generator[None, None, int]:
        """Stage what the cache lacks of `tokens`, a call at a time: returns the calls."""
        n_keep = self._sync(tokens)
        pending = tokens[n_keep:]
        if len(pending) <= 2:
            # One token at a time (the usual one or two): llama.cpp reuses its compute
            # graph while the batch keeps its shape, and every draft step is one token.
            for token in pending:
                self.ctx.stage([token])
                yield
            return len(pending)
        # Catching up after a rewind or another drafter's round: in as few calls as a
        # slot's share of a batch allows, logits for the last token only.
        n_batch = self.ctx.n_batch
        for start in range(0, len(pending), n_batch):
            self.ctx.stage(pending[start : start + n_batch], int(start + n_batch >= len(pending)))
            yield
        return -(-len(pending) // n_batch)

    def children(
        self,
        logits: np.ndarray,
        rng: np.random.Generator,
        n: int,
        need_confidence: bool,
        position: int = 0,
        path: Sequence[int] = (),
    ) -> tuple[list[int], list[float], list[Dist | None]]:
        """A node's children from the draft's logits after it, up to n: the token a
        chain would draft first, then alternatives. Each comes with the draft's
        probability that it is right (the first's 1.0 when nobody asked) and what it was
        drawn from (None when greedy or coupled). `position`: the children's place in
        the text, where coupled sampling's noise is read.

        Greedy: the likeliest tokens in order. Coupled: the race's first n at that
        position, with the target's noise. Sampling: draws from q without
        replacement (each from q with the earlier ones taken out), each probability the
        top of the distribution it is drawn from, never of the token drawn: whether a
        drawn token is kept must not depend on which token it is, or the kept drafts
        would no longer follow their q.

        Under a grammar (`constraint`) the row is masked first, as the target's is: the
        mask after `path`, the draft's tokens from its root to this node. Past an end of
        generation on the path anything goes, as in the verifier's masks.
        """
        constraint = self.constraint
        if constraint is not None and constraint.follow(path):
            logits = constraint.mask(logits, constraint.allowed())
        return self._children(logits, rng, n, need_confidence, position)

    def _children(
        self,
        logits: np.ndarray,
        rng: np.random.Generator,
        n: int,
        need_confidence: bool,
        position: int = 0,
    ) -> tuple[list[int], list[float], list[Dist | None]]:
        if self.sampling.greedy:
            token = int(np.argmax(logits))
            if n == 1:
                confidence = self._top_probability(logits, token) if need_confidence else 1.0
                return [token], [confidence], [None]
            return *self._likeliest(logits, token, n), [None] * n
        if self.noise is not None:
            # Verified by a match, so a guess may be kept or ranked by its own probability.
            q = distribution(logits, self.sampling)
            ids = self.noise.ranked(q, position, n)
            return ids, [q.prob(t) for t in ids], [None] * len(ids)
        ids, probs, dists = [], [], []
        if self.banned is not None:
            logits[self.banned] = -np.inf  # the draft's own row, read once
        q: Dist | None = distribution(logits, self.sampling)
        while q is not None and len(ids) < n:
            ids.append(q.sample(rng))
            # With every filter off, q spans the vocabulary: its top only if asked.
            probs.append(float(q.probs.max()) if need_confidence or n > 1 else 1.0)
            dists.append(q)
            q = q.without(ids[-1]) if len(ids) < n else None
        return ids, probs, dists

    def _likeliest(self, logits: np.ndarray, top: int, n: int) -> tuple[list[int], list[float]]:
        """The n likeliest tokens (`top` the first) and the draft's probability of each.

        These shape a tree; they decide nothing about the text. So the normaliser is
        estimated: exact over the tokens within NEAR_TOP of the top logit, and from
        every TAIL_STRIDE-th token below that, which spares an exp over the whole
        vocabulary (152k-262k tokens) for every node a tree extends."""
        best = float(logits[top])
        ids = [top]
        # n - 1 more argmax passes, each with the tokens found so far masked in place
        # (and put back): cheaper than any sort, and than a copy of the row.
        masked: list[tuple[int, float]] = []
        try:
            for _ in range(n - 1):
                masked.append((ids[-1], float(logits[ids[-1]])))
                logits[ids[-1]] = -np.inf
                ids.append(int(np.argmax(logits)))
        finally:
            for token, value in masked:
                logits[token] = value
        head = logits[logits >= best - NEAR_TOP]
        tail = logits[::TAIL_STRIDE]
        tail = tail[tail < best - NEAR_TOP]
        total = float(np.exp(head - best).sum()) + TAIL_STRIDE * float(np.exp(tail - best).sum())
        return ids, [float(np.exp(logits[t] - best)) / total for t in ids]

    def _top_probability(self, logits: np.ndarray, top: int) -> float:
        """softmax(logits)[top], computed in a buffer kept for the purpose, so that no
        vocabulary-sized array is allocated per token."""
        if self._scratch.shape != logits.shape:
            self._scratch = np.empty_like(logits)
        return 1.0 / exp_sum(logits, float(logits[top]), out=self._scratch)


class _Growth:
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

    def _add_children(self, node: int, logits: np.ndarray, depth: int) -> list[int]:
        shape, draft = self.shape, self.draft
        on_primary = node < 0 or self.primary[node]
        parent_score = self.scores[node] if node >= 0 else 1.0
        # A tree's ranks need every node's probability.
        need_confidence = self.keep_drafting is not None or not shape.is_chain
        # Under a grammar, the children's mask is the one after the node's path.
        path = self.draft.path(node) if self.drafter.constraint else ()
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
            if need_confidence:
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


# A lookup's match: a text, and where the n-gram that ends the current text ended in it
# (its latest occurrences, the latest last). The text is the current one, or an earlier
# generation's (see TextMemory).
Match = tuple[list[int], list[int]]


def remember_end(index: dict[tuple[int, ...], list[Any]], key: tuple[int, ...], end: Any) -> None:
    """Add where n-gram `key` ended to `index`, which keeps each n-gram's latest
    NgramDrafter.OCCURRENCES ends, the latest last."""
    ends = index.setdefault(key, [])
    ends.append(end)
    if len(ends) > NgramDrafter.OCCURRENCES:
        del ends[0]


def ngrams_ending(
    tokens: Sequence[int], start: int, stop: int, n_min: int, n_max: int
) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every n-gram (n_min <= n <= n_max) that ends at an index in [start, stop), and
    that index."""
    for end in range(start, stop):
        for n in range(n_min, min(n_max, end + 1) + 1):
            yield tuple(tokens[end - n + 1 : end + 1]), end


class TextMemory:
    """The texts (prompt and output) of a server's recent generations, for every slot's
    n-gram lookup: a request that goes over text an earlier one holds (a prompt sent
    again, the history a chat resends, an agent's repeated context) finds what followed
    it there, as llama.cpp's server-wide ngram-mod map does. At most `max_tokens` in all,
    the oldest text out first. Only generations whose text is the same whatever the drafts
    (greedy, coupled) look here: a rejection-sampled one's drafts decide where its random
    numbers go, and its seed must give the same text whatever ran before it."""

    def __init__(self, max_tokens: int, n_min: int, n_max: int) -> None:
        self.max_tokens, self.n_min, self.n_max = max_tokens, n_min, n_max
        self._texts: dict[int, list[int]] = {}  # by id, the oldest first
        # n-gram -> (text id, end index) of its latest occurrences, the latest last
        self._ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._next_id = 0
        self._tokens = 0

    def add(self, text: Sequence[int]) -> None:
        text = list(text[-self.max_tokens :])
        text_id, self._next_id = self._next_id, self._next_id + 1
        self._texts[text_id] = text
        self._tokens += len(text)
        # n-grams ending at the last token have nothing after them to offer
        for key, end in ngrams_ending(text, 0, len(text) - 1, self.n_min, self.n_max):
            remember_end(self._ends, key, (text_id, end))
        while self._tokens > self.max_tokens:
            self._forget(next(iter(self._texts)))

    def _forget(self, text_id: int) -> None:
        text = self._texts.pop(text_id)
        self._tokens -= len(text)
        for key, _ in ngrams_ending(text, 0, len(text) - 1, self.n_min, self.n_max):
            kept = [place for place in self._ends.get(key, []) if place[0] != text_id]
            if kept:
                self._ends[key] = kept
            else:
                self._ends.pop(key, None)

    def find(self, key: tuple[int, ...]) -> Match | None:
        """The latest text that holds the n-gram `key`, and where it ended there."""
        places = self._ends.get(key)
        if not places:
            return None
        text_id = places[-1][0]
        return self._texts[text_id], [end for i, end in places if i == text_id]


class NgramDrafter:
    """Prompt lookup: if the last n tokens occurred before, guess that what followed
    them then follows them now. Longest n first. A point-mass proposal: q(x) = 1.
    With a tree shape, the continuations of its latest `shape.branch` occurrences are
    the branches (those that begin alike share their start), the latest first."""

    name = "ngram"
    ctx = None
    OCCURRENCES = 8  # the most occurrences of an n-gram remembered (the latest)
    # Its rounds where the text repeats itself verbatim (a loop, a copied block): the
    # last VERBATIM tokens occurred before, in full. They are a source of their own,
    # with a length policy of their own (see `sources`).
    VERBATIM = 24
    VERBATIM_SOURCE = "verbatim"

    def __init__(
        self,
        n_min: int = 1,
        n_max: int = 4,
        invariant: bool = True,
        memory: TextMemory | None = None,
    ) -> None:
        """`invariant`: the text is the same whatever the drafts (SamplingParams.
        draft_invariant). `memory`: earlier generations' texts, looked up where the
        current text has no match as long (invariant texts only; see TextMemory)."""
        self.n_min, self.n_max = n_min, n_max
        self.invariant = invariant
        self.memory = memory
        # n-gram -> end indices of its latest occurrences, the latest last
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this index are in _ends
        self._text: list[int] = []  # the current generation's text, as last seen
        self._matched: tuple[int, Match] = (-1, ([], []))  # (text length, its match)

    def begin(
        self, prompt: list[int], sampling: SamplingParams | None = None, noise: Noise | None = None
    ) -> None:
        if self.memory is not None and self._text:
            self.memory.add(self._text)  # the last generation's text, now complete
        if sampling is not None:
            self.invariant = sampling.draft_invariant
        self._ends = {}
        self._indexed = 0
        self._text = []
        self._matched = (-1, ([], []))

    def _index(self, tokens: list[int], upto: int) -> None:
        for key, end in ngrams_ending(tokens, self._indexed, upto, self.n_min, self.n_max):
            remember_end(self._ends, key, end)
        self._indexed = max(self._indexed, upto)

    def sources(self, tokens: list[int]) -> list[str]:
        if self.verbatim(tokens, self.matches(tokens)):
            return [self.VERBATIM_SOURCE, self.name]
        return [self.name]

    def verbatim(self, tokens: list[int], match: Match) -> bool:
        """Whether the latest match (see matches) is the last VERBATIM tokens repeated:
        then the text is going round a loop or copying a block, and what followed is
        far likelier to follow again than after a short match, for far longer."""
        text, ends = match
        if not ends or ends[-1] + 1 < self.VERBATIM:
            return False
        end = ends[-1]
        return text[end + 1 - self.VERBATIM : end + 1] == tokens[-self.VERBATIM :]

    def matches(self, tokens: list[int]) -> Match:
        """Where the longest n-gram that ends `tokens` ended before: in `tokens` itself,
        or (an invariant text, with a memory) in an earlier generation's text; no ends when it
        never did. At equal length the current text's own match wins. Looked up once a
        round (the text only grows): who drafts and the draft both ask."""
        if self._matched[0] != len(tokens):
            self._text = tokens
            self._matched = (len(tokens), self._look_up(tokens))
        return self._matched[1]

    def _look_up(self, tokens: list[int]) -> Match:
        # Index every n-gram that ends before the last token, then look the suffix up.
        self._index(tokens, len(tokens) - 1)
        memory = self.memory if self.invariant else None
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            key = tuple(tokens[-n:])
            ends = self._ends.get(key)
            if ends:
                return tokens, ends
            found = memory.find(key) if memory is not None else None
            if found is not None:
                return found
        return tokens, []

    def drafting(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> DraftSteps:
        """`keep_drafting` is not consulted: a lookup has no confidence to offer. Nor
        does it decode anything: it returns at once."""
        yield from ()
        return self.continuation(self.matches(tokens), k, shape, source)

    @staticmethod
    def followed(match: Match, n: int, loop: bool = False) -> list[int]:
        """The n tokens that followed the latest of the match's ends: its guess.
        `loop`: past the end of the text, the tokens since that occurrence again, as if
        the text went round the same loop (what llama.cpp's ngram-mod, looking up each
        drafted token's n-gram in turn, finds in a verbatim repeat)."""
        text, ends = match
        start = ends[-1] + 1
        guess = text[start : start + n]
        while loop and 0 < len(guess) < n:
            guess += guess[: n - len(guess)]
        return guess

    def continuation(
        self,
        match: Match,
        k: int,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> Draft:
        """What followed the earlier ends of the n-gram that ends the text (see
        matches): up to k tokens deep, a chain or the tree `shape` allows. For the
        verbatim source, a chain that goes round the loop (see followed)."""
        draft = Draft(source=self.name)
        text, ends = match
        if ends and source == self.VERBATIM_SOURCE:
            draft.tokens = self.followed(match, k, loop=True)
        elif ends and (shape is None or shape.is_chain):
            draft.tokens = self.followed(match, k)
        elif ends:
            continuations = [text[end + 1 : end + 1 + k] for end in ends[::-1]]
            merge_into_tree(draft, continuations[: shape.branch], shape.nodes)
        if not self.invariant:  # what rejection sampling needs
            draft.dists = [Dist.point(t) for t in draft.tokens]
        return draft


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


class LookupThenModel:
    """N-gram lookup where the text so far offers a match and its guesses have lately
    been accepted more often than the draft model's; the draft model elsewhere.
    Copied stretches then cost no drafting at all, and text the lookup guesses badly
    (a story that only half repeats itself) is left to the model. Where the lookup
    matches, the other is the second choice: a lookup's guess costs nothing to draft,
    so its drafting can pay where the model's does not, and the model's can pay where
    the lookup's guesses are too often wrong.

    Every round's lookup guess is scored against what the target then produced,
    whether it was used or not, so its rate stays current while the model drafts
    and while no one does.
    """

    name = "model+ngram"
    DECAY = 0.9  # per scored token
    # The lookup's guess that is scored each round: longer than any round's new tokens,
    # so that only the text decides how much of it is tested.
    GUESS_LENGTH = 64

    def __init__(self, lookup: NgramDrafter, model: Drafter) -> None:
        self.lookup, self.model = lookup, model
        self.name = f"{model.name}+ngram"  # "model+ngram", or beside a head "mtp+ngram"
        self.ctx = model.ctx
        self.hit_rate: dict[str, float] = {}
        self._guesses: list[tuple[str, int, list[int]]] = []  # (source, start, tokens)
        # This round's decision: (tokens, who may draft after them, the lookup's match).
        self._decided: tuple[int, list[str], Match] | None = None

    def begin(
        self, prompt: list[int], sampling: SamplingParams | None = None, noise: Noise | None = None
    ) -> None:
        """Each text anew: how much one repeats itself says nothing of the next. The
        lookup starts at even odds, so that its guesses, scored while the model drafts,
        must earn it the turn (from 1.0 it drafted after the model's first miss)."""
        self.lookup.begin(prompt, sampling, noise)
        self.model.begin(prompt, sampling, noise)
        self.hit_rate = {self.lookup.name: 0.5, self.model.name: 1.0}
        self._guesses, self._decided = [], None

    def sources(self, tokens: list[int]) -> list[str]:
        return self._decide(tokens)[0]

    def _decide(self, tokens: list[int]) -> tuple[list[str], Match]:
        """Who may draft (the lookup only where it matches; first if it has lately been
        the better guesser) and the lookup's matches; decided once a round (the text
        only grows), after scoring last round's guesses.

        The lookup's guess is taken here, every round it matches, and not only when
        someone drafts: where the model's length policy finds that drafting does not
        pay, no one may draft, and a lookup scored only in drafted rounds never earned
        its turn (on copied text, which it would have drafted for free)."""
        if self._decided is None or self._decided[0] != len(tokens):
            self._score(tokens)
            match = self.lookup.matches(tokens)
            order = [self.model.name]
            if match[1]:
                # Only its tokens: a Draft would carry a point proposal for each of them.
                guess = self.lookup.followed(match, self.GUESS_LENGTH)
                self._guesses.append((self.lookup.name, len(tokens), guess))
                better = self.hit_rate[self.lookup.name] > self.hit_rate[self.model.name]
                order.insert(0 if better else 1, self.lookup.name)
                if self.lookup.verbatim(tokens, match):
                    order.insert(0, self.lookup.VERBATIM_SOURCE)
            self._decided = (len(tokens), order, match)
        return self._decided[1], self._decided[2]

    def _score(self, tokens: list[int]) -> None:
        """Last round's guesses against what followed: tokens up to the first miss were
        tested (as the target would have), the rest were not."""
        for source, start, guess in self._guesses:
            truth = tokens[start : start + len(guess)]
            hits = 0
            while hits < len(truth) and guess[hits] == truth[hits]:
                hits += 1
            tested = min(len(truth), hits + 1)
            for i in range(tested):
                self.hit_rate[source] += (1.0 - self.DECAY) * ((i < hits) - self.hit_rate[source])
        self._guesses = []

    def drafting(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
        shape: TreeShape | None = None,
        source: str | None = None,
    ) -> DraftSteps:
        order, match = self._decide(tokens)
        source = source or order[0]
        if source in (self.lookup.name, self.lookup.VERBATIM_SOURCE):
            return self.lookup.continuation(match, k, shape, source)
        draft = yield from self.model.drafting(tokens, k, rng, keep_drafting, shape)
        self._guesses.append((self.model.name, len(tokens), draft.primary_path()))
        return draft
