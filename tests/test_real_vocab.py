"""Real tokenizers (../shared/vocab: Qwen2 152k, Llama 3 128k, Gemma 4 262k, Phi-3 and
Llama 2 32k), on their own and carried by tiny random models: tokenization as llama.cpp's
own test cases, text streamed as it is generated, every end-of-generation token, stop
strings, and lossless speculative decoding at real vocabulary sizes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
import pytest
from conftest import VOCAB_FAMILIES, real_vocab_tensors, write_real_vocab_pair
from ggufgen import RealVocab
from test_decode import PROMPT, generate, llama_cpp_greedy, open_engine

from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.draftlength import FixedLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.stats import Stats
from specdec_cli.decoding.textstream import TextStream
from specdec_cli.llamacpp.model import Model, init_backend

N_TOKENS = 32
Opened = TypeVar("Opened", Model, Engine)
LARGEST = ("qwen2", "gemma-4")  # 152k and 262k tokens
# Emoji (one with a zero-width joiner), CJK, accents: byte-level BPE and byte fallback
# split these characters over several tokens.
MULTIBYTE_TEXT = "Hello 世界! 🦙🚀 naïve café — 日本語のテキスト 😶\u200d🌫️ ok"


@contextlib.contextmanager
def kept_open(open_one: Callable[[str], Opened]) -> Iterator[Callable[[str], Opened]]:
    """get(family): open_one(family) the first time, the same object afterwards; all
    closed at the end. Loading a real vocabulary is the slow part of opening a model."""
    opened: dict[str, Opened] = {}

    def get(family: str) -> Opened:
        if family not in opened:
            opened[family] = open_one(family)
        return opened[family]

    try:
        yield get
    finally:
        for thing in opened.values():
            thing.close()


@pytest.fixture(scope="module")
def vocab_model(vocab_file: Callable[[str], Path]) -> Iterator[Callable[[str], Model]]:
    """vocab_model("qwen2"): the family's tokenizer loaded alone (no weights), as the
    engine's Model."""
    init_backend()
    with kept_open(lambda family: Model(vocab_file(family), vocab_only=True)) as get:
        yield get


@pytest.fixture(scope="module")
def pair_engine(
    real_vocab_pair: Callable[[str], tuple[Path, Path]],
) -> Iterator[Callable[[str], Engine]]:
    """pair_engine("qwen2"): an engine on the family's random target and draft, greedy,
    k=3; other decoders come from its make_decoder."""
    with kept_open(lambda family: open_engine(*real_vocab_pair(family), k=3)) as get:
        yield get


@pytest.fixture(scope="module")
def reference(pair_engine: Callable[[str], Engine]) -> Callable[[str], list[int]]:
    """reference("qwen2"): the family's target-only greedy output, N_TOKENS long."""

    @functools.cache
    def target_only(family: str) -> list[int]:
        engine = pair_engine(family)
        tokens, _ = generate(engine, N_TOKENS, decoder=engine.make_decoder(None, "0"))
        assert len(tokens) == N_TOKENS  # no end-of-generation token came first
        return tokens

    return target_only


def tokenizer_cases(path: Path) -> dict[str, list[int]]:
    """llama.cpp's tests/test-tokenizer-0 cases beside a vocabulary file, read as that test
    reads them: `.inp` holds the inputs, separated by lines `__ggml_vocab_test__` (the
    file may end with one); line i of `.out` holds input i's token ids. A repeated input
    counts once, as in that test's map."""
    inputs = Path(f"{path}.inp").read_bytes().decode().split("\n__ggml_vocab_test__\n")
    if inputs[-1] == "":
        inputs.pop()
    outputs = Path(f"{path}.out").read_bytes().decode().splitlines()
    assert len(outputs) == len(inputs), f"{path}: as many lines in .out as cases in .inp"
    return {text: [int(t) for t in ids.split()] for text, ids in zip(inputs, outputs, strict=True)}


@pytest.mark.parametrize("family", VOCAB_FAMILIES)
def test_tokenize_as_llama_cpp_own_test_cases(
    vocab_file: Callable[[str], Path], vocab_model: Callable[[str], Model], family: str
) -> None:
    """test-tokenizer-0 tokenizes without BOS/EOS and without parsing special tokens."""
    cases = tokenizer_cases(vocab_file(family))
    assert len(cases) > 30
    model = vocab_model(family)
    got = {text: model.tokenize(text, add_special=False, parse_special=False) for text in cases}
    assert got == cases


def is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def stream_pieces(pieces: list[bytes], stop: tuple[str, ...] = ()) -> list[str]:
    stream = TextStream(stop)
    return [stream.push(piece) for piece in pieces] + [stream.flush()]


