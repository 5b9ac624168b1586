"""A draft model with a projector of its own (--mmproj-draft): it reads the image as the
target does, and drafts what the image decides. On mtmdgen's echo pair (the answer
repeats the image's colour after each newline), a draft that reads the text alone misses
every colour word it drafts; one with its own projector (here the target's own file and
projector) drafts the target's text whole, M-RoPE included, chains and trees, in slots
beside prompts without images, and coupled sampling's noise is read where the target
reads it. What cannot work is refused in one line before anything loads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from ggufgen import write_eagle3_known_answer
from mtmdgen import COLORS, ImageDims, VisionPair, png, vision_vocab, write_mlp_projector
from mtmdgen import write_vision_pair as write_pair
from test_cli_run import GREEDY, assert_user_error, specdec
from test_serve_vision import expected, image_part
from test_server import start
from test_vision import in_slots

from specdec_cli.decoding import loading
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.media import Media, media_from_bytes
from specdec_cli.models.chat import Message

MARKER = "<__media__>"
QUESTION = "What colour is it?"
N = 16


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    folder = tmp_path_factory.mktemp(request.param)
    return write_pair(folder, mrope=request.param == "qwen2vl", echo=True)


def options(pair: VisionPair, own: bool, parallel: int = 1, **changes: object) -> EngineOptions:
    """The target drafted by its own file: with its own projector (`own`), or reading the
    text alone."""
    options = EngineOptions(
        pair.target,
        draft=pair.target,
        mmproj=pair.mmproj,
        mmproj_draft=pair.mmproj if own else None,
        n_ctx=256 * parallel,
        threads=1,
        flash_attn="off",
        parallel=parallel,
        sampling=SamplingParams(temp=0.0),
        drafting=DraftOptions(k="3", tree="8"),
    )
    return replace(options, **changes)


@pytest.fixture(scope="module")
def engines(pair: VisionPair) -> Iterator[dict[bool, Engine]]:
    """By whether the draft has its own projector."""
    with Engine(options(pair, own=True)) as own, Engine(options(pair, own=False)) as text:
        yield {True: own, False: text}


def image(colour: str) -> Media:
    return media_from_bytes(png(16, 16, COLORS[colour]), f"{colour}.png")


def chat(engine: Engine, colour: str | None) -> MediaPrompt:
    question = Message("user", (MARKER if colour else "") + QUESTION)
    return engine.media_prompt(engine.chat_text([question]), [image(colour)] if colour else [])


def generate(
    engine: Engine,
    prompt: MediaPrompt,
    kind: str | None,
    tree: str = "off",
    sampling: SamplingParams | None = None,
    seed: int = 0,
) -> tuple[list[int], Stats]:
    stats = Stats()
    decoder = engine.make_decoder(kind, "3", tree)
    rounds = decoder.generate(
        prompt.tokens, N, np.random.default_rng(seed), stats, sampling, media=prompt.media
    )
    return [t for r in rounds for t in r.tokens], stats


@pytest.mark.parametrize("tree", ["off", "8"])
def test_a_draft_with_its_own_projector_drafts_what_the_image_decides(
    engines: dict[bool, Engine], pair: VisionPair, tree: str
) -> None:
    """The target's text, whoever drafts; a draft with its own projector has every guess
    of its chain accepted, one reading the text alone misses each colour word it drafts
    (and takes more target passes)."""
    texts, stats = {}, {}
    for own, engine in engines.items():
        assert (engine.draft_encodings is not None) == own
        with chat(engine, "blue") as prompt:
            alone, _ = generate(engine, prompt, None)
            texts[own], stats[own] = generate(engine, prompt, "model", tree)
        assert alone == pair.greedy("blue", N)
    assert texts[True] == texts[False] == pair.greedy("blue", N)
    seen, unseen = stats[True], stats[False]
    assert seen.accepted - seen.accepted_beside == seen.accepted > 0
    if tree == "off":
        assert seen.accepted == seen.drafted
    assert unseen.accepted < unseen.drafted
    assert seen.target_passes < unseen.target_passes


def test_coupled_sampling_reads_the_noise_where_the_target_does(pair: VisionPair) -> None:
    """Coupled sampling: target and draft draw each position's token with the same noise,
    keyed by the place in what the target holds (the image's cells count). A draft with
    its own projector has the target's distribution, and so every guess accepted."""
    sampling = SamplingParams(temp=2.5, top_k=8, top_p=1.0, min_p=0.0, coupled=True)
    with Engine(options(pair, own=True)) as engine, chat(engine, "red") as prompt:
        for seed in range(3):
            alone, _ = generate(engine, prompt, None, sampling=sampling, seed=seed)
            tokens, stats = generate(engine, prompt, "model", sampling=sampling, seed=seed)
            assert tokens == alone
            assert stats.accepted == stats.drafted > 0, seed


def test_slots_with_images_and_without(pair: VisionPair) -> None:
    """Three slots: a red image, none, a blue one, verified in the same decode calls; the
    draft holds each slot's image as its own projector made it."""
    colours = ["red", None, "blue"]
    drafting = DraftOptions(k="3", tree="off")
    with Engine(options(pair, own=True, parallel=3, drafting=drafting)) as engine:
        prompts = [chat(engine, c) for c in colours]
        texts, stats = in_slots(engine, prompts, N)
    assert texts == [pair.greedy(c, N) for c in colours]
    assert all(s.accepted == s.drafted for s in stats)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    return write_pair(tmp_path_factory.mktemp("llava"), echo=True)


def refusal(options: EngineOptions, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(loading, "Model", None)  # nothing may load
    with pytest.raises(UserError) as err:
        Engine(options)
    return str(err.value)


def test_refused_without_a_draft_model(llava: VisionPair, monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(options(llava, own=True, draft=None), monkeypatch)
    assert message.startswith("--mmproj-draft is a draft model's projector: pass the draft")


def test_refused_beside_a_drafting_head(
    tmp_path: Path, llava: VisionPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, head, _ = write_eagle3_known_answer(tmp_path, vision_vocab(), seed=0)
    given = options(llava, own=True, draft=head)
    message = refusal(replace(given, target=target), monkeypatch)
    assert message.startswith("--mmproj-draft is a draft model's projector")


def test_refused_without_the_targets_projector(
    llava: VisionPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = refusal(options(llava, own=True, mmproj=None), monkeypatch)
    assert message == "--mmproj-draft needs the target's own projector too: add --mmproj"


def test_refused_for_a_draft_of_another_vocabulary(
    llava: VisionPair, stories260k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = refusal(options(llava, own=True, draft=stories260k), monkeypatch)
    assert "has another vocabulary than the target" in message


def test_a_projector_for_another_model_is_refused(
    llava: VisionPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wider = ImageDims(llava.dims.mark, llava.dims.red, llava.dims.blue, llava.dims.n_embd + 64)
    other, *_ = write_mlp_projector(tmp_path / "mmproj-other.gguf", wider)
    message = refusal(options(llava, own=True, mmproj_draft=other), monkeypatch)
    assert "it was made for another model" in message


def test_run_with_a_draft_projector(llava: VisionPair, tmp_path: Path) -> None:
    """`specdec run --mmproj-draft`: the target's text, every draft accepted."""
    picture = tmp_path / "red.png"
    picture.write_bytes(png(16, 16, COLORS["red"]))
    args = ["run", "-m", str(llava.target), "-d", str(llava.target), "--no-ngram"]
    args += ["--mmproj", str(llava.mmproj), "--mmproj-draft", str(llava.mmproj)]
    args += ["--image", str(picture), "-p", QUESTION, "--chat", "-n", str(N), "-k", "3"]
    result = specdec(*args, *GREEDY, "-fa", "off", "-c", "256", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["accepted"] == stats["drafted"] > 0


def test_run_refuses_a_missing_draft_projector(llava: VisionPair, tmp_path: Path) -> None:
    args = ["run", "-m", str(llava.target), "-d", str(llava.target), "-p", QUESTION]
    result = specdec(*args, "--mmproj-draft", str(tmp_path / "nowhere.gguf"))
    assert_user_error(result, "projector file not found")


def test_serve_with_a_draft_projector(llava: VisionPair, tmp_path: Path) -> None:
    """`specdec serve --mmproj-draft`: an image_url part answered as the target answers
    it, every draft accepted; a request without an image beside it."""
    args = ["-m", str(llava.target), "-d", str(llava.target), "--no-ngram", "-k", "3"]
    args += ["--mmproj", str(llava.mmproj), "--mmproj-draft", str(llava.mmproj)]
    server = start(tmp_path, *args, "-c", "512", "-np", "2")
    try:
        for colour in ("red", None):
            content = [{"type": "text", "text": QUESTION}]
            if colour:
                content.insert(0, image_part(png(16, 16, COLORS[colour])))
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": N}
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"temperature": 0})
            assert reply.status_code == 200, reply.text
            answer = reply.json()
            assert answer["choices"][0]["message"]["content"] == expected(llava, colour, N)
            timings = answer["timings"]
            assert timings["draft_n_accepted"] == timings["draft_n"] > 0
    finally:
        assert server.stop() == 0, server.output()
