"""The decode loop: draft, verify in one target pass, keep what the target agrees with.

Without a drafter the same loop is plain target-only decoding (every round drafts
nothing and the target picks one token), which is the baseline for every comparison.
A draft is a chain, or with a tree policy a tree: the same loop verifies both (a
chain is the tree with one branch). And one generation is the case of one slot: `step`
advances any number of generations, each in its own slot of the shared contexts, with
one target decode call for all of them (`run` steps one; the server's scheduler steps
every busy slot).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar, cast

import numpy as np

from specdec_cli.decoding.costmodel import verify_cost
from specdec_cli.decoding.draft import (
    NO_DRAFT,
    Draft,
    Drafter,
    DraftRequest,
    DraftSteps,
    draft_together,
)
from specdec_cli.decoding.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.decoding.grammar import Constraint, Grammar, PathMasks
from specdec_cli.decoding.logprobs import LogprobOptions, TokenLogprob, token_logprob
from specdec_cli.decoding.lookupthenmodel import LookupThenModel
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.multimodal import PromptMedia, media_starts, text_tokens
from specdec_cli.decoding.ngram import NgramDrafter
from specdec_cli.decoding.sampling import (
    Dist,
    Noise,
    SamplingParams,
    distribution,
    verify_tree_greedy,
    verify_tree_sampled,
)
from specdec_cli.decoding.stats import Stats
from specdec_cli.decoding.treeshape import TreePolicy
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context, MediaCells

VERBATIM = NgramDrafter.VERBATIM_SOURCE
FORCED = "grammar"  # a draft of the tokens a grammar forces (see Generation.drafting)
LOOKUPS = (NgramDrafter.name, VERBATIM)
T = TypeVar("T")


@dataclass(frozen=True)
class Round:
    """One round's new tokens: the first `n_drafted` were the drafter's, accepted by the
    target; the rest (at most one) is the target's own."""

    tokens: list[int]
    n_drafted: int
    source: str = ""
    # Each token's log-probability, when the generation asked for them (see logprobs.py)
    logprobs: tuple[TokenLogprob, ...] | None = None


class Decoder:
    """How one slot decodes: its share of the target (and of the draft), who drafts, and
    how much. Generations are its `start`s; `step` runs them, one round at a time."""

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
        policies = (self.length, *self.lengths.values())
        autos = [p for p in policies if isinstance(p, AutoLength)]
        # -k auto: every length policy may be shortened to fit a batch (see fit_to_batch)
        self.lengths_adapt = drafter is not None and len(autos) == len(policies)
        for policy in autos[1:]:  # an undrafted round is priced alike, whoever had it
            policy.share_plain_rounds(autos[0])
        self.grammar: Grammar | None = None  # what generations follow unless they say

    def start(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        sampling: SamplingParams | None = None,
        logprobs: LogprobOptions | None = None,
        grammar: Grammar | None = None,
        media: Mapping[int, MediaCells] | None = None,
    ) -> Generation:
        """A generation from `prompt`, its first `step` to come (see generate)."""
        grammar = grammar or self.grammar
        sampling = sampling or self.sampling
        return Generation(self, prompt, n_predict, rng, stats, sampling, logprobs, grammar, media)

    def generate(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        sampling: SamplingParams | None = None,
        logprobs: LogprobOptions | None = None,
        grammar: Grammar | None = None,
        media: Mapping[int, MediaCells] | None = None,
    ) -> Iterator[Round]:
        """Yield each round's new tokens until EOS, `n_predict` tokens or a full context
        (a negative `n_predict` sets no limit: until EOS or a full context, as llama.cpp's -n -1).
        `sampling`: this generation's settings (None: the decoder's own), for the target
        and the drafter alike, so that one decoder serves requests that sample differently.
        `logprobs`: what each round reports of its tokens' log-probabilities (None: nothing).
        `grammar`: the constraint the output follows (None: none; see grammar.py).
        `media`: the images or audio whose placeholders the prompt holds (see
        multimodal.py), by placeholder.

        `stats` is updated as it goes, so a caller that stops early (a stop string,
        Ctrl-C) still holds correct figures. The end-of-generation token is not yielded.
        This is `step` with one generation: the loop every slot of a server runs too.
        """
        generation = self.start(prompt, n_predict, rng, stats, sampling, logprobs, grammar, media)
        try:
            while not generation.finished:
                step([generation])
                if generation.error is not None:
                    raise generation.error
                if generation.round:
                    yield generation.round
        finally:
            generation.close()

    def who_drafts(self, tokens: list[int], limit: int) -> tuple[DraftLength, str | None, int]:
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

    def verify(
        self,
        draft: Draft,
        rng: np.random.Generator,
        sampling: SamplingParams,
        chances: list[float] | None = None,
        noise: Noise | None = None,
        position: int = 0,
        constraint: Constraint | None = None,
        certain: int = 0,
    ) -> tuple[list[int], int]:
        """The accepted path (draft indices) and the next token. Row 0 of the target's
        logits follows the context, row j + 1 draft token j. `chances`: see
        verify_tree_sampled (sampling only). `noise`: coupled sampling's, and `position`
        the place in the text of the token row 0 chooses. `constraint`: the grammar's
        matcher, whose mask each row's distribution is taken under (see grammar.py).
        `certain`: the first rows of a chain the grammar allows one token at, the draft's
        (Constraint.certain), which the target's batch gave no logits."""

        def logits(row: int) -> np.ndarray:
            return self.target.logits(row - certain)

        parents = draft.parent_list()
        if constraint is None:
            return self._verify(
                draft, parents, logits, rng, sampling, chances, noise, position, None, certain
            )
        masks = PathMasks(constraint, draft.tokens, parents)

        def masked(row: int) -> np.ndarray:
            return masks.masked(row, logits(row))

        def argmax(row: int) -> int:
            allowed = masks.allowed(row)
            values = logits(row)
            return int(np.argmax(values)) if allowed is None else constraint.argmax(values, allowed)

        try:
            return self._verify(
                draft, parents, masked, rng, sampling, chances, noise, position, argmax, certain
            )
        finally:
            masks.close()

    def _verify(
        self,
        draft: Draft,
        parents: list[int],
        logits: Callable[[int], np.ndarray],
        rng: np.random.Generator,
        sampling: SamplingParams,
        chances: list[float] | None,
        noise: Noise | None,
        position: int,
        argmax: Callable[[int], int] | None,
        certain: int,
    ) -> tuple[list[int], int]:
        """verify, with each row's logits (and its argmax) read through `logits`, but for
        the `certain` rows: the draft's token has all the mass there."""
        tokens = draft.tokens

        def dist(row: int) -> Dist:
            return Dist.point(tokens[row]) if row < certain else distribution(logits(row), sampling)

        if sampling.greedy:
            top = argmax or (lambda i: int(logits(i).argmax()))
            return verify_tree_greedy(
                tokens, parents, lambda i: tokens[i] if i < certain else top(i)
            )
        if noise is not None:  # the target's draw at each row is fixed: a match, as greedy
            depths = [0, *(d + 1 for d in draft.depths())]

            def draw(row: int) -> int:
                return noise.choose(dist(row), position + depths[row])

            return verify_tree_greedy(tokens, parents, draw)
        return verify_tree_sampled(tokens, parents, draft.dists, dist, rng, chances)


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


