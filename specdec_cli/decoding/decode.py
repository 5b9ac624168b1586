"""The decode loop: draft, verify in one target pass, keep what the target agrees with.

Without a drafter the same loop is plain target-only decoding (every round drafts
nothing and the target picks one token), which is the baseline for every comparison.
A draft is a chain, or with a tree policy a tree: the same loop verifies both (a
chain is the tree with one branch). And one generation is the case of one slot: `step`
advances any number of generations, each in its own slot of the shared contexts, with
one target decode call for all of them (`run` steps one; the server's scheduler steps
every busy slot). A generation's own half of each round is in generation.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar, cast

import numpy as np

from specdec_cli.decoding.costmodel import verify_cost
from specdec_cli.decoding.draft import (
    NO_DRAFT,
    Draft,
    Drafter,
    DraftSteps,
    draft_together,
)
from specdec_cli.decoding.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.decoding.generation import Generation, Plan, Round
from specdec_cli.decoding.grammar import Constraint, Grammar, PathMasks
from specdec_cli.decoding.logprobs import LogprobOptions
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

T = TypeVar("T")


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
