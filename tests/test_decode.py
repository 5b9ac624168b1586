"""The decode loop on real llama.cpp models: speculative output == target-only output."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    DRAFT_HPARAMS,
    DRAFT_LAYERS,
    SEED,
    TARGET_HPARAMS,
    WEAK_SCALE,
    pin_costs,
    target_tensors,
)
from gguf import TokenType
from ggufgen import (
    Vocab,
    first_layers,
    llama_metadata,
    llama_tensors,
    pad_rows,
    padded,
    write_gguf,
)
from scipy.stats import chi2_contingency, chisquare

from specdec_cli.commands.bench import BUILTIN_PROMPTS
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.decode import Decoder, step
from specdec_cli.decoding.draft import Draft, DraftRequest, DraftSteps
from specdec_cli.decoding.draftlength import AutoLength, FixedLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.ngram import NgramDrafter
from specdec_cli.decoding.policy import VERBATIM_PRIOR
from specdec_cli.decoding.sampling import GREEDY, SamplingParams, distribution
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.probe import choose_repack

PROMPT = "Once upon a time"
K_VALUES = [1, 2, 4, 8, "auto"]


def open_engine(
    target: Path,
    draft: Path | str | None = None,
    k: int | str = 4,
    sampling: SamplingParams = GREEDY,
    n_ctx: int = 256,
    n_batch: int = 2048,
    flash_attn: str = "auto",
    tree: str = "auto",
    ngram_min: int = DraftOptions.ngram_min,
) -> Engine:
    """`draft` is a model file, "ngram", or None."""
    return Engine(
        EngineOptions(
            target=target,
            draft=None if draft == "ngram" else draft,
            ngram=draft == "ngram",
            n_ctx=n_ctx,
            n_batch=n_batch,
            threads=1,
            flash_attn=flash_attn,
            sampling=sampling,
            drafting=DraftOptions(k=str(k), tree=tree, ngram_min=ngram_min),
        )
    )


def generate(
    engine: Engine,
    n_predict: int = 64,
    seed: int = 0,
    decoder: Decoder | None = None,
    prompt: list[int] | None = None,
    sampling: SamplingParams | None = None,
) -> tuple[list[int], Stats]:
    """Generated tokens (without the end-of-generation token) for `prompt` (default: PROMPT)."""
    stats = Stats()
    prompt = engine.tokenize(PROMPT) if prompt is None else prompt
    out: list[int] = []
    rng = np.random.default_rng(seed)
    for new in (decoder or engine.decoder).generate(prompt, n_predict, rng, stats, sampling):
        out += new.tokens
    return out, stats


def target_only(target: Path, n_predict: int = 64, n_ctx: int = 256) -> list[int]:
    with open_engine(target, n_ctx=n_ctx) as engine:
        return generate(engine, n_predict)[0]


@pytest.fixture(scope="module")
def fixture_reference(target_model: Path) -> list[int]:
    return target_only(target_model)


@pytest.fixture(scope="module")
def stories_reference(stories260k: Path) -> list[int]:
    return target_only(stories260k, n_predict=128)


@pytest.mark.parametrize("drafter", ["model", "ngram", "model+ngram"])
def test_sampling_is_an_argument_of_each_generation(
    target_model: Path, draft_model: Path, fixture_reference: list[int], drafter: str
) -> None:
    """One decoder, built to sample at 0.8, follows the settings each generation passes
    (as `specdec serve` needs): greedy, then top-k 1 at a high temperature (greedy too),
    in the drafter as in the target, whose sampled output would differ."""
    with open_engine(target_model, draft_model, 3, SamplingParams(temp=0.8)) as engine:
        decoder = engine.make_decoder(drafter, "3")
        for sampling in (GREEDY, SamplingParams(temp=1.5, top_k=1)):
            assert generate(engine, decoder=decoder, sampling=sampling)[0] == fixture_reference
        assert generate(engine, decoder=decoder)[0] != fixture_reference


def test_reference_is_a_real_continuation(fixture_reference: list[int]) -> None:
    assert len(fixture_reference) == 64
    assert len(set(fixture_reference)) > 5  # not one token repeated


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_draft_equal_to_target(target_model: Path, fixture_reference, k: int) -> None:
    # Chains: a tree's side nodes are the draft's second choices, which the same model
    # never takes (whether --tree auto grows any depends on the costs measured here).
    with open_engine(target_model, target_model, k, tree="off") as engine:
        out, stats = generate(engine)
    assert out == fixture_reference
    assert stats.acceptance_rate == 1.0  # the same model always agrees with itself
    assert stats.tokens_per_pass > 1.0


@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_smaller_draft(
    target_model: Path, draft_model: Path, fixture_reference, k: int, moderate_costs: None
) -> None:
    # Costs pinned: a draft half the target's size hardly pays, and a noisy measurement
    # made -k auto draft once in 64 tokens (a CI run), leaving nothing to reject.
    with open_engine(target_model, draft_model, k) as engine:
        out, stats = generate(engine)
    assert out == fixture_reference
    assert 0.0 < stats.acceptance_rate < 1.0  # some drafts rejected, some kept
    assert stats.drafted > 0
    if k == "auto":
        assert len(stats.draft_lengths) > 1  # the length really varies


@pytest.mark.usefixtures("moderate_costs")  # measured, the draft model may not pay
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_q8_0(q8_pair: tuple[Path, Path], k: int | str) -> None:
    """Quantized weights: on this pair no near-tie falls the other way between a one-token
    batch and a batch of k+1 (see docs/exactness.md, "llama.cpp's numerics")."""
    target, draft = q8_pair
    with open_engine(target, draft, k) as engine:
        out, stats = generate(engine)
    assert out == target_only(target)
    # -k auto prices a round's Python by the clock: where a drafting round of these tiny
    # models costs more than it saves, it drafts only its probes.
    assert 0.0 < stats.acceptance_rate < 1.0 if k != "auto" else stats.drafted > 0


# -k auto by pinned costs: a measured curve can leave the model's drafting unpaid (a flake)
@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_lookup_then_model(
    target_model: Path, draft_model: Path, fixture_reference, k
) -> None:
    with open_engine(target_model, draft_model, k) as engine:
        decoder = engine.make_decoder("model+ngram", str(k))
        out, stats = generate(engine, decoder=decoder)
    assert out == fixture_reference
    assert stats.proposed_by["model"] > 0


@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("k", ["3", "auto"])
def test_greedy_lookup_then_model_trees(target_model: Path, draft_model: Path, k: str) -> None:
    """Tree rounds from both drafters (the lookup's branches are its earlier
    continuations), each at its own length: still the target's text."""
    with open_engine(target_model, draft_model, k, tree="8") as engine:
        out, stats = generate(engine, n_predict=200, decoder=engine.make_decoder("model+ngram", k))
    assert out == target_only(target_model, n_predict=200)
    assert stats.proposed_by["model"] > 0 and stats.proposed_by["ngram"] > 0
    assert stats.accepted_beside > 0