def step(
    generations: Sequence[Generation], budget: int | None = None, speculate: bool = True
) -> int:
    """One round of every generation, in one target decode call: each drafts, stages its
    verification batch (or a chunk of the prompt it is still reading; a prompt's end that
    fits starts its first round: see _joining) into the batch the target contexts share,
    and after the one call verifies its rows. Every generation's target must be a slot of
    one llama.cpp context (Context.split).

    With several generations, their draft lengths are fitted to the batch as a whole
    (see fit_to_batch): what a round costs is the cost of the whole batch. `budget`: the
    most prompt tokens read in this call (None: as many as a batch holds). `speculate`
    False: the drafts that may be shortened are dropped (see Scheduler), but for a text
    that repeats itself verbatim. Returns the call's number of tokens."""
    if not generations:
        return 0
    target = generations[0].decoder.target
    readers = [g for g in generations if g.reading]
    players = [g for g in generations if not g.reading]
    alone = len(generations) == 1
    budget = target.batch_room if budget is None else budget
    joining, budget = _joining(readers, budget)
    readers = [g for g in readers if g not in joining]
    players += joining
    plans = [g.plan(speculate or alone) for g in players]
    if not alone:
        read = sum(min(g.unread, target.n_batch) for g in readers)
        if speculate:
            fit_to_batch(plans, read, target.last_call_size)
        total = read + sum(len(p.unseen) + p.k for p in plans)
        for p in plans:
            p.beside = total - len(p.unseen) - p.k
    for g in generations:
        g.round = None
    # Every slot's draft at once: one draft decode call a depth for them all.
    planned = dict(zip(players, plans, strict=True))
    drafting = _each(players, lambda g: g.drafting(planned[g]))
    contexts = [g.decoder.drafter.ctx for g, _ in drafting if g.decoder.drafter]
    rounds = [None if steps is None else _failing_alone(g, steps) for g, steps in drafting]
    drafts = dict(zip([g for g, _ in drafting], draft_together(rounds, contexts), strict=True))
    drafted = [g for g in drafts if g.error is None]
    players = [g for g, _ in _each(drafted, lambda g: g.stage_round(planned[g], drafts[g]))]
    room = min(target.batch_room, budget)
    for g in readers:
        room -= g.stage_prompt(room)
    n_tokens = target.flush()
    _each(players, lambda g: g.conclude(timed=alone))
    return n_tokens


def _each(
    generations: Sequence[Generation], action: Callable[[Generation], T]
) -> list[tuple[Generation, T]]:
    """Each generation with what `action` gives for it, but those whose grammar fails in
    it (a UserError: a dead end, or a limit of llguidance's met): each of those ends with
    its error alone (see Generation.fail), and the others of the step go on."""
    done = []
    for g in generations:
        try:
            done.append((g, action(g)))
        except UserError as error:
            g.fail(error)
    return done


