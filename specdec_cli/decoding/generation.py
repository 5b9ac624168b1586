"""One generation in one slot, between the target's decode calls: its prompt read, and
each round planned (who drafts, how much), drafted, staged for verification, and
concluded (what the target agrees with kept, the policies taught). decode.step drives
any number of them in lockstep, one target call for all.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.decoding.draft import NO_DRAFT, Draft, Drafter, DraftRequest, DraftSteps
from specdec_cli.decoding.draftlength import DraftLength
from specdec_cli.decoding.grammar import Grammar, PathMasks
from specdec_cli.decoding.logprobs import LogprobOptions, TokenLogprob, token_logprob
from specdec_cli.decoding.lookupthenmodel import LookupThenModel
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.multimodal import PromptMedia, media_starts, text_tokens
from specdec_cli.decoding.ngram import NgramDrafter
from specdec_cli.decoding.sampling import Dist, Noise, SamplingParams
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context, MediaCells

if TYPE_CHECKING:
    from specdec_cli.decoding.decode import Decoder

VERBATIM = NgramDrafter.VERBATIM_SOURCE
FORCED = "grammar"  # a draft of the tokens a grammar forces (see Generation.drafting)
LOOKUPS = (NgramDrafter.name, VERBATIM)


@dataclass(frozen=True)
class Round:
    """One round's new tokens: the first `n_drafted` were the drafter's, accepted by the
    target; the rest (at most one) is the target's own."""

    tokens: list[int]
    n_drafted: int
    source: str = ""
    # Each token's log-probability, when the generation asked for them (see logprobs.py)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class Plan:
    """A round before its draft: who drafts, by which policy, and how much."""

    length: DraftLength
    source: str | None
    k: int
    limit: int  # the most draft tokens this round may verify
    unseen: list[int]  # tokens the target has still to see, first in its batch
    # Whether fit_to_batch may shorten the draft: -k auto, a text the same whatever the
    # drafts (a rejection-sampled text depends on k, and must not on what else runs).
    fits: bool = False
    chosen: bool = True  # False: no policy was asked (a step without speculation)
    beside: int = 0  # tokens the other slots put in the same target call (their chains)
    prompt: int = 0  # of the unseen tokens, the end of its prompt (read in this call)


def check_prompt(prompt: list[int], n_ctx: int) -> None:
    """A prompt a slot of n_ctx cells can generate from, or one line saying why not."""
    if not prompt:
        raise UserError("the prompt is empty; give some text with -p, -f or stdin")
    if prompt[-1] < 0:
        raise UserError(
            "the prompt ends with an image or audio; put text after it (a chat template does)"
        )
    if len(prompt) >= n_ctx:
        raise UserError(
            f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}; "
            "shorten the prompt or raise -c"
        )