def test_a_lookup_beside_the_model_drafts_at_its_own_length(
    target_model: Path, draft_model: Path
) -> None:
    """Each drafter's rounds take their length from that drafter's policy: copied text
    is accepted far longer than a model's guesses. (After a while this target's greedy
    text loops, and the lookup takes over.)"""
    with open_engine(target_model, draft_model, 1) as engine:
        lookup_then_model = engine.make_decoder("model+ngram", "1").drafter
        decoder = Decoder(
            engine.target,
            lookup_then_model,
            GREEDY,
            FixedLength(1),
            lengths={"ngram": FixedLength(4)},
        )
        out, stats = generate(engine, n_predict=200, decoder=decoder)
    assert out == target_only(target_model, n_predict=200)
    assert stats.proposed_by["model"] > 0 and stats.proposed_by["ngram"] > 0
    assert max(stats.draft_lengths) > 1  # only the lookup's rounds can draft more than 1


def test_alone_the_first_token_comes_with_the_prompt(
    target_model: Path, draft_model: Path, fixture_reference: list[int]
) -> None:
    """A generation alone reads the end of its prompt as its first round, undrafted, as
    beside other slots: its first token comes in the call that reads the prompt (as
    llama-server samples it), not a round later, after the drafter has read the prompt
    and a draft has been verified."""
    with open_engine(target_model, draft_model, 4) as engine:
        generation = engine.decoder.start(
            engine.tokenize(PROMPT), 64, np.random.default_rng(0), Stats()
        )
        calls = engine.target.decode_calls
        draft_calls = engine.decoder.drafter.ctx.decode_calls
        step([generation])
        assert engine.target.decode_calls == calls + 1
        assert engine.decoder.drafter.ctx.decode_calls == draft_calls
        assert generation.round is not None and generation.round.n_drafted == 0
        out = list(generation.round.tokens)
        assert len(out) == 1
        while not generation.finished:
            step([generation])
            out += generation.round.tokens
        generation.close()
        stats = generation.stats
        assert stats.drafted > 0
        # its time is the prompt's: the rates leave it out
        assert stats.with_prompt == 1 and stats.timed_tokens == len(out) - 1
    assert out == fixture_reference