def _failing_alone(generation: Generation, steps: DraftSteps) -> DraftSteps:
    """A generation's draft steps, run beside other slots' (draft_together): where its
    grammar fails in them (see _each) it ends alone, drafting nothing more, and the
    other slots' drafts go on."""
    try:
        return (yield from steps)
    except UserError as error:
        generation.fail(error)
        return NO_DRAFT


def _joining(readers: Sequence[Generation], budget: int) -> tuple[list[Generation], int]:
    """The readers, in turn, whose prompts end within `budget` prompt tokens of this
    call, and the budget they leave. Each reads the end of its prompt as the start of
    its first round (undrafted), so that its first token comes in the same call, not
    after a round of its own that waits for the drafter to read the prompt and verifies
    a draft (llama-server samples it right after the prompt too). Beside other slots,
    the step a new request costs every slot is not paid twice either. The round
    drafts nothing, so nothing is rejected: a recurrent state is never sent back into
    the prompt. A rejection-sampled generation does not join: its text depends on each
    round's draft, and its first round drafts where it runs alone or its prompt is
    cached, so it reads its prompt first wherever it runs (a seed gives one text). Nor
    does one with media still to read: media is decoded in calls of its own."""
    joining = []
    for g in readers:
        if not g.sampling.draft_invariant or g.media_unread:
            continue
        target = g.decoder.target
        if g.unread > budget or g.unread + 1 > target.n_batch:
            break
        joining.append(g)
        budget -= g.unread
    return joining, budget


def fit_to_batch(plans: Sequence[Plan], extra: int = 0, last_size: int = 0) -> None:
    """Shorten the drafts that may be shortened (see Plan.fits) to what gives the
    whole batch the most expected tokens per second: when several slots share one
    target pass, its cost is the cost of all their tokens (plus `extra` prompt tokens),
    and where verification turns compute-bound the drafts shrink, to none. A batch of
    another size than the last call's (`last_size`) also pays a graph rebuild.

    The drafts grow from none, a token at a time, each time by the token that adds the
    most expected tokens (a slot's next token adds less than its last: this is the best
    split of any total), and the best total along the way is kept. Every total is
    priced, not only until one fails to help: a verification curve has steps (a batch
    past a kernel's tile costs much more than the one before), and a draft total just
    past one can rate worse than drafting more or nothing at all.

    Prompt tokens in the call (`extra`, and the prompt ends of slots that start in it)
    are paid whatever is drafted: their cost is left out of every rate. Counted in, a
    prompt's cost would make the call's own rate so low that any draft raised it, while
    drafts in the call must pay as they would in any other (a draft token priced at the
    cost of the call's tokens past the prompt)."""
    fits = [p for p in plans if p.k > 0 and p.fits]
    if not fits:
        return
    policies = [cast(AutoLength, p.length) for p in fits]  # as Plan.fits promises
    costs = policies[0].costs
    fitted = {id(p) for p in fits}
    others = [p for p in plans if id(p) not in fitted]
    # What the other slots add: their tokens to the batch, and (at least) one new token each.
    fixed = extra + sum(len(p.unseen) for p in plans) + sum(p.k for p in others)
    prompt = extra + sum(p.prompt for p in plans)
    paid = verify_cost(costs.verify, prompt) if prompt else 0.0
    gains = [policy.expected_tokens(p.k) for policy, p in zip(policies, fits, strict=True)]
    drafts = [policy.costs.draft_seconds for policy in policies]

    def rate(tokens: float, batch: int, drafting: float) -> float:
        passes = verify_cost(costs.verify, batch) - paid
        passes += costs.switch if batch != last_size else 0
        return tokens / (drafting + passes * costs.target_seconds)

    # As the drafts grow, what they promise, the batch, and the draft model's time follow
    # each token added. The slots draft together (draft_together), one draft call a depth
    # for all of them: the deepest draft sets the calls, each about one token's cost (a
    # draft model is small, and a few tokens a call is its flat part).
    ks = [0] * len(fits)
    tokens, batch, drafting = len(others) + sum(gain[0] for gain in gains), fixed, 0.0
    best, best_ks = rate(tokens, batch, drafting), list(ks)
    while growing := [i for i, p in enumerate(fits) if ks[i] < p.k]:
        i = max(growing, key=lambda i: gains[i][ks[i] + 1] - gains[i][ks[i]])
        tokens += gains[i][ks[i] + 1] - gains[i][ks[i]]
        ks[i] += 1
        batch += 1
        drafting = max(drafting, ks[i] * drafts[i])
        score = rate(tokens, batch, drafting)
        if score > best:
            best, best_ks = score, list(ks)
    for p, k in zip(fits, best_ks, strict=True):
        p.k = k


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
        if self.unread:  # it starts in the call that reads its prompt's end (see _joining)
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
        """This round's draft, as the plan has it (see draft_together); None: none."""
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
        stats.record_round(draft.source, len(draft.tokens), n_batch, n_accepted, len(new), beside)
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
        """End now with `error` (see step's _each): the round is lost."""
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
