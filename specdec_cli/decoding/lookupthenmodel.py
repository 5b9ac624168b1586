"""Lookup-then-model: n-gram lookup or a model drafter, whichever has lately guessed better."""

from __future__ import annotations

from dataclasses import replace

from specdec_cli.decoding.draft import Drafter, DraftRequest, DraftSteps
from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.ngram import Match, NgramDrafter
from specdec_cli.decoding.sampling import Noise, SamplingParams


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
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
    ) -> None:
        """Each text anew: how much one repeats itself says nothing of the next. The
        lookup starts at even odds, so that its guesses, scored while the model drafts,
        must earn it the turn (from 1.0 it drafted after the model's first miss)."""
        self.lookup.begin(prompt, sampling, noise)
        self.model.begin(prompt, sampling, noise, media)
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

    def drafting(self, request: DraftRequest) -> DraftSteps:
        order, match = self._decide(request.tokens)
        source = request.source or order[0]
        if source in (self.lookup.name, self.lookup.VERBATIM_SOURCE):
            return self.lookup.continuation(match, request.k, request.shape, source)
        draft = yield from self.model.drafting(replace(request, source=None))
        self._guesses.append((self.model.name, len(request.tokens), draft.primary_path()))
        return draft
