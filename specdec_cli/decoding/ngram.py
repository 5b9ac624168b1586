"""Prompt lookup: n-gram drafting from the text so far, and from a server's earlier texts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from specdec_cli.decoding.draft import (
    Draft,
    DraftRequest,
    DraftSteps,
    TreeShape,
    merge_into_tree,
)
from specdec_cli.decoding.multimodal import PromptMedia
from specdec_cli.decoding.sampling import Dist, Noise, SamplingParams

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
        self,
        prompt: list[int],
        sampling: SamplingParams | None = None,
        noise: Noise | None = None,
        media: PromptMedia | None = None,
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

    def drafting(self, request: DraftRequest) -> DraftSteps:
        """`keep_drafting` is not consulted: a lookup has no confidence to offer. Nor
        does it decode anything: it returns at once."""
        yield from ()
        match = self.matches(request.tokens)
        return self.continuation(match, request.k, request.shape, request.source)

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
