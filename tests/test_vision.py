"""Speculation with images, exact beside every drafter: on the test models whose answer
depends on the image (mtmdgen: a red image is answered "red" and that word's successors, a
blue one "blue"), greedy speculative text and its log-probabilities equal the target's
alone for the lookup, a draft model fed the text alone (the target's own file, without the
image), both, trees and -k auto, in one slot and beside three others; the positions after
an image are llama.cpp's own (M-RoPE's are not the token count); a chat's second turn
decodes its image from the cache; sampled text follows the target's distribution."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
import pytest
from mtmdgen import (
    COLORS,
    VisionPair,
    png,
    write_mlp_projector,
    write_vision_pair,
)
from scipy.stats import chi2_contingency
from test_decode import contingency

from specdec_cli.decoding import loading
from specdec_cli.decoding.decode import step
from specdec_cli.decoding.engine import NO_PROJECTOR, Engine
from specdec_cli.decoding.generation import Round
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.logprobs import LogprobOptions
from specdec_cli.decoding.multimodal import Encodings, MediaPrompt
from specdec_cli.decoding.pieces import PieceStream
from specdec_cli.decoding.promptcache import PromptCache
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.scheduler import Scheduler, Task
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.media import Media, media_from_bytes
from specdec_cli.llamacpp.model import Model
from specdec_cli.llamacpp.mtmd import Projector
from specdec_cli.models.chat import Message

QUESTION = "What colour is it?"
MARKER = "<__media__>"
N = 12  # tokens generated
N_CTX = 256  # a slot's
LOGPROBS = LogprobOptions(top=3)
# Every drafter, as (kind, -k, --tree): a draft model here is the target's own file,
# loaded without its projector (it drafts from the text alone).
DRAFTERS = [
    ("ngram", "3", "off"),
    ("model", "3", "off"),
    ("model+ngram", "4", "off"),
    ("model", "3", "6"),
    ("model", "auto", "auto"),
    ("model+ngram", "auto", "off"),
]


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    folder = tmp_path_factory.mktemp(request.param)
    return write_vision_pair(folder, mrope=request.param == "qwen2vl")


def engine_options(pair: VisionPair, parallel: int = 1, **changes: object) -> EngineOptions:
    options = EngineOptions(
        pair.target,
        draft=pair.target,
        mmproj=pair.mmproj,
        n_ctx=N_CTX * parallel,
        threads=1,
        flash_attn="off",
        parallel=parallel,
        sampling=GREEDY,
        # 1-gram matches: twelve tokens of a toy answer repeat no two for the lookup to find
        drafting=DraftOptions(k="3", tree="8", ngram_min=1),
    )
    return replace(options, **changes)


@pytest.fixture(scope="module")
def engine(pair: VisionPair) -> Iterator[Engine]:
    with Engine(engine_options(pair)) as engine:
        yield engine


def image(colour: str) -> Media:
    return media_from_bytes(png(16, 16, COLORS[colour]), f"{colour}.png")


def prompt_for(engine: Engine, colours: list[str], history: list[Message] = ()) -> MediaPrompt:
    """The chat asking about images of those colours (none: no image), after `history`."""
    question = Message("user", MARKER * len(colours) + QUESTION)
    text = engine.chat_text([*history, question])
    return engine.media_prompt(text, [image(c) for c in colours])


def generate(
    engine: Engine,
    prompt: MediaPrompt,
    kind: str | None = None,
    k: str = "3",
    tree: str = "off",
    n: int = N,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    grammar: Grammar | None = None,
) -> tuple[list[int], list[float], Stats]:
    """n tokens by the drafter `kind` (None: the target alone), with their logprobs."""
    decoder = engine.make_decoder(kind, k, tree)
    stats = Stats()
    rounds = decoder.generate(
        prompt.tokens,
        n,
        np.random.default_rng(seed),
        stats,
        sampling,
        LOGPROBS,
        grammar,
        media=prompt.media,
    )
    done: list[Round] = list(rounds)
    tokens = [t for r in done for t in r.tokens]
    logprobs = [lp.logprob for r in done for lp in r.logprobs or ()]
    return tokens, logprobs, stats


@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("colour", ["red", None])
def test_every_drafter_writes_what_the_target_alone_writes(
    engine: Engine, pair: VisionPair, colour: str | None
) -> None:
    """The image decides the answer (the test models' tables say what), and every drafter
    writes it, with the same log-probabilities, though none of them saw the image: the
    draft model's first guess after it is the text's default, and is rejected."""
    with prompt_for(engine, [colour] if colour else []) as prompt:
        alone, alone_logprobs, _ = generate(engine, prompt)
        assert alone == pair.greedy(colour, N)
        for kind, k, tree in DRAFTERS:
            tokens, logprobs, stats = generate(engine, prompt, kind, k, tree)
            assert tokens == alone, (kind, k, tree)
            np.testing.assert_allclose(logprobs, alone_logprobs, atol=1e-4)
            assert stats.drafted > 0, (kind, k, tree)
            if kind.startswith("model"):  # beside an image, its first guess misses
                assert 0 < stats.accepted < stats.drafted or not colour


def reference_logits(
    pair: VisionPair, text: str, media: list[Media], tokens: list[int]
) -> list[np.ndarray]:
    """llama.cpp's own way through the prompt (mtmd_helper_eval_chunks), then `tokens`
    one at a time at the positions after it: the logits before each token."""
    model = Model(pair.target)
    ctx = Context(model, ContextParams(n_ctx=N_CTX, n_threads=1, flash_attn="off"))
    projector = Projector(pair.mmproj, model, n_threads=1, flash_attn="off")
    batch = llama_cpp.llama_batch_init(1, 0, 1)

    def last_logits() -> np.ndarray:
        row = llama_cpp.llama_get_logits_ith(ctx.ptr, -1)
        return np.ctypeslib.as_array(row, shape=(model.n_vocab,)).copy()

    try:
        with projector.tokenize(text, media) as prompt:
            pos = projector.eval_chunks(ctx.ptr, prompt, 0, 0, N_CTX)
        rows = [last_logits()]
        for token in tokens[:-1]:
            batch.n_tokens, batch.token[0], batch.pos[0] = 1, token, pos
            batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 0, True
            assert llama_cpp.llama_decode(ctx.ptr, batch) == 0
            rows.append(last_logits())
            pos += 1
    finally:
        llama_cpp.llama_batch_free(batch)
        projector.close()
        ctx.close()
        model.close()
    return rows


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_positions_after_the_image_are_llama_cpps(engine: Engine, pair: VisionPair) -> None:
    """The target's log-probabilities after an image, speculating, are those of llama.cpp's
    own prompt evaluation followed by one token at a time: under M-RoPE the text goes on
    from the image's n_pos, not its token count (a wrong position moves every logit, see
    test_mtmd's test_a_wrong_position_shows_in_the_logits)."""
    text = engine.chat_text([Message("user", MARKER + QUESTION)])
    with engine.media_prompt(text, [image("blue")]) as prompt:
        tokens, logprobs, _ = generate(engine, prompt, "model", "3", "6")
    logits = reference_logits(pair, text, [image("blue")], tokens)
    expected = [log_softmax(row)[t] for row, t in zip(logits, tokens, strict=True)]
    np.testing.assert_allclose(logprobs, expected, atol=1e-4)


def test_a_wrong_image_changes_every_token(engine: Engine) -> None:
    answers = []
    for colour in ("red", "blue"):
        with prompt_for(engine, [colour]) as prompt:
            answers.append(generate(engine, prompt, "model+ngram", "4")[0])
    assert all(r != b for r, b in zip(*answers, strict=True))


def test_two_images_of_one_prompt(engine: Engine, pair: VisionPair) -> None:
    """Two images, the same one twice: both decoded, encoded once; the answer is the
    image's colour."""
    before = engine.encodings.encoded
    with prompt_for(engine, ["blue", "blue"]) as prompt:
        tokens, _, stats = generate(engine, prompt, "model", "3")
    assert tokens == pair.greedy("blue", N)
    assert stats.prompt_tokens == len(prompt.tokens)
    assert engine.encodings.encoded - before <= 1  # none, where an earlier test encoded it


def test_slots_with_images_and_without(pair: VisionPair) -> None:
    """Four slots, drafting by the model and the lookup, trees: a red image, none, a blue
    one and red again, all verified in the same decode calls, each answered by its own
    (the image cells of one slot are no other's)."""
    colours = ["red", None, "blue", "red"]
    with Engine(engine_options(pair, parallel=4)) as engine:
        prompts = [prompt_for(engine, [c] if c else []) for c in colours]
        texts, stats = in_slots(engine, prompts, N)
    assert texts == [pair.greedy(c, N) for c in colours]
    assert sum(s.accepted for s in stats) > 0


def in_slots(
    engine: Engine, prompts: list[MediaPrompt], n: int
) -> tuple[list[list[int]], list[Stats]]:
    """Each prompt's n tokens in a slot of its own (greedy), all verified in the same
    decode calls; the prompts are closed after."""
    generations = [
        decoder.start(p.tokens, n, np.random.default_rng(0), Stats(), media=p.media)
        for decoder, p in zip(engine.decoders, prompts, strict=True)
    ]
    texts: list[list[int]] = [[] for _ in prompts]
    while running := [i for i, g in enumerate(generations) if not g.finished]:
        step([generations[i] for i in running])
        for i in running:
            texts[i] += generations[i].round.tokens if generations[i].round else []
    for g, p in zip(generations, prompts, strict=True):
        g.close()
        p.close()
    return texts, [g.stats for g in generations]


def second_turn(engine: Engine, answer: list[int]) -> MediaPrompt:
    """The conversation's second turn: the red image and the question, the answer, and
    another question."""
    reply = b"".join(engine.model.piece(t) for t in answer).decode()
    history = [Message("user", MARKER + QUESTION), Message("assistant", reply.strip())]
    text = engine.chat_text([*history, Message("user", "And now?")])
    return engine.media_prompt(text, [image("red")])


def run_in(
    scheduler: Scheduler, engine: Engine, prompt: MediaPrompt
) -> tuple[list[int], list[float], Stats]:
    """A generation placed by the scheduler (its slot's cache, or the prompt cache)."""
    slot = scheduler.claim(prompt.tokens)
    assert slot is not None
    stats = Stats()
    decoder = engine.decoders[slot.index]
    generation = decoder.start(
        prompt.tokens, N, np.random.default_rng(0), stats, logprobs=LOGPROBS, media=prompt.media
    )
    task = Task(generation, PieceStream(engine.model), lambda piece: None, lambda s, e: None, bool)
    scheduler.start(slot, task)
    tokens, logprobs = [], []
    while scheduler.busy:
        scheduler.step()
        if generation.round:
            tokens += generation.round.tokens
            logprobs += [lp.logprob for lp in generation.round.logprobs or ()]
    return tokens, logprobs, stats


@pytest.mark.parametrize("between", [None, "cached", "displaced"])
def test_a_second_turn_does_not_encode_its_image_again(
    pair: VisionPair, between: str | None
) -> None:
    """A chat's second turn after a first with a red image: its cells are kept in the slot
    (nothing in between), brought back by the prompt cache (a blue image's prompt took the
    slot in between), or decoded again (displaced, no prompt cache); never encoded again.
    Its text and log-probabilities are a fresh engine's."""
    with Engine(engine_options(pair)) as engine:
        cache = PromptCache(2**30) if between == "cached" else None
        scheduler = Scheduler(engine.slots, chunk=64, cache=cache)
        with prompt_for(engine, ["red"]) as first:
            answer, _, _ = run_in(scheduler, engine, first)
            image_end = first.tokens.index(min(first.tokens)) + pair.n_image_tokens
        if between:
            with prompt_for(engine, ["blue"]) as other:
                run_in(scheduler, engine, other)
        encoded = engine.encodings.encoded
        with second_turn(engine, answer) as second:
            tokens, logprobs, stats = run_in(scheduler, engine, second)
        assert engine.encodings.encoded == encoded
    if between == "displaced":
        assert stats.prompt_reused < image_end
    else:
        assert stats.prompt_reused > image_end
    with Engine(engine_options(pair)) as fresh, second_turn(fresh, answer) as second:
        fresh_tokens, fresh_logprobs, _ = generate(fresh, second, "model+ngram", "3")
    assert tokens == fresh_tokens
    np.testing.assert_allclose(logprobs, fresh_logprobs, atol=1e-4)


@pytest.mark.parametrize("colour", ["red", "blue"])
def test_a_json_answer_about_the_picture(engine: Engine, colour: str) -> None:
    """Under a grammar for a JSON object, speculative text is the target's alone, and names
    the image's colour (the grammar allows either word; the image decides)."""
    grammar = Grammar.gbnf('root ::= "{\\"colour\\": \\"" (" red" | " blue") "\\"}"')
    with prompt_for(engine, [colour]) as prompt:
        alone, alone_logprobs, _ = generate(engine, prompt, n=40, grammar=grammar)
        tokens, logprobs, stats = generate(
            engine, prompt, "model+ngram", "3", n=40, grammar=grammar
        )
    assert tokens == alone and stats.drafted > 0
    np.testing.assert_allclose(logprobs, alone_logprobs, atol=1e-4)
    text = b"".join(engine.model.piece(t) for t in tokens).decode()
    assert json.loads(text) == {"colour": f" {colour}"}


SAMPLED = SamplingParams(temp=2.5, top_k=8, top_p=1.0, min_p=0.0)
N_RUNS = 300
N_FIRST = 3


def first_tokens(engine: Engine, prompt: MediaPrompt, kind: str | None, seeds: range) -> np.ndarray:
    return np.array(
        [generate(engine, prompt, kind, "3", n=N_FIRST, sampling=SAMPLED, seed=s)[0] for s in seeds]
    )


def test_sampled_text_after_an_image_follows_the_targets_distribution(tmp_path: Path) -> None:
    """The first tokens of seeded runs after a red image: speculative (a draft model that
    never saw the image) against the target alone, by chi-square. The negative control,
    the target without the image (what the draft alone would sample), is told apart. (One
    pair: M-RoPE's positions are checked greedy.)"""
    with (
        Engine(engine_options(write_vision_pair(tmp_path))) as engine,
        prompt_for(engine, ["red"]) as red,
        prompt_for(engine, []) as plain,
    ):
        alone = first_tokens(engine, red, None, range(N_RUNS))
        speculative = first_tokens(engine, red, "model", range(N_RUNS, 2 * N_RUNS))
        control = first_tokens(engine, plain, None, range(2 * N_RUNS, 3 * N_RUNS))
    assert_same_distribution(alone, speculative, control)


def assert_same_distribution(alone: np.ndarray, drafted: np.ndarray, control: np.ndarray) -> None:
    """Seeded runs' first tokens (a row a run): drafted ones as the target's alone at
    every position, by chi-square; the control's first tokens told apart."""
    for position in range(alone.shape[1]):
        table = contingency(alone[:, position], drafted[:, position])
        assert table.shape[1] > 2  # a real distribution, not one forced token
        assert chi2_contingency(table).pvalue > 1e-3, f"token {position} differs"
    assert chi2_contingency(contingency(alone[:, 0], control[:, 0])).pvalue < 1e-3


def test_media_cells_are_kept_whole(engine: Engine, pair: VisionPair) -> None:
    """A rewind into an image's cells drops the whole image; text decoded after it again
    goes on at llama.cpp's positions (the same logits as before)."""
    target = engine.slots[0]
    with prompt_for(engine, ["red"]) as prompt:
        start = next(i for i, t in enumerate(prompt.tokens) if t < 0)
        end = start + pair.n_image_tokens
        target.rewind(0)
        target.decode(prompt.tokens[:start], 0)
        target.decode_media(prompt.media[prompt.tokens[start]])
        target.decode(prompt.tokens[end:], end)
        before = target.logits(-1).copy()
        assert target.rewind(end - 1) == start
        target.decode_media(prompt.media[prompt.tokens[start]])
        target.decode(prompt.tokens[end:], end)
        np.testing.assert_allclose(target.logits(-1), before, atol=1e-5)
        assert target.tokens == prompt.tokens


def test_a_prompt_that_ends_with_an_image_is_refused(engine: Engine, pair: VisionPair) -> None:
    """A first token needs logits after the last prompt token, which media gives none."""
    with prompt_for(engine, ["red"]) as prompt:
        end = prompt.tokens.index(min(prompt.tokens)) + pair.n_image_tokens
        with pytest.raises(UserError) as err:
            engine.decoder.start(
                prompt.tokens[:end], N, np.random.default_rng(0), Stats(), media=prompt.media
            )
    assert "the prompt ends with an image or audio; put text after it" in str(err.value)


def test_an_image_for_a_model_without_a_projector_is_refused(pair: VisionPair) -> None:
    with Engine(engine_options(pair, mmproj=None)) as engine, pytest.raises(UserError) as err:
        engine.media_prompt(MARKER + QUESTION, [image("red")])
    assert str(err.value) == NO_PROJECTOR


def test_a_projector_for_another_model_is_refused_before_loading(
    pair: VisionPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wider = replace(pair.dims, n_embd=pair.dims.n_embd + 64)
    other, *_ = write_mlp_projector(tmp_path / "mmproj-other.gguf", wider)
    monkeypatch.setattr(loading, "Model", None)  # nothing may load
    with pytest.raises(UserError, match="it was made for another model"):
        Engine(engine_options(pair, mmproj=other))


def test_a_draft_of_another_vocabulary(pair: VisionPair, stories260k: Path) -> None:
    """stories260K's drafts, translated into the target's tokens by their text (the draft
    reads the prompt's text without the image): the target's own answer."""
    with Engine(engine_options(pair, draft=stories260k)) as engine:
        assert engine.translation is not None
        with prompt_for(engine, ["red"]) as prompt:
            alone, alone_logprobs, _ = generate(engine, prompt)
            tokens, logprobs, stats = generate(engine, prompt, "model", "3")
    assert tokens == alone == pair.greedy("red", N)
    np.testing.assert_allclose(logprobs, alone_logprobs, atol=1e-4)
    assert stats.drafted > 0


def test_encodings_keep_to_their_budget(engine: Engine, pair: VisionPair) -> None:
    """Embeddings are kept by the image's hash, the least recently used dropped past the
    budget (here one image's): an image dropped is encoded again when it comes back."""
    assert engine.encodings is not None
    with prompt_for(engine, ["red"]) as red, prompt_for(engine, ["blue"]) as blue:
        chunks = [next(iter(p.media.values())).chunk for p in (red, blue)]
        one_image = engine.encodings.embeddings(chunks[0]).nbytes
        encodings = Encodings(engine.encodings.projector, max_bytes=one_image)
        for chunk in (chunks[0], chunks[0], chunks[1], chunks[1], chunks[0]):
            encodings.embeddings(chunk)
    assert encodings.encoded == 3
