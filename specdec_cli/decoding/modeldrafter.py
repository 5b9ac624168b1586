"""A draft model: a small model with the target's vocabulary (or, through translate.py,
another), drafting a chain a token a call, or a tree (treegrowth.py)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.decoding.draft import Draft, DraftRequest, DraftSteps, KeepDrafting, TreeShape
from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.sampling import Dist, Noise, SamplingParams, distribution
from specdec_cli.decoding.treegrowth import TreeGrowth
from specdec_cli.llamacpp.llama import Context
from specdec_cli.llamacpp.rowexp import exp_sum, scratch_row

if TYPE_CHECKING:
    from specdec_cli.decoding.grammar import Constraint

# A tree node's probability: the tokens within NEAR_TOP of the top logit exactly, the
# rest from every TAIL_STRIDE-th (see ModelDrafter._likeliest).
NEAR_TOP = 4.0
TAIL_STRIDE = 16
# A node's children: tokens, probabilities and q's (see ModelDrafter.children).
Children = tuple[list[int], list[float], list[Dist | None]]


class ModelDrafter:
    """A small model with the target's vocabulary, run autoregressively for k steps.

    Its KV cache always holds a prefix of the accepted sequence, plus the draft tokens
    it evaluated last round. On each call it keeps the part of that which was accepted,
    and feeds what it has not seen: the target's own token, and after a round where
    every draft was accepted also its own last draft (it never evaluated that one).

    Beside media it reads the text alone, at positions of its own, unless it `sees_media`
    (a projector of its own, multimodal.MediaChunk.draft): it then holds what the target
    holds, the media as its own projector made them.
    """

    name = "model"
    sees_media = False

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
        # Tokens never drawn when sampling: those of a draft vocabulary whose text the
        # target's lacks (see translate.py). q is then renormalised over the rest.
        self.banned: np.ndarray | None = None
        self.noise: Noise | None = None
        # The round's grammar (set by the decode loop, see grammar.py): each node's
        # children are chosen from its row masked after its path (see children).
        self.constraint: Constraint | None = None
        self.media: PromptMedia | None = None  # where the generation's media lie
        self._reads_media = False  # whether its context holds them (see sees_media)

    def begin(
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
    ) -> None:
        if sampling is not None:
            self.sampling = sampling
        self.noise = noise
        self.media = media
        own = media.draft_media() if media is not None and self.sees_media else None
        self._reads_media = own is not None
        read = media.cells if media is not None and own is not None else prompt
        self.ctx.prefill(read[:-1], own)
        self._n_cached, self._unchecked = len(read) - 1, []

    def _sequence(self, text: list[int]) -> list[int]:
        """What its context reads of the text so far: the text, or with the media it
        sees, what the target holds."""
        if self.media is None or not self._reads_media:
            return text
        return self.media.cells_of(text)

    def _cells(self, text: list[int]) -> int:
        """How many cells the target holds after the text so far: the place of the
        next token, where coupled sampling's noise is read (the verifier reads it there)."""
        return len(text) + (self.media.extra_cells if self.media is not None else 0)

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

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """Up to k tokens deep; a chain, or the tree `shape` allows."""
        tokens, k = self._sequence(request.tokens), request.k
        calls = yield from self._catch_up(tokens)
        if k > 1:
            self.ctx.checkpoint()  # the drafts it evaluates may be rejected
        draft = yield from self._grow(
            self._cells(request.tokens),
            k,
            request.rng,
            request.keep_drafting,
            request.shape,
            len(tokens),
        )
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
        """Up to k tokens deep after `base` cells of the target's (where coupled sampling's
        noise is read), from the logits of the context's last call (see TreeGrowth for
        `start`)."""
        growth = TreeGrowth(self, base, shape or TreeShape(k), rng, keep_drafting, start)
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
        reads its state (see heads.HeadDrafter); a draft model reads the tokens alone."""
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

    def take_next(
        self,
        draft: Draft,
        logits: np.ndarray,
        rng: np.random.Generator,
        position: int,
        keep_drafting: KeepDrafting | None,
    ) -> bool:
        """Choose a chain's next token, at `position`, from the logits after the draft so
        far and add it to the draft, unless the length policy stops here (False)."""
        need_confidence = keep_drafting is not None
        ids, probs, dists = self.children(logits, rng, 1, need_confidence, position, draft.tokens)
        if keep_drafting and not keep_drafting(len(draft.tokens), probs[0]):
            return False
        draft.tokens.append(ids[0])
        if dists[0] is not None:
            draft.dists.append(dists[0])
        if need_confidence:
            draft.confidences.append(probs[0])
        return True

    def children(
        self,
        logits: np.ndarray,
        rng: np.random.Generator,
        n: int,
        need_confidence: bool,
        position: int = 0,
        path: Sequence[int] = (),
    ) -> Children:
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
        if self.sampling.greedy:
            return self._greedy_children(logits, n, need_confidence)
        if self.noise is not None:
            return self._coupled_children(logits, self.noise, n, position)
        return self._sampled_children(logits, rng, n, need_confidence)

    def _greedy_children(self, logits: np.ndarray, n: int, need_confidence: bool) -> Children:
        token = int(logits.argmax())
        if n == 1:
            confidence = self._top_probability(logits, token) if need_confidence else 1.0
            return [token], [confidence], [None]
        return *self._likeliest(logits, token, n), [None] * n

    def _coupled_children(
        self, logits: np.ndarray, noise: Noise, n: int, position: int
    ) -> Children:
        """Verified by a match, so a guess may be kept or ranked by its own probability."""
        q = distribution(logits, self.sampling)
        ids = noise.ranked(q, position, n)
        return ids, [q.prob(t) for t in ids], [None] * len(ids)

    def _sampled_children(
        self, logits: np.ndarray, rng: np.random.Generator, n: int, need_confidence: bool
    ) -> Children:
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
                ids.append(int(logits.argmax()))
        finally:
            for token, value in masked:
                logits[token] = value
        head = logits[logits >= best - NEAR_TOP]
        tail = logits[::TAIL_STRIDE]
        tail = tail[tail < best - NEAR_TOP]
        total = float(np.exp(head - best).sum()) + TAIL_STRIDE * float(np.exp(tail - best).sum())
        return ids, [float(np.exp(logits[t] - best)) / total for t in ids]

    def _top_probability(self, logits: np.ndarray, top: int) -> float:
        """softmax(logits)[top], its exps in the kept scratch row: no vocabulary-sized
        array is allocated per token."""
        return 1.0 / exp_sum(logits, float(logits[top]), out=scratch_row(len(logits)))
