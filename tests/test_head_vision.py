"""Drafting heads beside images (headvisiongen's models: every kind of head, on a target
that reads the image through its projector): greedy speculative text and its
log-probabilities equal the target's alone, chains and trees, -k auto, one slot and
several; and since those targets' blocks ignore the image, a head drafts after an image
exactly what it drafts after the same text without one: it reads the target's states
by the target's positions (M-RoPE's included), which a head reading them by its token
count does not (its tables' decoys win). The target's states over an image's cells are
recorded for the head; sampled text after an image follows the target's distribution."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from headvisiongen import KINDS, HeadVision, image_dims, write_head_vision
from mtmdgen import COLORS, png
from test_cli_run import GREEDY as CLI_GREEDY
from test_cli_run import specdec
from test_vision import assert_same_distribution, in_slots

from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.generation import Round
from specdec_cli.decoding.logprobs import LogprobOptions
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.headbatch import HeadBatch, Rows
from specdec_cli.llamacpp.heads import HeadContext
from specdec_cli.llamacpp.media import Media, media_from_bytes
from specdec_cli.models.chat import Message

MARKER = "<__media__>"
TEXT = "Once upon a time there was a"
N = 16
LOGPROBS = LogprobOptions(top=2)
# The kinds that grow trees here (Qwen3.5's target is recurrent, chained blocks and
# DFlash draft chains).
TREES = {"eagle3", "assistant"}


def image(colour: str) -> Media:
    return media_from_bytes(png(16, 16, COLORS[colour]), f"{colour}.png")


def options(models: HeadVision, parallel: int = 1, **drafting: str) -> EngineOptions:
    return EngineOptions(
        models.target,
        draft=models.head,
        mmproj=models.mmproj,
        n_ctx=256 * parallel,
        threads=1,
        flash_attn="off",
        parallel=parallel,
        sampling=GREEDY,
        drafting=DraftOptions(**({"k": "3", "tree": "8"} | drafting)),
    )


@pytest.fixture(scope="module", params=KINDS)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HeadVision:
    return write_head_vision(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def engine(models: HeadVision) -> Iterator[Engine]:
    with Engine(options(models, tree="8" if models.kind in TREES else "off")) as engine:
        assert engine.head is not None
        yield engine


def prompt(engine: Engine, colours: list[str], text: str = TEXT) -> MediaPrompt:
    """`text` after images of those colours (none: the text alone)."""
    if not colours:
        return MediaPrompt(engine.tokenize(text))
    return engine.media_prompt(MARKER * len(colours) + text, [image(c) for c in colours])


def generate(
    engine: Engine,
    prompt: MediaPrompt,
    kind: str | None,
    k: str = "3",
    tree: str = "off",
    sampling: SamplingParams | None = None,
    seed: int = 0,
    n: int = N,
) -> tuple[list[int], list[float], Stats]:
    """n tokens drafted by `kind` (None: the target alone), with their logprobs."""
    stats = Stats()
    rounds = engine.make_decoder(kind, k, tree).generate(
        prompt.tokens, n, np.random.default_rng(seed), stats, sampling, LOGPROBS, None, prompt.media
    )
    done: list[Round] = list(rounds)
    tokens = [t for r in done for t in r.tokens]
    return tokens, [lp.logprob for r in done for lp in r.logprobs or ()], stats


def shapes(kind: str) -> list[tuple[str, str]]:
    """(-k, --tree) settings a head of this kind drafts with."""
    return [("3", "off"), ("auto", "off")] + ([("3", "8")] if kind in TREES else [])


@pytest.mark.usefixtures("moderate_costs")
def test_beside_an_image_a_head_drafts_as_without_it(engine: Engine, models: HeadVision) -> None:
    """The same text with an image before it and without: the target's own, drafted by
    the head with the same acceptance, chains and trees, fixed k and auto."""
    kind = engine.head_kind
    with prompt(engine, ["red"]) as pictured, prompt(engine, []) as plain:
        alone, alone_logprobs, _ = generate(engine, pictured, None)
        assert generate(engine, plain, None)[0] == alone  # the image changes nothing here
        for k, tree in shapes(models.kind):
            tokens, logprobs, stats = generate(engine, pictured, kind, k, tree)
            assert tokens == alone, (k, tree)
            np.testing.assert_allclose(logprobs, alone_logprobs, atol=1e-4)
            without = generate(engine, plain, kind, k, tree)[2]
            assert stats.accepted > 0, (k, tree)
            counts = (stats.drafted, stats.accepted, stats.target_passes)
            assert counts == (without.drafted, without.accepted, without.target_passes), (k, tree)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> HeadVision:
    return write_head_vision(tmp_path_factory.mktemp("eagle3-answers"), "eagle3")


def chat(engine: Engine, colour: str | None) -> MediaPrompt:
    """A chat asking what colour the image is (None: no image)."""
    question = Message("user", (MARKER if colour else "") + "What colour is it?")
    text = engine.chat_text([question])
    return engine.media_prompt(text, [image(colour)] if colour else [])


def test_slots_with_images_and_without_drafted_by_a_head(eagle3: HeadVision) -> None:
    """Four slots, an EAGLE-3 head drafting trees for each: a red image, none, a blue one
    and red again, verified in the same decode calls, each answered by its own (the
    image's colour, then its successors: the tables of mtmdgen's target)."""
    pair = eagle3.pair
    assert pair is not None
    colours = ["red", None, "blue", "red"]
    with Engine(options(eagle3, parallel=4)) as engine:
        prompts = [chat(engine, c) for c in colours]
        texts, stats = in_slots(engine, prompts, N)
    assert texts == [pair.greedy(c, N) for c in colours]
    assert all(s.accepted > 0 for s in stats)


def test_the_states_over_an_image_are_the_targets(eagle3: HeadVision) -> None:
    """After a prompt with an image, the states an EAGLE-3 head reads hold, at the
    image's positions, the target's first layer's input there (the image's embedding:
    its marker and colour), and after it each token's one-hot embedding, by position."""
    pair = eagle3.pair
    assert pair is not None
    dims = pair.dims
    with Engine(options(eagle3)) as engine, prompt(engine, ["red"]) as pictured:
        _, states = engine.head_slots[0]
        target = engine.slots[0]
        target.prefill(pictured.tokens, pictured.media)
        start = pictured.tokens.index(min(pictured.tokens))
        end = start + pair.n_image_tokens
        layer0 = states.after(start, len(pictured.tokens))[:, : dims.n_embd]
    np.testing.assert_allclose(layer0[: end - start, [dims.mark, dims.red]], 1.0)
    text = pictured.tokens[end:]
    assert list(layer0[end - start :].argmax(axis=1)) == text