def test_the_model_drafts_where_a_preferred_lookup_declines(
    target_model: Path, draft_model: Path
) -> None:
    """Who may draft is asked in order: where the lookup is the better guesser (this
    target's text loops) but its own policy drafts nothing, the model's turn comes.
    Before, those rounds went undrafted."""
    with open_engine(target_model, draft_model, 2) as engine:
        decoder = Decoder(
            engine.target,
            engine.make_decoder("model+ngram", "2").drafter,
            GREEDY,
            FixedLength(2),
            lengths={"ngram": FixedLength(0)},
        )
        out, stats = generate(engine, n_predict=200, decoder=decoder)
    assert out == target_only(target_model, n_predict=200)
    assert stats.proposed_by["ngram"] == 0 < stats.proposed_by["model"]
    # only the first round (read with the prompt's end) and the last (room for one token)
    assert stats.draft_lengths[0] <= 2


def test_auto_gives_a_lookup_beside_the_model_its_own_policy(
    target_model: Path, draft_model: Path
) -> None:
    """Priced as it costs: a lookup needs no draft model's calls."""
    with open_engine(target_model, draft_model, "auto") as engine:
        decoder = engine.make_decoder("model+ngram", "auto")
        model_length, lookup_length = decoder.length, decoder.lengths["ngram"]
        assert isinstance(model_length, AutoLength) and isinstance(lookup_length, AutoLength)
        assert lookup_length is not model_length
        assert lookup_length.costs.draft_seconds == 0.0 < model_length.costs.draft_seconds
        assert engine.make_decoder("model", "auto").lengths == {}


def test_auto_gives_verbatim_repeats_a_policy_that_starts_trusted(
    target_model: Path, draft_model: Path
) -> None:
    with open_engine(target_model, draft_model, "auto") as engine:
        for kind in ("ngram", "model+ngram"):
            verbatim = engine.make_decoder(kind, "auto").lengths[NgramDrafter.VERBATIM_SOURCE]
            assert isinstance(verbatim, AutoLength)
            assert verbatim.positions.prior == VERBATIM_PRIOR > AutoLength.PRIOR
            assert verbatim.costs.draft_seconds == 0.0
        assert engine.make_decoder("model+ngram", "3").lengths == {}