@pytest.mark.parametrize("family", VOCAB_FAMILIES)
def test_streamed_pieces_are_the_text(vocab_model: Callable[[str], Model], family: str) -> None:
    model = vocab_model(family)
    pieces = [model.piece(t) for t in model.tokenize(MULTIBYTE_TEXT, add_special=False)]
    assert not all(map(is_complete_utf8, pieces))  # characters split across tokens
    chunks = stream_pieces(pieces)
    assert "".join(chunks) == b"".join(pieces).decode()
    # SentencePiece puts a space before the first word; the rest comes back as it went in.
    assert "".join(chunks).removeprefix(" ") == MULTIBYTE_TEXT
    assert "\ufffd" not in "".join(chunks)  # no character was shown before it was complete
    # A stop string from inside one token ("世界" is one in most of these vocabularies)
    # to inside a character that several tokens share (the llama emoji, in byte-level BPE).
    stop = "界! 🦙"
    cut = stream_pieces(pieces, stop=(stop,))
    assert "".join(cut) == b"".join(pieces).decode().split(stop)[0]


def streamed(
    engine: Engine, n_predict: int, stop: tuple[str, ...] = (), decoder: Decoder | None = None
) -> tuple[str, Stats]:
    """The text engine.pieces yields for PROMPT, piece by piece."""
    stats = Stats()
    prompt = engine.tokenize(PROMPT)
    rng = np.random.default_rng(0)
    pieces = engine.pieces(prompt, n_predict, rng, stats, stop, decoder)
    return "".join(p.text for p in pieces), stats


@pytest.mark.parametrize("family", LARGEST)
def test_greedy_speculative_equals_target_only(
    pair_engine: Callable[[str], Engine], reference: Callable[[str], list[int]], family: str
) -> None:
    engine = pair_engine(family)
    for k in ("3", "auto"):
        decoder = engine.make_decoder("model", k)
        out, stats = generate(engine, N_TOKENS, decoder=decoder)
        assert out == reference(family), f"k={k}"
        if k == "auto":  # it may stop drafting where this tiny pair's costs say so
            assert stats.drafted > 0
        else:
            assert 0.0 < stats.acceptance_rate < 1.0  # the draft really disagrees sometimes
        text, _ = streamed(engine, N_TOKENS, decoder=decoder)
        whole = b"".join(engine.model.piece(t) for t in out).decode(errors="replace")
        assert text == whole  # streamed as accepted == detokenized at once


@pytest.mark.parametrize("family", LARGEST)
def test_target_only_matches_llama_cpp_python_greedy(
    real_vocab_pair: Callable[[str], tuple[Path, Path]],
    pair_engine: Callable[[str], Engine],
    reference: Callable[[str], list[int]],
    family: str,
) -> None:
    """The outside reference at 152k and 262k tokens, with the flash attention setting
    the engine chose (-fa auto)."""
    engine = pair_engine(family)
    prompt = engine.tokenize(PROMPT)
    target = real_vocab_pair(family)[0]
    assert reference(family) == llama_cpp_greedy(target, prompt, N_TOKENS, engine.flash_attn.used)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(top_k=0, top_p=1.0, min_p=0.0)],
    ids=["defaults", "every filter off"],
)
def test_sampled_run_with_a_152k_vocabulary(
    pair_engine: Callable[[str], Engine], sampling: SamplingParams
) -> None:
    """Sampling over logits rows 152k wide: llama.cpp's default settings, and every
    filter off (each row's exp over the whole vocabulary, `rowexp`)."""
    engine = pair_engine("qwen2")
    drafter = ModelDrafter(engine.draft_ctx, sampling, engine.model.n_vocab)
    decoder = Decoder(engine.target, drafter, sampling, FixedLength(3))
    first, stats = generate(engine, N_TOKENS, seed=3, decoder=decoder)
    again, _ = generate(engine, N_TOKENS, seed=3, decoder=decoder)
    assert len(first) == N_TOKENS and stats.stop_reason == "length"
    assert first == again  # seeded
    assert stats.drafted > 0


def spanning_stop(pieces: list[bytes]) -> str:
    """A stop string that starts inside one token's text and ends inside the next but one:
    the last character of a piece, the whole next piece, the first character of the next."""
    texts = [piece.decode() if is_complete_utf8(piece) else "" for piece in pieces]
    i = next(i for i in range(len(texts) - 2) if all(len(t) > 1 for t in texts[i : i + 3]))
    return texts[i][-1] + texts[i + 1] + texts[i + 2][0]


def test_stop_string_across_tokens(
    pair_engine: Callable[[str], Engine], reference: Callable[[str], list[int]]
) -> None:
    """Drafts of 3 tokens run past the stop string: none of it is shown."""
    engine = pair_engine("qwen2")
    pieces = [engine.model.piece(t) for t in reference("qwen2")]
    whole = b"".join(pieces).decode(errors="replace")
    stop = spanning_stop(pieces)
    text, stats = streamed(engine, N_TOKENS, stop=(stop,))
    assert text == whole[: whole.index(stop)]
    assert stats.stop_reason == "stop"