class Generation:
    """One generation's state between rounds: its tokens, its figures, and its round in
    two halves around the target's decode call (`stage_round`, then `conclude`)."""

    def __init__(
        self,
        decoder: Decoder,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        sampling: SamplingParams,
        logprobs: LogprobOptions | None = None,
        grammar: Grammar | None = None,
        media: Mapping[int, MediaCells] | None = None,
    ) -> None:
        target = decoder.target
        check_prompt(prompt, target.n_ctx)
        # The grammar's matcher, at the start of the output (see grammar.py)
        self.constraint = grammar.start(target.model) if grammar is not None else None
        self.decoder, self.prompt, self.rng, self.stats = decoder, prompt, rng, stats
        self.sampling = sampling
        self.logprobs = logprobs  # None: no work per token for them
        coupled = sampling.coupled and not sampling.greedy
        self.noise = Noise.draw(rng) if coupled else None
        self.n_predict = target.n_ctx if n_predict < 0 else n_predict  # the context fills first
        self.tokens = list(prompt)
        # The prompt's media, where each starts, and the end of the last (see stage_prompt)
        self.media = media or {}
        self._media_starts = media_starts(prompt, self.media) if media else []
        ends = (start + self.media[prompt[start]].n_tokens for start in self._media_starts)
        self._media_end = max(ends, default=0)
        # What drafters see: the text alone (see multimodal.py); the tokens themselves
        # for a prompt without media. Those that see media learn where they lie.
        self._text_prompt = text_tokens(prompt) if media else prompt
        self.text = list(self._text_prompt) if media else self.tokens
        self._prompt_media = PromptMedia(prompt, self.media) if media else None
        self.n_new = 0
        self.finished = False
        self.error: UserError | None = None  # why it ended early, its grammar's fault
        self.round: Round | None = None  # the last step's new tokens
        self.draft = NO_DRAFT
        stats.k, stats.tree = decoder.label, decoder.tree_label
        stats.prompt_tokens = len(prompt)
        self._t_start = self._t_gen = self._round_end = time.perf_counter()
        self._draft_ctx = decoder.drafter.ctx if decoder.drafter else None
        self._contexts = [target, self._draft_ctx] if self._draft_ctx else [target]
        # The last prompt token goes into the first verification batch.
        stats.prompt_reused = target.reuse(prompt[:-1])
        self._started = False
        self._plan: Plan | None = None
        self._certain = 0  # the round's rows without logits (see _certain_rows)
        # Whether fit_to_batch may shorten its drafts (see Plan.fits).
        self._fits = sampling.draft_invariant and decoder.lengths_adapt

    # Reading the prompt.

    @property
    def unread(self) -> int:
        """Prompt tokens the target has still to read (all but the last: see __init__)."""
        return max(0, len(self.prompt) - 1 - len(self.decoder.target.tokens))

    @property
    def reading(self) -> bool:
        return self.unread > 0

    @property
    def media_unread(self) -> bool:
        """Whether media of the prompt is still to be read."""
        return len(self.decoder.target.tokens) < self._media_end

    def stage_prompt(self, room: int) -> int:
        """Stage the next chunk of the prompt, at most `room` tokens: how many it took.
        Where media comes next, it is decoded now instead, in calls of its own (its cells
        counted against `room`); text stops before the next media."""
        target = self.decoder.target
        n = min(self.unread, room)
        start = len(target.tokens)
        if n > 0 and start < self._media_end:
            following = self._media_starts[bisect_left(self._media_starts, start)]
            if following == start:
                media = self.media[self.prompt[start]]
                target.decode_media(media)
                return min(n, media.n_tokens)
            n = min(n, following - start)
        target.stage(self.prompt[start : start + n])
        return n

    # Rounds.

    def _begin(self) -> None:
        """The prompt is read (by the last call, for a slot that started in the call
        that read its end): the drafter reads it too, and the clocks start."""
        decoder = self.decoder
        if decoder.drafter:
            decoder.drafter.begin(self._text_prompt, self.sampling, self.noise, self._prompt_media)
        for length in (decoder.length, *decoder.lengths.values()):
            length.begin(self.sampling.draft_invariant)
        if decoder.tree:
            decoder.tree.begin(self.sampling.draft_invariant)
        self._start_clocks()
        self._started = True

    def _start_clocks(self) -> None:
        """The prompt's time ends, the generation's begins."""
        decoder, stats = self.decoder, self.stats
        self._verify_before = decoder.target.decode_seconds
        self._rollback_before = decoder.target.rollback_seconds
        self._draft_before = _decode_seconds(self._draft_ctx)
        self._draft_calls_before = self._draft_ctx.decode_calls if self._draft_ctx else 0
        self._llama_before = sum(c.perf_seconds() for c in self._contexts)
        self._t_gen = self._round_end = time.perf_counter()
        stats.prompt_seconds = self._t_gen - self._t_start

    def plan(self, speculate: bool = True) -> Plan:
        """Who drafts this round and how much, as the slot's policies alone would have it.
        `speculate` False: no draft where one may be left out (see Plan.fits), and then
        no policy is asked, so that the round costs what a target-only one does; but a
        text that repeats itself verbatim still drafts (see _repeating)."""
        target = self.decoder.target
        # The target has not seen the last token (nor, after a recurrent model's
        # rewind, a few before it): they go first in the verification batch, and
        # the row of the last one predicts the next token.
        unseen = self.tokens[len(target.tokens) :]
        # A round yields at most k + 1 tokens: stay within -n and the context,
        # and verify in one decode call (the logits of one call are all kept).
        room = min(self.n_predict - self.n_new, target.n_ctx - len(self.tokens))
        limit = min(room - 1, target.n_batch - len(unseen))
        if self.unread:  # it starts in the call that reads its prompt's end (see decode._joining)
            # and drafts from the next round on, as llama-server: its drafter has yet to
            # read the prompt, and every slot of the call would wait for that and the draft.
            length = self.decoder.length
            return Plan(length, None, 0, limit, unseen, chosen=False, prompt=self.unread)
        if not self._started:
            self._begin()
        if not speculate and self._fits and not self._repeating():
            return Plan(self.decoder.length, None, 0, limit, unseen, True, chosen=False)
        length, source, k = self.decoder.who_drafts(self.text, limit)
        return Plan(length, source, k, limit, unseen, self._fits)

    def drafting(self, plan: Plan) -> DraftSteps | None:
        """This round's draft, as the plan has it (see draft.draft_together); None: none."""
        decoder, tree, k = self.decoder, self.decoder.tree, plan.k
        self._draft_start = _decode_seconds(self._draft_ctx)
        constraint = self.constraint
        model = _grammar_drafter(decoder.drafter)
        if model is not None:
            model.constraint = None
        if constraint is not None and decoder.drafter and plan.chosen and plan.limit > 0:
            # What the grammar forces is drafted as it is, certain, without a draft call.
            forced = constraint.forced()[: plan.limit]
            if forced:
                return self._forced(forced)
        if not decoder.drafter or k == 0:
            return None
        # A rejection-sampled round's shape decides which random numbers go where: it is
        # shaped as alone, so that a seed gives the same text beside any neighbours.
        beside = plan.beside if self.sampling.draft_invariant else 0
        # Under a grammar, each draft token is drawn under the mask after its path, tried
        # in the matcher (stage_round takes them back).
        shape = tree.shape(k, plan.limit, beside) if tree else None
        if model is not None:
            model.constraint = constraint
        length = plan.length
        keep_drafting = length.keep_drafting if length.uses_confidence else None
        request = DraftRequest(self.text, k, self.rng, keep_drafting, shape, plan.source)
        return decoder.drafter.drafting(request)

    def _forced(self, tokens: list[int]) -> DraftSteps:
        """A draft of the tokens the grammar forces: each at probability 1 (the masked
        target gives it all its mass), no draft model call."""
        yield from ()
        dists = [] if self.sampling.draft_invariant else [Dist.point(t) for t in tokens]
        return Draft(tokens=list(tokens), dists=dists, source=FORCED)

    def _under_grammar(self, draft: Draft) -> Draft:
        """The draft as the target's masks will see it: a lookup's guesses (or any
        draft of a text no draft changes) cut at the first token the grammar forbids,
        which the target would reject. A rejection-sampled model draft is never cut: its
        tokens must stand as drawn (and they were drawn under the mask, see drafting)."""
        constraint = self.constraint
        assert constraint is not None
        constraint.undo()  # the tokens tried while drafting
        deterministic = draft.source in LOOKUPS or self.sampling.draft_invariant
        if draft.parents is not None or not draft.tokens or not deterministic:
            return draft
        n = constraint.valid_prefix(draft.tokens)
        if n == len(draft.tokens):
            return draft
        return replace(
            draft,
            tokens=draft.tokens[:n],
            dists=draft.dists[:n],
            confidences=draft.confidences[:n],
        )

    def _repeating(self) -> bool:
        """Whether the text repeats itself verbatim (the lookup's first source): such
        drafts are taken nearly whole, and pay beside any batch, on any cost curve."""
        drafter = self.decoder.drafter
        return drafter is not None and drafter.sources(self.text)[0] == VERBATIM

    def stage_round(self, plan: Plan, draft: Draft) -> None:
        """Stage the verification batch: the unseen tokens, then the draft."""
        target = self.decoder.target
        if self.constraint is not None:
            draft = self._under_grammar(draft)
        self._verify_start = target.decode_seconds
        self._rollback_start = target.rollback_seconds
        target.checkpoint(len(draft.tokens))  # rejected drafts must not stay
        # One pass over the unseen tokens and every draft token: row 0 of its
        # logits follows the last unseen token, row j + 1 draft token j.
        batch = [*plan.unseen, *draft.tokens]
        parents = _batch_parents(len(plan.unseen), draft.parents)
        self._certain = self._certain_rows(draft)
        target.stage(batch, len(draft.tokens) + 1 - self._certain, parents)
        self.draft, self._plan = draft, plan

    def _certain_rows(self, draft: Draft) -> int:
        """How many of the draft's first rows need no logits: of a forced draft, those
        where the grammar allows the draft's token alone (Constraint.certain). A row
        without logits skips the output layer, most of a small model's cost a row on a
        large vocabulary. None where log-probabilities are reported: they read every
        row."""
        if draft.source != FORCED or self.constraint is None or self.logprobs is not None:
            return 0
        return self.constraint.certain(draft.tokens)

    def conclude(self, timed: bool) -> None:
        """After the decode call: keep what the target agrees with, and learn from it.
        `timed`: the call was this generation's alone, so its clock is this round's."""
        decoder, target, stats, draft = self.decoder, self.decoder.target, self.stats, self.draft
        plan = self._plan
        assert plan is not None
        # A sampled chain's chances of acceptance teach -k auto more than its luck does.
        sampled_chain = not self.sampling.draft_invariant and draft.parents is None
        chances: list[float] | None = [] if sampled_chain else None
        position = len(self.tokens)
        path, next_token = decoder.verify(
            draft,
            self.rng,
            self.sampling,
            chances,
            self.noise,
            position,
            self.constraint,
            self._certain,
        )
        logprobs = None if self.logprobs is None else self._logprobs(draft, path, next_token)
        n_accepted = len(path)
        beside = draft.beside_primary(path)  # a chain would have missed these
        # Keep the accepted path, drop the rest (its last token is in batch place
        # len(unseen) - 1 + path[-1] + 1; the last unseen one if nothing was).
        target.keep_branch(len(plan.unseen) + (path[-1] if path else -1))
        # The round's own time runs from the end of the last one: the consumer's
        # work on the last tokens counts too.
        round_start, self._round_end = self._round_end, time.perf_counter()
        if self.sampling.draft_invariant and timed:  # the same text whatever k: follow the clock
            draft_seconds = _decode_seconds(self._draft_ctx) - self._draft_start
            verify_seconds: float | None = target.decode_seconds - self._verify_start
            rollback_seconds: float | None = target.rollback_seconds - self._rollback_start
            spent = draft_seconds + verify_seconds + rollback_seconds
            other_seconds = self._round_end - round_start - spent
        else:  # k decides which random numbers go where: a seed must reproduce (and a
            # shared decode call's time is no one round's)
            draft_seconds = verify_seconds = rollback_seconds = other_seconds = None
        if plan.chosen and draft.source != FORCED:
            plan.length.observe(
                draft,
                n_accepted,
                draft_seconds,
                verify_seconds,
                other_seconds,
                beside=beside,
                chances=chances or (),
                rollback_seconds=rollback_seconds,
            )
            if decoder.tree:
                decoder.tree.observe(draft, path)

        new = [*(draft.tokens[i] for i in path), next_token]
        eog = next((i for i, t in enumerate(new) if target.model.is_eog(t)), None)
        if eog is not None:
            new = new[:eog]
            stats.stop_reason = "eos"
        if self.constraint is not None:
            self.constraint.advance(new)
        n_batch = len(plan.unseen) - plan.prompt + len(draft.tokens)
        stats.record_round(
            draft.source, len(draft.tokens), n_batch, n_accepted, len(new), beside, eog is not None
        )
        self.tokens += new
        if self.text is not self.tokens:
            self.text += new
        self.n_new += len(new)
        if plan.prompt:  # the call read the prompt's end: its time is the prompt's
            stats.with_prompt = len(new)
            self._start_clocks()
        stats.seconds = time.perf_counter() - self._t_gen
        kept = tuple(logprobs[: len(new)]) if logprobs is not None else None
        self.round = Round(new, min(n_accepted, len(new)), draft.source, kept)
        if not stats.stop_reason:
            if self.n_new >= self.n_predict:
                stats.stop_reason = "length"
            elif len(self.tokens) >= target.n_ctx:
                stats.stop_reason = "context"
        self.finished = bool(stats.stop_reason)

    def _logprobs(self, draft: Draft, path: list[int], next_token: int) -> list[TokenLogprob]:
        """The round's tokens' log-probabilities, each from the target's row it was
        verified against: row 0 for the first, and for each next (the round's own token
        too) the row of the accepted draft token before it. Read before keep_branch,
        from the logits the verification pass left: no decode of its own."""
        assert self.logprobs is not None
        logits = self.decoder.target.logits
        tokens = [*(draft.tokens[i] for i in path), next_token]
        rows = [0, *(i + 1 for i in path)]
        constraint = self.constraint
        if constraint is None or not self.logprobs.post_sampling:
            return [
                token_logprob(logits(row), token, self.logprobs, self.sampling)
                for row, token in zip(rows, tokens, strict=True)
            ]
        # Post-sampling under a grammar: the masked distribution the token came from.
        masks = PathMasks(constraint, draft.tokens, draft.parent_list())
        try:
            return [
                token_logprob(masks.masked(row, logits(row)), token, self.logprobs, self.sampling)
                for row, token in zip(rows, tokens, strict=True)
            ]
        finally:
            masks.close()

    def fail(self, error: UserError) -> None:
        """End now with `error` (see decode._each): the round is lost."""
        self.error, self.finished, self.round = error, True, None

    def close(self) -> None:
        """The generation's figures, whether it ran to its end or was stopped early."""
        self.finished = True
        if not self._started:
            return
        stats, target = self.stats, self.decoder.target
        stats.seconds = time.perf_counter() - self._t_gen
        stats.verify_seconds = target.decode_seconds - self._verify_before
        stats.rollback_seconds = target.rollback_seconds - self._rollback_before
        stats.llama_seconds = sum(c.perf_seconds() for c in self._contexts) - self._llama_before
        stats.draft_seconds = _decode_seconds(self._draft_ctx) - self._draft_before
        if self._draft_ctx:
            stats.draft_calls = self._draft_ctx.decode_calls - self._draft_calls_before


def _grammar_drafter(drafter: Drafter | None) -> ModelDrafter | None:
    """The drafter's model (or head) that draws in the target's vocabulary: the one that
    may draw under the grammar's mask (a translated draft draws in its own)."""
    if isinstance(drafter, LookupThenModel):
        drafter = drafter.model
    return drafter if isinstance(drafter, ModelDrafter) else None


def _batch_parents(n_unseen: int, parents: list[int] | None) -> list[int] | None:
    """The tree of a verification batch (see Context.decode): the unseen tokens in a
    row, then the draft's tree hanging from the last of them. None: all a chain."""
    if parents is None:
        return None
    last = n_unseen - 1
    return [*range(-1, last), *(last + 1 + p if p >= 0 else last for p in parents)]


def _decode_seconds(ctx: Context | None) -> float:
    return ctx.decode_seconds if ctx else 0.0