def test_verbatim_repeats_are_drafted_long(
    stories260k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the list prompt stories260K's greedy text goes round a loop ("It is a shiny
    camera."). Where verification is cheap, -k auto drafts the loop with the verbatim
    policy, past the end of the text and longer than the lookup's own policy dares,
    and the text is the target's own."""
    pin_costs(monkeypatch, Costs(1e-4, 0.05, {n: 1.0 + 0.05 * (n - 1) for n in range(1, 66)}))
    with open_engine(stories260k, n_ctx=512) as engine:
        prompt = engine.tokenize(BUILTIN_PROMPTS["list"])
        reference, _ = generate(engine, 200, prompt=prompt)
    with open_engine(stories260k, "ngram", "auto", n_ctx=512) as engine:
        decoder = engine.make_decoder("ngram", "auto")
        out, _ = generate(engine, 200, decoder=decoder, prompt=prompt)
    assert out == reference
    verbatim, lookup = decoder.lengths[NgramDrafter.VERBATIM_SOURCE], decoder.length
    assert isinstance(verbatim, AutoLength) and isinstance(lookup, AutoLength)
    # A position's weight grows from 0 only in rounds that test it.
    longest = max(i for i, w in enumerate(verbatim.positions.weight) if w)
    assert longest >= 12 and not any(lookup.positions.weight[longest:])


@pytest.mark.parametrize("own_draft", [False, True], ids=["test draft", "target as draft"])
def test_the_lookup_drafts_beside_a_model_that_does_not_pay(
    own_draft: bool, target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine where the draft model costs nearly what the target does, -k auto
    drafts with the model only to probe; the lookup, which costs nothing to draft, must
    still take the copied stretches (this target's greedy text loops after a while).
    The lookup once drafted nothing here: its guesses were scored only in drafted
    rounds; and where the model was the better guesser (the target as its own draft,
    always right), it drafted only in the rounds the lookup was preferred, none."""
    costly_model = Costs(1e-4, 0.9, {n: 1.0 + 0.5 * (n - 1) for n in range(1, 18)}, 0.1)
    pin_costs(monkeypatch, costly_model)
    with open_engine(target_model, target_model if own_draft else draft_model, "auto") as engine:
        out, stats = generate(
            engine, n_predict=200, decoder=engine.make_decoder("model+ngram", "auto")
        )
    assert out == target_only(target_model, n_predict=200)
    assert stats.proposed_by["model"] > 0  # its probes
    assert stats.proposed_by["ngram"] > 0
    assert stats.target_passes < 0.8 * len(out)


@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_ngram_draft(target_model: Path, fixture_reference, k: int) -> None:
    with open_engine(target_model, "ngram", k) as engine:
        out, _ = generate(engine)
    assert out == fixture_reference


@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_stories260k(stories260k: Path, stories_reference, k: int) -> None:
    for draft in (stories260k, "ngram"):
        with open_engine(stories260k, draft, k) as engine:
            out, stats = generate(engine, n_predict=128)
        assert out == stories_reference
        # -k auto learns the time of a round from the clock (the costs are pinned, the
        # machine's speed is not): on a loaded machine it may draft no more than its
        # probes, which can all miss; a fixed k drafts every round.
        assert stats.accepted > 0 if k != "auto" else stats.drafted > 0


def test_drafts_longer_than_a_batch_are_cut_to_one(stories260k: Path) -> None:
    """A copy prompt makes the lookup draft hundreds of tokens: each round must still
    verify in one decode call, or the rows of the earlier chunks are lost."""
    n_batch = 64
    with open_engine(stories260k, n_ctx=1024, n_batch=n_batch) as engine:
        story = engine.tokenize(PROMPT) + generate(engine, n_predict=300)[0]
    copy_prompt = [*story, *story[1:20]]  # the story again, cut short: copy the rest
    results = []
    for draft, k in ((None, 1), ("ngram", 600)):
        with open_engine(stories260k, draft, k, n_ctx=1024, n_batch=n_batch) as engine:
            stats = Stats()
            out: list[int] = []
            for new in engine.decoder.generate(copy_prompt, 200, np.random.default_rng(0), stats):
                out += new.tokens
            results.append((out, stats))
            warnings = engine.warnings
    (reference, _), (speculative, stats) = results
    assert speculative == reference
    assert max(stats.draft_lengths) == n_batch - 1  # it drafted as far as a batch allows
    assert warnings == [
        "-k 600 is more than one batch can verify; drafts stop at 63 tokens "
        "(raise -b to allow more)"
    ]


class WrongDrafter:
    """Proposes k tokens that differ from the known target output: nothing is accepted."""

    name = "wrong"
    ctx = None

    def __init__(self, reference: list[int], n_prompt: int, n_vocab: int) -> None:
        self.reference, self.n_prompt, self.n_vocab = reference, n_prompt, n_vocab

    def begin(self, prompt: list[int], sampling=None, noise=None, media=None) -> None:
        pass

    def drafting(self, request: DraftRequest) -> DraftSteps:
        yield from ()
        at = len(request.tokens) - self.n_prompt
        return Draft([(self.reference[at] + 1) % self.n_vocab] * request.k, source=self.name)


def test_nothing_accepted(target_model: Path, fixture_reference) -> None:
    with open_engine(target_model) as engine:
        drafter = WrongDrafter(
            fixture_reference, len(engine.tokenize(PROMPT)), engine.model.n_vocab
        )
        decoder = Decoder(engine.target, drafter, GREEDY, FixedLength(3))
        out, stats = generate(engine, decoder=decoder)
    assert out == fixture_reference
    assert stats.accepted == 0 and stats.drafted > 0
    assert stats.tokens_per_pass == 1.0


@pytest.mark.parametrize("draft_kind", ["self", "small"])
def test_eos_inside_an_accepted_draft(
    model_pair_factory, fixture_reference, draft_kind: str
) -> None:
    # Make EOS a token greedy decoding produces at a position that k=8 drafts cover.
    k = 8
    position = next(
        i
        for i in range(3, 40)
        if i % (k + 1) != k and fixture_reference[i] not in fixture_reference[:i]
    )
    eos = fixture_reference[position]
    target, small = model_pair_factory(eos)
    with open_engine(target, target if draft_kind == "self" else small, k) as engine:
        out, stats = generate(engine)
    assert out == fixture_reference[:position]
    assert stats.stop_reason == "eos"
    if draft_kind == "self":
        assert stats.accepted >= position  # the EOS came out of an accepted draft
    with open_engine(target) as engine:
        alone, alone_stats = generate(engine)
    assert alone == out
    # The pass that chose the EOS chose a token too: the target alone makes one a pass.
    assert alone_stats.tokens_per_pass == 1.0


@pytest.mark.parametrize("k", [1, 8])
def test_context_full(target_model: Path, draft_model: Path, k: int) -> None:
    n_ctx = 48
    reference = target_only(target_model, n_predict=1000, n_ctx=n_ctx)
    with open_engine(target_model, draft_model, k, n_ctx=n_ctx) as engine:
        out, stats = generate(engine, n_predict=1000)
        n_prompt = len(engine.tokenize(PROMPT))
    assert stats.stop_reason == "context"
    assert n_prompt + len(out) == n_ctx
    assert out == reference


def test_length_limit_is_exact(target_model: Path, fixture_reference) -> None:
    with open_engine(target_model, target_model, 8) as engine:
        out, stats = generate(engine, n_predict=13)
    assert out == fixture_reference[:13]
    assert stats.stop_reason == "length" and stats.tokens == 13


def test_generations_reuse_the_engine(
    target_model: Path, draft_model: Path, fixture_reference
) -> None:
    """A second generation starts from a clean cache in both models."""
    with open_engine(target_model, draft_model, 4) as engine:
        first, _ = generate(engine, n_predict=30)
        second, _ = generate(engine, n_predict=64)
    assert first == fixture_reference[:30]
    assert second == fixture_reference


def continue_chat(engine: Engine, turns: int = 3) -> list[tuple[list[int], list[int], Stats]]:
    """A conversation of a few turns, each prompt the whole history plus a new line:
    each turn's prompt, output and stats."""
    history = engine.tokenize(PROMPT)
    turns_seen = []
    for _ in range(turns):
        stats = Stats()
        out: list[int] = []
        for new in engine.decoder.generate(history, 16, np.random.default_rng(0), stats):
            out += new.tokens
        turns_seen.append((history, out, stats))
        history = [*history, *out, *engine.tokenize(" and then")[1:]]
    return turns_seen


def test_next_turn_reuses_the_cached_history(target_model: Path, draft_model: Path) -> None:
    """A follow-up prompt that starts with the last one evaluates only what is new,
    and generates what a fresh engine generates."""
    with open_engine(target_model, draft_model, 3) as engine:
        turns = continue_chat(engine)
    assert turns[0][2].prompt_reused == 0
    for (_, out, previous), (_, _, stats) in itertools.pairwise(turns):
        assert stats.prompt_reused >= previous.prompt_tokens + len(out) - 2
    for prompt, out, _ in turns[1:]:
        with open_engine(target_model, draft_model, 3) as engine:
            stats = Stats()
            fresh = [
                t
                for new in engine.decoder.generate(prompt, 16, np.random.default_rng(0), stats)
                for t in new.tokens
            ]
        assert fresh == out


SAMPLING = SamplingParams(temp=1.0, top_k=20, top_p=0.95, min_p=0.0)
N_RUNS = 2500
N_FIRST = 3
# Repeats itself, so that n-gram lookup has something to propose from the start.
REPEATING_PROMPT = "the cat ran to the dog and the cat ran to the"


def first_tokens(
    engine: Engine,
    seeds: range,
    decoder: Decoder | None = None,
    n_predict: int = N_FIRST,
    n_first: int = N_FIRST,
) -> np.ndarray:
    """The first `n_first` tokens of a generation of `n_predict` for each seed (longer
    generations draft wider: a tree needs room for more tokens than its depth; and
    deeper: a round drafts k deep only where k + 1 tokens are still to come)."""
    prompt = engine.tokenize(REPEATING_PROMPT)
    rows = []
    for seed in seeds:
        out: list[int] = []
        rng = np.random.default_rng(seed)
        for new in (decoder or engine.decoder).generate(prompt, n_predict, rng, Stats()):
            out += new.tokens
        rows.append(out[:n_first])
    return np.array(rows)


COUPLED = replace(SAMPLING, coupled=True)


@pytest.mark.usefixtures("moderate_costs")
def test_a_coupled_text_is_the_same_whatever_the_draft(
    target_model: Path, draft_model: Path, fixture_reference: list[int]
) -> None:
    """Coupled sampling fixes each position's draw before anything is drafted: for a
    seed, every drafter, length and tree gives the target-only text, and drafts are
    still taken. The controls: another seed, or rejection sampling, gives another text."""
    with open_engine(target_model, sampling=COUPLED) as engine:
        references = [generate(engine, 48, seed)[0] for seed in (1, 2)]
    assert references[0] != references[1] and fixture_reference[:48] not in references
    with open_engine(target_model, draft_model, 4, COUPLED) as engine:
        for drafter, k, tree in [
            ("model", "4", "off"),
            ("model", "auto", "auto"),
            ("model", "2", "12"),
            ("ngram", "3", "8"),
            ("model+ngram", "auto", "off"),
        ]:
            decoder = engine.make_decoder(drafter, k, tree)
            for seed, reference in zip((1, 2), references, strict=True):
                out, stats = generate(engine, 48, seed, decoder)
                assert out == reference, (drafter, k, tree, seed)
                assert stats.accepted > 0
        rejection = generate(engine, 48, 1, sampling=SAMPLING)[0]
    assert rejection != references[0]


def test_sampling_seeded_runs_are_reproducible(target_model: Path, draft_model: Path) -> None:
    with open_engine(target_model, draft_model, 4, SAMPLING) as engine:
        a, b = generate(engine, 40, seed=11)[0], generate(engine, 40, seed=11)[0]
        c = generate(engine, 40, seed=12)[0]
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("sampling", "timed"), [(SAMPLING, False), (GREEDY, True), (COUPLED, True)]
)
def test_only_invariant_rounds_are_timed_for_auto(
    target_model: Path, draft_model: Path, sampling: SamplingParams, timed: bool
) -> None:
    """-k auto must not follow the clock when rejection sampling (k decides which
    random numbers each token uses: a seed would no longer reproduce the text); greedy
    and coupled texts are the same whatever k, so there it may."""
    with open_engine(target_model, draft_model, "auto", sampling) as engine:
        decoder = engine.make_decoder("model", "auto")
        seen: list[tuple[float | None, ...]] = []
        observe = decoder.length.observe

        def record(draft: Draft, accepted: int, *seconds: float | None, **kw: Any) -> None:
            seen.append((*seconds, kw["rollback_seconds"]))
            observe(draft, accepted, *seconds, **kw)

        decoder.length.observe = record  # type: ignore[method-assign]
        generate(engine, 24, decoder=decoder)
    assert seen
    assert all(len(seconds) == 4 for seconds in seen)  # drafting, verifying, the rest, undoing
    assert all((None not in seconds) == timed for seconds in seen)


@pytest.fixture(scope="module")
def sampled_baseline(target_model: Path) -> np.ndarray:
    with open_engine(target_model, sampling=SAMPLING) as engine:
        return first_tokens(engine, range(N_RUNS))


@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize(
    ("drafter", "k", "tree", "sampling"),
    [
        ("model", "4", "off", SAMPLING),
        ("model", "auto", "off", SAMPLING),
        ("ngram", "3", "off", SAMPLING),
        ("ngram", "auto", "off", SAMPLING),
        ("model+ngram", "3", "off", SAMPLING),
        ("model", "3", "8", SAMPLING),  # sampled first children, point-mass alternatives
        ("model", "2", "12", SAMPLING),
        ("ngram", "3", "8", SAMPLING),  # several earlier continuations
        ("model", "4", "off", COUPLED),
        ("model", "2", "12", COUPLED),
    ],
)
def test_sampling_matches_target_distribution(
    target_model: Path,
    draft_model: Path,
    sampled_baseline: np.ndarray,
    drafter: str,
    k: str,
    tree: str,
    sampling: SamplingParams,
) -> None:
    """The first tokens of thousands of seeded runs: speculative vs target-only (by
    rejection sampling, which coupled sampling must match too)."""
    # Lookups from 1-gram matches: the most branches and the most misses, the verifier's
    # hardest case (exact for any --ngram-min).
    with open_engine(target_model, draft_model, 4, sampling, tree=tree, ngram_min=1) as engine:
        decoder = engine.make_decoder(drafter, k)
        speculative = first_tokens(engine, range(N_RUNS, 2 * N_RUNS), decoder)
        stats = Stats()
        for _ in decoder.generate(
            engine.tokenize(REPEATING_PROMPT), 64, np.random.default_rng(0), stats
        ):
            pass
    assert 0.0 < stats.acceptance_rate < 1.0  # drafts were made, some kept, some not
    if tree != "off":  # and the tree's branches were kept where a chain had missed
        assert stats.accepted_beside > 0
    for position in range(N_FIRST):
        table = contingency(sampled_baseline[:, position], speculative[:, position])
        assert table.shape[1] > 3  # a real distribution, not one forced token
        assert chi2_contingency(table).pvalue > 1e-3, f"token {position} differs"


def contingency(a: np.ndarray, b: np.ndarray, min_count: int = 5) -> np.ndarray:
    """Counts per token for two samples, rare tokens pooled so chi-square is valid."""
    tokens = np.union1d(a, b)
    table = np.array([[np.sum(x == t) for t in tokens] for x in (a, b)])
    common = table.sum(axis=0) >= min_count
    pooled = table[:, ~common].sum(axis=1, keepdims=True)
    return np.hstack([table[:, common], pooled]) if pooled.any() else table[:, common]


def test_matches_llama_cpp_python_greedy(stories260k: Path) -> None:
    """An outside reference: llama-cpp-python's own high-level greedy completion."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(stories260k), n_ctx=256, n_threads=1, verbose=False)
    reference = llm.create_completion(PROMPT, max_tokens=64, temperature=0.0)["choices"][0]
    with open_engine(stories260k, stories260k, 4) as engine:
        pieces = engine.pieces(engine.tokenize(PROMPT), 64, np.random.default_rng(0), Stats())
        text = "".join(p.text for p in pieces)
    assert text == reference["text"]


def llama_cpp_greedy(path: Path, prompt: list[int], n: int, flash_attn: str) -> list[int]:
    """llama-cpp-python's own high-level greedy generation (Llama.generate at temp 0), n
    tokens. Its Llama takes no --no-repack: where specdec finds repacked weights unsafe
    (quantized models crash on some AMX CPUs, see specdec_cli.llamacpp.probe), its
    default model parameters are patched to load without them, as specdec loads."""
    import llama_cpp

    with pytest.MonkeyPatch.context() as patch:
        if not choose_repack(None)[0]:
            default = llama_cpp.llama_cpp.llama_model_default_params

            def without_repack() -> llama_cpp.llama_model_params:
                params = default()
                params.use_extra_bufts = False
                return params

            patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", without_repack)
        llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=256, n_threads=1, flash_attn=flash_attn == "on",
            verbose=False,
        )  # fmt: skip
    try:
        return list(itertools.islice(llm.generate(prompt, temp=0.0), n))
    finally:
        llm.close()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("model", ["target_model", "q8_pair", "mamba_pair", "hybrid_pair"])
def test_target_only_matches_llama_cpp_python_greedy(
    request: pytest.FixtureRequest, model: str, flash_attn: str
) -> None:
    """F32 and Q8_0 llama, Mamba and LFM2 (hybrid): token for token, same -fa."""
    path = request.getfixturevalue(model)
    target = path[0] if isinstance(path, tuple) else path
    with open_engine(target, flash_attn=flash_attn) as engine:
        prompt = engine.tokenize(PROMPT)
        out, _ = generate(engine, 40)
    assert out == llama_cpp_greedy(target, prompt, 40, flash_attn)


def test_draft_p_min_cuts_drafts_short_and_stays_lossless(
    target_model: Path, draft_model: Path, fixture_reference
) -> None:
    options = EngineOptions(
        target=target_model,
        draft=draft_model,
        n_ctx=256,
        threads=1,
        sampling=GREEDY,
        drafting=DraftOptions(k="6", p_min=0.6),
    )
    with Engine(options) as engine:
        out, stats = generate(engine)
    assert out == fixture_reference
    short = sum(n for k, n in stats.draft_lengths.items() if 0 < k < 6)
    assert short > 2  # cut short by the draft's doubt, not just by the end of -n
    # never empty, but for the first round (read with the prompt's end) and a last round
    # at the -n limit
    assert stats.draft_lengths[0] <= 2


def test_draft_with_a_larger_vocabulary(
    tmp_path: Path, vocab: Vocab, target_model: Path, fixture_reference: list[int]
) -> None:
    """llama.cpp pairs vocabularies up to 128 tokens apart. This draft's extra tokens copy
    the target's favourite tokens at triple strength, so it prefers them; the target does
    not have them, so they must never be proposed (llama_decode refuses unknown ids)."""
    favourites = sorted(set(fixture_reference))
    extra = Vocab(
        vocab.tokens + [f"extra{i}" for i in range(len(favourites))],
        vocab.scores + [0.0] * len(favourites),
        vocab.types + [int(TokenType.NORMAL)] * len(favourites),
    )
    tensors = pad_rows(first_layers(target_tensors(vocab), DRAFT_LAYERS), len(favourites))
    tensors["token_embd.weight"][len(vocab) :] = tensors["token_embd.weight"][favourites]
    tensors["output.weight"][len(vocab) :] = 3 * tensors["output.weight"][favourites]
    draft = write_gguf(tmp_path / "draft.gguf", llama_metadata(DRAFT_HPARAMS, extra), tensors)
    with open_engine(target_model, draft) as engine:
        assert any("extra draft tokens are real tokens" in w for w in engine.warnings)
        out, stats = generate(engine)
    assert out == fixture_reference
    assert stats.accepted > 0


QWEN2_VOCAB = 151_936


@pytest.fixture(scope="module")
def real_vocab_pair(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> tuple[Path, Path]:
    """The test pair with its vocabulary padded to Qwen2's 151,936 tokens, every output
    row random: rows of logits the size and spread of a random-weight real model's."""
    big = padded(vocab, QWEN2_VOCAB - len(vocab))
    n_weak = TARGET_HPARAMS.n_layer - DRAFT_LAYERS
    tensors = llama_tensors(TARGET_HPARAMS, big, SEED, n_weak, WEAK_SCALE)
    folder = tmp_path_factory.mktemp("real-vocab")
    return (
        write_gguf(folder / "target.gguf", llama_metadata(TARGET_HPARAMS, big), tensors),
        write_gguf(
            folder / "draft.gguf",
            llama_metadata(DRAFT_HPARAMS, big),
            first_layers(tensors, DRAFT_LAYERS),
        ),
    )


def test_sampling_over_a_whole_real_vocabulary(real_vocab_pair: tuple[Path, Path]) -> None:
    """Every filter off at 151,936 tokens, so draft and target distributions span the
    vocabulary: the first token of many speculative rounds follows the target's own
    distribution after the prompt."""
    target, draft = real_vocab_pair
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    options = EngineOptions(
        target,
        draft,
        n_ctx=64,
        threads=1,
        sampling=params,
        flash_attn="off",
        drafting=DraftOptions(k="3"),
    )
    with Engine(replace(options, draft=None)) as engine:
        prompt = engine.tokenize(PROMPT)
        engine.target.decode(prompt, 0)
        p = distribution(engine.target.logits(0), params)
    n_runs = 250
    firsts, rejected = [], 0
    with Engine(options) as engine:
        for seed in range(n_runs):
            stats = Stats()
            rounds = engine.decoder.generate(prompt, 4, np.random.default_rng(seed), stats)
            firsts.append(next(rounds).tokens[0])
            rounds.close()
            rejected += stats.accepted < stats.drafted
    assert 0 < rejected < n_runs  # both the acceptance and the residual were used
    # The tokens expected at least 5 times one by one, the rest pooled. (Drawing from the
    # draft's distribution instead would fail this: it puts 0.14 where p has 0.04.)
    likely = np.flatnonzero(p.probs * n_runs >= 5)
    counts = [np.sum(np.equal(firsts, t)) for t in likely]
    counts.append(len(firsts) - sum(counts))
    expected = np.append(p.probs[likely], 0.0).astype(np.float64)
    expected[-1] = 1.0 - expected.sum()
    assert len(likely) >= 3 and chisquare(counts, expected * n_runs).pvalue > 1e-3