# The end-of-generation test: each EOG token takes the place of a token the target
# generates greedily, EOG_LEAD tokens after a prompt that is PROMPT plus the target's own
# output up to there.
EOG_LEAD = 3


def eog_tokens(model: Model) -> list[int]:
    """Every token llama.cpp ends a generation at (llama_vocab_is_eog)."""
    return [t for t in range(model.n_vocab) if model.is_eog(t)]


def stand_in_positions(tokens: list[int], n: int) -> list[int]:
    """n positions in `tokens`, each the first occurrence of its token, none of whose
    EOG_LEAD predecessors is a chosen token: a model that generates an EOG token in
    place of each chosen token generates, from the text before a position's
    predecessors, exactly those predecessors, then its EOG token."""
    chosen: list[int] = []
    for p in range(EOG_LEAD, len(tokens)):
        lead = tokens[p - EOG_LEAD : p]
        if tokens[p] not in tokens[:p] and not any(tokens[q] in lead for q in chosen):
            chosen.append(p)
            if len(chosen) == n:
                return chosen
    raise AssertionError(f"{n} positions needed; generate more tokens")


class EogCase(NamedTuple):
    """Given `prompt`, the EOG models generate `lead`, then `eog`."""

    eog: int
    prompt: list[int]
    lead: list[int]


@pytest.fixture(scope="module")
def eog_models(
    tmp_path_factory: pytest.TempPathFactory,
    real_vocab: Callable[[str], RealVocab],
    reference: Callable[[str], list[int]],
    vocab_model: Callable[[str], Model],
) -> Callable[[str], tuple[Path, list[EogCase]]]:
    """eog_models(family) -> (target, cases): the family's target with the output rows
    of its EOG tokens swapped with those of tokens it generates, so that it produces each
    EOG token somewhere."""

    @functools.cache
    def make(family: str) -> tuple[Path, list[EogCase]]:
        tokens = reference(family)
        prompt = vocab_model(family).tokenize(PROMPT)
        eogs = eog_tokens(vocab_model(family))
        vocab = real_vocab(family)
        tensors = real_vocab_tensors(vocab)
        output = tensors["output.weight"]
        cases = []
        for eog, p in zip(eogs, stand_in_positions(tokens, len(eogs)), strict=True):
            output[[eog, tokens[p]]] = output[[tokens[p], eog]]
            start = p - EOG_LEAD
            cases.append(EogCase(eog, prompt + tokens[:start], tokens[start:p]))
        folder = tmp_path_factory.mktemp(f"eog-{family}")
        return write_real_vocab_pair(folder, vocab, tensors)[0], cases

    return make


EXPECTED_EOG = {  # among llama_vocab_is_eog's tokens, the ones each family's chats end with
    "qwen2": ("<|im_end|>", "<|endoftext|>"),
    "gemma-4": ("<turn|>", "<eos>"),
    "llama-bpe": ("<|eot_id|>", "<|end_of_text|>"),
    "phi-3": ("<|end|>", "<|endoftext|>"),
    "llama-spm": ("</s>",),
}


@pytest.mark.parametrize("family", VOCAB_FAMILIES)
def test_every_end_of_generation_token_ends_the_generation(
    eog_models: Callable[[str], tuple[Path, list[EogCase]]],
    vocab_model: Callable[[str], Model],
    family: str,
) -> None:
    """When the target produces the EOG token, and when it comes inside an accepted draft:
    the target drafting for itself, 8 tokens, proposes it EOG_LEAD tokens in and keeps it."""
    target, cases = eog_models(family)
    model = vocab_model(family)
    expected = {model.tokenize(text, add_special=False)[0] for text in EXPECTED_EOG[family]}
    assert expected <= {case.eog for case in cases}
    with open_engine(target, target, 8) as engine:
        target_only = engine.make_decoder(None, "0")
        for case in cases:
            for decoder in (target_only, engine.decoder):
                out, stats = generate(engine, N_TOKENS, decoder=decoder, prompt=case.prompt)
                assert (out, stats.stop_reason) == (case.lead, "eos"), f"EOG token {case.eog}"
            assert stats.accepted > EOG_LEAD  # in the self draft's run, the EOG was drafted


@pytest.mark.parametrize("family", LARGEST)
def test_models_carry_the_real_tokenizer(
    pair_engine: Callable[[str], Engine], vocab_model: Callable[[str], Model], family: str
) -> None:
    """The random model tokenizes, and knows its special tokens and chat template, as the
    vocabulary file it took its tokenizer from."""
    carried, original = pair_engine(family).model, vocab_model(family)
    assert carried.vocab_info() == original.vocab_info()
    assert carried.chat_template() == original.chat_template() is not None
    assert carried.tokenize(MULTIBYTE_TEXT) == original.tokenize(MULTIBYTE_TEXT)