def test_a_head_reads_the_targets_states_at_an_images_positions(
    eagle3: HeadVision, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The EAGLE-3 head's first call, which reads the prompt: a row at each of the
    image's positions (the target's, in order), each with the image's placeholder (a
    stand-in token goes to llama.cpp) beside its encoding of the target's state there
    (its encoder passes layer 0's input on: the image's embedding)."""
    pair = eagle3.pair
    assert pair is not None
    staged: list[Rows] = []
    stage = HeadBatch.stage

    def recorded(self: HeadBatch, slot: HeadContext, rows: Rows, **options: bool) -> None:
        staged.append(rows)
        stage(self, slot, rows, **options)

    monkeypatch.setattr(HeadBatch, "stage", recorded)
    with Engine(options(eagle3, tree="off")) as engine, prompt(engine, ["red"]) as pictured:
        generate(engine, pictured, "eagle3", n=4)
    start = pictured.tokens.index(min(pictured.tokens))
    first = staged[0]  # its rows hold the token at p + 1 at position p
    assert list(first.positions) == list(range(len(first.tokens)))
    assert len(first.tokens) >= len(pictured.tokens) - 1  # the prompt, and what followed
    image = slice(start - 1, start - 1 + pair.n_image_tokens)
    assert list(first.tokens[image]) == [min(pictured.tokens)] * pair.n_image_tokens
    assert first.hidden is not None
    np.testing.assert_allclose(first.hidden[image.start + 1 : image.stop + 1, pair.dims.mark], 1.0)


def test_the_states_over_an_m_rope_image_go_by_position(tmp_path: Path) -> None:
    """Qwen3.5 with a Qwen2-VL projector: an image of 16 cells spans 4 positions. The
    target's final states its MTP block reads are recorded a position each (the last
    cell of each row of the image's grid: its marker), then the text by its position,
    not its place."""
    models = write_head_vision(tmp_path, "mtp")
    with Engine(options(models, tree="off")) as engine, prompt(engine, ["red"]) as pictured:
        _, states = engine.head_slots[0]
        engine.slots[0].prefill(pictured.tokens, pictured.media)
        start = pictured.tokens.index(min(pictured.tokens))
        chunk = pictured.media[pictured.tokens[start]]
        assert (chunk.n_tokens, chunk.n_pos) == (16, 4)
        n_positions = len(pictured.tokens) - chunk.n_tokens + chunk.n_pos
        rows = states.after(start, n_positions)
    assert states.end == n_positions
    image_rows, text_rows = rows[: chunk.n_pos], rows[chunk.n_pos :]
    assert np.all(np.abs(image_rows[:, image_dims(rows.shape[1]).mark]) > 0.1)
    assert list(text_rows.argmax(axis=1)) == pictured.tokens[start + chunk.n_tokens :]


SAMPLED = SamplingParams(temp=2.5, top_k=8, top_p=1.0, min_p=0.0)
N_RUNS = 200
N_FIRST = 3


def first_tokens(engine: Engine, prompt: MediaPrompt, kind: str | None, seeds: range) -> np.ndarray:
    return np.array(
        [generate(engine, prompt, kind, sampling=SAMPLED, seed=s, n=N_FIRST)[0] for s in seeds]
    )


def test_sampled_text_after_an_image_drafted_by_a_head(eagle3: HeadVision) -> None:
    """The first tokens of seeded runs after a red image: drafted by an EAGLE-3 head
    against the target alone, by chi-square; the negative control, the target without
    the image, is told apart."""
    with (
        Engine(options(eagle3, tree="off")) as engine,
        chat(engine, "red") as red,
        chat(engine, None) as plain,
    ):
        alone = first_tokens(engine, red, None, range(N_RUNS))
        drafted = first_tokens(engine, red, "eagle3", range(N_RUNS, 2 * N_RUNS))
        control = first_tokens(engine, plain, None, range(2 * N_RUNS, 3 * N_RUNS))
    assert_same_distribution(alone, drafted, control)


def test_run_with_a_head_and_an_image(eagle3: HeadVision, tmp_path: Path) -> None:
    """`specdec run -d eagle3.gguf --image`: the target's own answer to the image."""
    picture = tmp_path / "blue.png"
    picture.write_bytes(png(16, 16, COLORS["blue"]))
    args = ["run", "-m", str(eagle3.target), "--mmproj", str(eagle3.mmproj), "--image"]
    args += [str(picture), "-p", "What colour is it?", "--chat", "-n", str(N), "-k", "3"]
    records = []
    for drafting in (["-d", str(eagle3.head)], ["-d", "none"]):
        result = specdec(*args, *drafting, *CLI_GREEDY, "-fa", "off", "-c", "256", "--json")
        assert result.returncode == 0, result.stderr
        records.append(json.loads(result.stdout))
    assert records[0]["text"] == records[1]["text"]
    assert records[0]["accepted"] > 0
