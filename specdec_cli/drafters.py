"""Who proposes tokens. The decode loop verifies them; a drafter only guesses.

Every drafter answers `propose(tokens, k, rng)`: given the whole accepted sequence
(prompt and output so far), up to k guesses for what comes next, with the
distribution each guess was drawn from when sampling (the acceptance rule needs q).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specdec_cli.llama import Context
from specdec_cli.sampling import Dist, SamplingParams, distribution


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # q for each token; empty when greedy
    confidences: list[float] = field(default_factory=list)  # the draft's top probability
    calls: int = 0  # draft model decode calls it took
    source: str = ""


KeepDrafting = Callable[[int, float], bool]  # (index of the next token, draft confidence)


class Drafter(Protocol):
    name: str
    ctx: Context | None  # the draft model's context, if it has one

    def begin(self, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        """A new generation from `prompt`, sampling with `sampling` (None: as before)."""
        ...

    def propose(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
    ) -> Draft: ...


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

    def begin(self, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        if sampling is not None:
            self.sampling = sampling
        self.ctx.prefill(prompt[:-1])
        self._n_cached, self._unchecked = len(prompt) - 1, []

    def _sync(self, tokens: list[int]) -> int:
        """Drop the cached draft tokens that were not accepted; return the cache length
        (shorter, after a recurrent model's rewind to its checkpoint)."""
        n = self._n_cached
        for token in self._unchecked:
            if n >= len(tokens) or tokens[n] != token:
                break
            n += 1
        return self.ctx.rewind(n)

    def propose(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
    ) -> Draft:
        n_keep = self._sync(tokens)
        pending = len(tokens) - n_keep
        if pending <= 2:
            # One token at a time (the usual one or two): llama.cpp reuses its compute
            # graph while the batch keeps its shape, and every draft step is one token.
            for pos in range(n_keep, len(tokens)):
                self.ctx.decode(tokens[pos : pos + 1], pos)
        else:  # catching up after a rewind or another drafter's round: one batch
            self.ctx.decode(tokens[n_keep:], n_keep)
        draft = Draft(source=self.name, calls=pending if pending <= 2 else 1)
        if k > 1:
            self.ctx.checkpoint()  # the drafts it evaluates may be rejected
        n_evaluated = 0  # draft tokens this context has seen: all but the last, usually
        for i in range(k):
            if i:
                self.ctx.decode(draft.tokens[-1:], len(tokens) + i - 1)
                draft.calls += 1
                n_evaluated = i
            logits = self.ctx.logits(-1)[: self.n_vocab]
            if self.sampling.greedy:
                token, q = int(np.argmax(logits)), None
                # The top probability costs a pass over the vocabulary: only if asked.
                confidence = self._top_probability(logits, token) if keep_drafting else 1.0
            else:
                q = distribution(logits, self.sampling)
                # q's maximum, not q of the sampled token: whether to stop must not depend
                # on which token is drawn, or the kept drafts would no longer follow q.
                # With every filter off, q spans the vocabulary: only if asked.
                confidence = float(q.probs.max()) if keep_drafting else 1.0
                token = q.sample(rng)
            if keep_drafting and not keep_drafting(i, confidence):
                break
            draft.tokens.append(token)
            if keep_drafting:
                draft.confidences.append(confidence)
            if q is not None:
                draft.dists.append(q)
        self._n_cached, self._unchecked = len(tokens), draft.tokens[:n_evaluated]
        return draft

    def _top_probability(self, logits: np.ndarray, top: int) -> float:
        """softmax(logits)[top], computed in a buffer kept for the purpose, so that no
        vocabulary-sized array is allocated per token."""
        if self._scratch.shape != logits.shape:
            self._scratch = np.empty_like(logits)
        np.subtract(logits, logits[top], out=self._scratch)
        np.exp(self._scratch, out=self._scratch)
        return float(1.0 / self._scratch.sum())


class NgramDrafter:
    """Prompt lookup: if the last n tokens occurred before, guess that what followed
    them then follows them now. Longest n first. A point-mass proposal: q(x) = 1."""

    name = "ngram"
    ctx = None

    def __init__(self, n_min: int = 1, n_max: int = 4, greedy: bool = True) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.greedy = greedy
        # n-gram -> end index of its latest occurrence
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _last_end

    def begin(self, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        if sampling is not None:
            self.greedy = sampling.greedy
        self._last_end = {}
        self._indexed = 0

    def _index(self, tokens: list[int], upto: int) -> None:
        for end in range(self._indexed, upto):
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def propose(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
    ) -> Draft:
        """`keep_drafting` is not consulted: a lookup has no confidence to offer."""
        # Index every n-gram that ends before the last token, then look the suffix up.
        self._index(tokens, len(tokens) - 1)
        draft = Draft(source=self.name)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self._last_end.get(tuple(tokens[-n:]))
            if end is not None:
                draft.tokens = tokens[end + 1 : end + 1 + k]
                break
        if not self.greedy:
            draft.dists = [Dist.point(t) for t in draft.tokens]
        return draft


class LookupThenModel:
    """N-gram lookup where the text so far offers a match and its guesses have lately
    been accepted more often than the draft model's; the draft model elsewhere.
    Copied stretches then cost no drafting at all, and text the lookup guesses badly
    (a story that only half repeats itself) is left to the model.

    Every round's lookup guess is scored against what the target then produced,
    whether it was used or not, so its rate stays current while the model drafts.
    """

    name = "model+ngram"
    DECAY = 0.9  # per scored token

    def __init__(self, lookup: NgramDrafter, model: ModelDrafter) -> None:
        self.lookup, self.model = lookup, model
        self.ctx = model.ctx
        self.hit_rate = {lookup.name: 1.0, model.name: 1.0}  # the model, until the lookup wins
        self._guesses: list[tuple[str, int, list[int]]] = []  # (source, start, tokens)

    def begin(self, prompt: list[int], sampling: SamplingParams | None = None) -> None:
        self.lookup.begin(prompt, sampling)
        self.model.begin(prompt, sampling)
        self._guesses = []

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

    def propose(
        self,
        tokens: list[int],
        k: int,
        rng: np.random.Generator,
        keep_drafting: KeepDrafting | None = None,
    ) -> Draft:
        self._score(tokens)
        guess = self.lookup.propose(tokens, k, rng)
        if guess.tokens:
            self._guesses.append((self.lookup.name, len(tokens), guess.tokens))
            if self.hit_rate[self.lookup.name] > self.hit_rate[self.model.name]:
                return guess
        draft = self.model.propose(tokens, k, rng, keep_drafting)
        self._guesses.append((self.model.name, len(tokens), draft.tokens))
        return draft
