"""The decode loop: draft, verify in one target pass, keep what the target agrees with.

Without a drafter the same loop is plain target-only decoding (every round drafts
nothing and the target picks one token), which is the baseline for every comparison.
A draft is a chain, or with a tree policy a tree: the same loop verifies both (a
chain is the tree with one branch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from specdec_cli.drafters import Draft, Drafter
from specdec_cli.draftlength import DraftLength, FixedLength
from specdec_cli.errors import UserError
from specdec_cli.llama import Context
from specdec_cli.sampling import (
    SamplingParams,
    distribution,
    verify_tree_greedy,
    verify_tree_sampled,
)
from specdec_cli.stats import Stats
from specdec_cli.treeshape import TreePolicy

NO_DRAFT = Draft()


@dataclass(frozen=True)
class Round:
    """One round's new tokens: the first `n_drafted` were the drafter's, accepted by the
    target; the rest (at most one) is the target's own."""

    tokens: list[int]
    n_drafted: int
    source: str = ""


class Decoder:
    def __init__(
        self,
        target: Context,
        drafter: Drafter | None,
        sampling: SamplingParams,
        length: DraftLength | None = None,
        label: str = "0",
        tree: TreePolicy | None = None,
        tree_label: str = "off",
        lengths: Mapping[str, DraftLength] | None = None,
    ) -> None:
        """`length` sets how much each round drafts; `lengths`, by drafter name, for a
        drafter whose guesses follow their own pattern (a lookup beside a model)."""
        self.target = target
        self.drafter = drafter
        self.sampling = sampling
        self.length = length or FixedLength(0)
        self.lengths = dict(lengths or {})
        self.label = label  # how the user named the draft length: "4", "auto"
        self.tree = tree  # None: chains
        self.tree_label = tree_label  # how the user named it: "off", "auto", "16"

    def generate(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        sampling: SamplingParams | None = None,
    ) -> Iterator[Round]:
        """Yield each round's new tokens until EOS, `n_predict` tokens or a full context
        (a negative `n_predict` sets no limit: until EOS or a full context, as llama.cpp's -n -1).
        `sampling`: this generation's settings (None: the decoder's own), for the target
        and the drafter alike, so that one decoder serves requests that sample differently.

        `stats` is updated as it goes, so a caller that stops early (a stop string,
        Ctrl-C) still holds correct figures. The end-of-generation token is not yielded.
        """
        target, drafter = self.target, self.drafter
        if not prompt:
            raise UserError("the prompt is empty; give some text with -p, -f or stdin")
        if len(prompt) >= target.n_ctx:
            raise UserError(
                f"the prompt is {len(prompt)} tokens but the context holds {target.n_ctx}; "
                "shorten the prompt or raise -c"
            )
        if n_predict < 0:
            n_predict = target.n_ctx  # the context fills up first
        draft_ctx = drafter.ctx if drafter else None
        stats.k, stats.tree = self.label, self.tree_label
        t_start = time.perf_counter()
        # The last prompt token goes into the first verification batch.
        stats.prompt_reused = target.prefill(prompt[:-1])
        sampling = sampling or self.sampling
        if drafter:
            drafter.begin(prompt, sampling)
        for policy in (self.length, *self.lengths.values(), self.tree):
            if policy:
                policy.begin()
        stats.prompt_tokens = len(prompt)
        contexts = [target, draft_ctx] if draft_ctx else [target]
        verify_before = target.decode_seconds
        draft_before = _decode_seconds(draft_ctx)
        draft_calls_before = draft_ctx.decode_calls if draft_ctx else 0
        llama_before = sum(c.perf_seconds() for c in contexts)
        t_gen = time.perf_counter()
        stats.prompt_seconds = t_gen - t_start

        tokens = list(prompt)
        n_new = 0
        round_end = t_gen
        try:
            while True:
                # The target has not seen the last token (nor, after a recurrent model's
                # rewind, a few before it): they go first in the verification batch, and
                # the row of the last one predicts the next token.
                unseen = tokens[len(target.tokens) :]
                # A round yields at most k + 1 tokens: stay within -n and the context,
                # and verify in one decode call (the logits of one call are all kept).
                room = min(n_predict - n_new, target.n_ctx - len(tokens))
                limit = min(room - 1, target.n_batch - len(unseen))
                length, source, k = self._who_drafts(tokens, limit)
                shape = self.tree.shape(k, limit) if self.tree and k > 0 else None
                keep_drafting = length.keep_drafting if length.uses_confidence else None
                draft_start = _decode_seconds(draft_ctx)
                draft = NO_DRAFT
                if drafter and k > 0:
                    draft = drafter.propose(tokens, k, rng, keep_drafting, shape, source)
                verify_start = target.decode_seconds

                target.checkpoint(len(draft.tokens))  # rejected drafts must not stay
                # One pass over the unseen tokens and every draft token: row 0 of its
                # logits follows the last unseen token, row j + 1 draft token j.
                batch = [*unseen, *draft.tokens]
                parents = _batch_parents(len(unseen), draft.parents)
                target.decode(batch, len(target.tokens), len(draft.tokens) + 1, parents)
                path, next_token = self._verify(draft, rng, sampling)
                n_accepted = len(path)
                beside = draft.beside_primary(path)  # a chain would have missed these
                # Keep the accepted path, drop the rest (its last token is in batch place
                # len(unseen) - 1 + path[-1] + 1; the last unseen one if nothing was).
                target.keep_branch(len(unseen) + (path[-1] if path else -1))
                # The round's own time runs from the end of the last one: the consumer's
                # work on the last tokens counts too.
                round_start, round_end = round_end, time.perf_counter()
                if sampling.greedy:  # greedy text is the same whatever k: follow the clock
                    draft_seconds = _decode_seconds(draft_ctx) - draft_start
                    verify_seconds: float | None = target.decode_seconds - verify_start
                    other_seconds = round_end - round_start - draft_seconds - verify_seconds
                else:  # k decides which random numbers go where: a seed must reproduce
                    draft_seconds = verify_seconds = other_seconds = None
                length.observe(
                    draft, n_accepted, draft_seconds, verify_seconds, other_seconds, beside=beside
                )
                if self.tree:
                    self.tree.observe(draft, path)

                new = [*(draft.tokens[i] for i in path), next_token]
                eog = next((i for i, t in enumerate(new) if target.model.is_eog(t)), None)
                if eog is not None:
                    new = new[:eog]
                    stats.stop_reason = "eos"
                stats.record_round(
                    draft.source, len(draft.tokens), len(batch), n_accepted, len(new), beside
                )
                tokens += new
                n_new += len(new)
                stats.seconds = time.perf_counter() - t_gen
                yield Round(new, min(n_accepted, len(new)), draft.source)
                if stats.stop_reason:
                    return
                if n_new >= n_predict:
                    stats.stop_reason = "length"
                    return
                if len(tokens) >= target.n_ctx:
                    stats.stop_reason = "context"
                    return
        finally:
            stats.seconds = time.perf_counter() - t_gen
            stats.verify_seconds = target.decode_seconds - verify_before
            stats.llama_seconds = sum(c.perf_seconds() for c in contexts) - llama_before
            stats.draft_seconds = _decode_seconds(draft_ctx) - draft_before
            if draft_ctx:
                stats.draft_calls = draft_ctx.decode_calls - draft_calls_before

    def _who_drafts(self, tokens: list[int], limit: int) -> tuple[DraftLength, str | None, int]:
        """Who drafts this round, by which length policy, and how many tokens: with a
        policy per source, the first of the drafter's sources whose policy drafts. If
        none does, the round is the first one's, undrafted."""
        if self.drafter is None:
            return self.length, None, 0
        if not self.lengths:  # one policy for every source: the drafter's first choice
            return self.length, None, self.length.choose(limit)
        policies = [(s, self.lengths.get(s, self.length)) for s in self.drafter.sources(tokens)]
        for source, length in policies:
            k = length.choose(limit)
            if k > 0:
                return length, source, k
        return policies[0][1], None, 0

    def _verify(
        self, draft: Draft, rng: np.random.Generator, sampling: SamplingParams
    ) -> tuple[list[int], int]:
        """The accepted path (draft indices) and the next token. Row 0 of the target's
        logits follows the context, row j + 1 draft token j."""
        logits = self.target.logits
        parents = draft.parent_list()
        if sampling.greedy:
            return verify_tree_greedy(draft.tokens, parents, lambda i: int(np.argmax(logits(i))))
        return verify_tree_sampled(
            draft.tokens, parents, draft.dists, lambda i: distribution(logits(i), sampling), rng
        )


def _batch_parents(n_unseen: int, parents: list[int] | None) -> list[int] | None:
    """The tree of a verification batch (see Context.decode): the unseen tokens in a
    row, then the draft's tree hanging from the last of them. None: all a chain."""
    if parents is None:
        return None
    last = n_unseen - 1
    return [*range(-1, last), *(last + 1 + p if p >= 0 else last for p in parents)]


def _decode_seconds(ctx: Context | None) -> float:
    return ctx.decode_seconds if ctx else 0.0
