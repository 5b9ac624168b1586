"""Drafters without a model: n-gram lookup, and lookup-then-model with a stand-in model."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_cli.decoding.draft import Draft, DraftRequest, DraftSteps, propose
from specdec_cli.decoding.lookupthenmodel import LookupThenModel
from specdec_cli.decoding.ngram import NgramDrafter, TextMemory
from specdec_cli.llamacpp.llama import common_prefix

RNG = np.random.default_rng(0)


class StandInModel:
    """Guesses `guess(tokens)` for every position; a real ModelDrafter needs llama.cpp."""

    name = "model"
    ctx = None

    def __init__(self, guess) -> None:
        self.guess = guess

    def begin(self, prompt: list[int], sampling=None, noise=None, media=None) -> None:
        pass

    def drafting(self, request: DraftRequest) -> DraftSteps:
        yield from ()
        return Draft(tokens=self.guess(request.tokens)[: request.k], source=self.name)


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    lookup = NgramDrafter(n_min=1, n_max=3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    lookup.begin(tokens)
    # [2, 3] last occurred before [5, 6]; [9, 2, 3] never: the 2-gram wins.
    assert propose(lookup, tokens, 2, RNG).tokens == [5, 6]


def sources(drafter: LookupThenModel, text: list[int], start: int, k: int = 3) -> list[str]:
    """Run rounds over `text` as the target's output (every draft checked against it),
    from `start` tokens in; return who drafted each round."""
    drafter.begin(text[:start])
    tokens, used = text[:start], []
    while len(tokens) < len(text) - k - 1:
        draft = propose(drafter, tokens, k, RNG)
        truth = text[len(tokens) : len(tokens) + len(draft.tokens) + 1]
        accepted = 0
        while accepted < len(draft.tokens) and draft.tokens[accepted] == truth[accepted]:
            accepted += 1
        used.append(draft.source)
        tokens = tokens + truth[: accepted + 1]
    return used


def test_lookup_drafts_where_it_beats_the_model() -> None:
    # The text repeats itself exactly; the model always guesses 0.
    text = list(range(1, 21)) * 4
    drafter = LookupThenModel(NgramDrafter(3, 4), StandInModel(lambda t: [0] * 8))
    used = sources(drafter, text, start=20)
    assert used[0] == "model"  # the model drafts until the lookup has proved better
    assert used[-10:] == ["ngram"] * 10


def test_model_drafts_where_the_lookup_guesses_badly() -> None:
    # A phrase that comes back with a new ending each time: the lookup's continuation
    # is wrong every time, the model (which knows the text) always right. A lookup
    # tried first whenever it matches took 38 of 77 rounds here, each a miss.
    phrase = [1, 2, 3, 4]
    text = [t for i in range(40) for t in (*phrase, 100 + i)]
    drafter = LookupThenModel(NgramDrafter(3, 4), StandInModel(lambda t: text[len(t) :]))
    used = sources(drafter, text, start=len(phrase))
    assert used.count("ngram") == 0  # it never earned the turn


def test_each_text_starts_the_lookup_afresh() -> None:
    """A text that repeats itself says nothing of the next one: the lookup earns its
    turn again in each generation."""
    copied = list(range(1, 21)) * 4
    phrase = [1, 2, 3, 4]
    varied = [t for i in range(40) for t in (*phrase, 100 + i)]
    model = StandInModel(lambda t: varied[len(t) :] if t[: len(phrase)] == phrase else [0] * 8)
    drafter = LookupThenModel(NgramDrafter(3, 4), model)
    assert sources(drafter, copied, start=20)[-1] == "ngram"
    assert sources(drafter, varied, start=len(phrase)).count("ngram") == 0


def test_the_lookup_earns_its_turn_in_rounds_no_one_drafts() -> None:
    """Where the model's length policy finds drafting does not pay, it drafts only a
    probe now and then, and in the other rounds the decode loop asks who drafts next
    but calls no one: the lookup's guesses must be scored all the same, or copied text,
    which it drafts for free, never gets it the turn."""
    text = list(range(1, 21)) * 4
    drafter = LookupThenModel(NgramDrafter(3, 4), StandInModel(lambda t: [0] * 8))
    drafter.begin(text[:20])
    tokens, asked = text[:20], []
    while len(tokens) < 40:
        asked.append(drafter.sources(tokens)[0])
        probe = len(asked) % 8 == 0
        if probe and asked[-1] == "model":  # the probe misses: the target's token only
            propose(drafter, tokens, 3, RNG)
        tokens = text[: len(tokens) + 1]
    assert asked[0] == "model" and asked[-1] == "ngram"


LOOP = [7, 8, 9, 10, 11]  # a text going round: the same five tokens again and again


def test_a_verbatim_repeat_is_a_source_of_its_own() -> None:
    """The last VERBATIM tokens seen before, in full: a loop or a copied block, which the
    decode loop drafts with a length policy of its own. A shorter repeat is a lookup."""
    lookup = NgramDrafter(1, 4)
    prefix = list(range(100, 130))
    for tokens in (prefix + LOOP * 6, prefix + list(range(40)) + [1, 2, 3] + list(range(40))):
        lookup.begin(tokens)
        assert lookup.sources(tokens) == [NgramDrafter.VERBATIM_SOURCE, "ngram"]
    short = prefix + list(range(30)) + [1] + list(range(23))  # 23 tokens repeat
    lookup.begin(short)
    assert lookup.sources(short) == ["ngram"]


def test_verbatim_drafts_go_round_the_loop() -> None:
    """Past the end of the text, a verbatim draft repeats the tokens since the match, as
    the loop would; a plain lookup stops where the text does."""
    lookup = NgramDrafter(1, 4)
    tokens = list(range(100, 130)) + LOOP * 6 + LOOP[:2]
    lookup.begin(tokens)
    ahead = (LOOP[2:] + LOOP * 3)[:12]
    assert propose(lookup, tokens, 12, RNG, source=NgramDrafter.VERBATIM_SOURCE).tokens == ahead
    assert propose(lookup, tokens, 12, RNG).tokens == ahead[:5]


def test_lookup_then_model_offers_a_verbatim_repeat_first() -> None:
    drafter = LookupThenModel(NgramDrafter(3, 4), StandInModel(lambda t: [0] * 8))
    tokens = list(range(100, 130)) + LOOP * 6
    drafter.begin(tokens)
    assert drafter.sources(tokens)[0] == NgramDrafter.VERBATIM_SOURCE
    assert (
        propose(drafter, tokens, 8, RNG, source=NgramDrafter.VERBATIM_SOURCE).tokens
        == (LOOP * 2)[:8]
    )


def test_a_lookup_with_a_memory_finds_an_earlier_generations_text() -> None:
    """A server's lookups share a memory of recent texts: a text that goes over what an
    earlier generation wrote gets that generation's continuation, where its own text
    has no match as long. Sampled generations never look there, and the memory keeps to
    its budget, the oldest text out first."""
    memory = TextMemory(40, 1, 4)
    lookup = NgramDrafter(1, 4, memory=memory)
    earlier = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    lookup.begin(earlier[:3])
    propose(lookup, earlier, 3, RNG)  # sees the whole text, handed over at the next begin
    lookup.begin([1, 2, 3])
    assert propose(lookup, [1, 2, 3], 3, RNG).tokens == [4, 5, 6]
    # Its own text's match wins at equal length; a longer one in memory wins over it.
    for text, k, guess in (([7, 3, 9, 3], 1, [9]), ([7, 2, 3], 2, [4, 5])):
        lookup.begin(text)
        assert propose(lookup, text, k, RNG).tokens == guess
    sampled = NgramDrafter(1, 4, invariant=False, memory=memory)
    sampled.begin([1, 2, 3])
    assert propose(sampled, [1, 2, 3], 3, RNG).tokens == []
    for start in range(100, 160, 20):  # 60 more tokens: the first text is forgotten
        memory.add(list(range(start, start + 20)))
    assert memory.find((2, 3)) is None and memory.find((121, 122)) is not None


@pytest.mark.parametrize("shared", [0, 1, 255, 256, 257, 600])
def test_common_prefix_counts_the_shared_start(shared: int) -> None:
    """Slices compared a chunk at a time count the same as one token at a time, at and
    around the chunk's edges, and for other kinds of sequences than lists."""
    a = list(range(700))
    b = [*a[:shared], -1, *a[shared + 1 :]]
    assert common_prefix(a, b) == shared
    assert common_prefix(a, b[:shared]) == shared
    assert common_prefix(tuple(a), np.array(b)) == shared
    assert common_prefix(a, a) == len(a)
