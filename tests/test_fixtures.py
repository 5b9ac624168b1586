"""The generated test models load in llama.cpp and behave as the other tests assume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import DRAFT_LAYERS, N_PAD, TARGET_HPARAMS, ModelPairFactory
from ggufgen import (
    FIRST_PIECE_ID,
    HParams,
    Vocab,
    llama_keys,
    llama_tensors,
    read_real_vocab,
    write_gguf,
    write_llama_model,
)

llama_cpp = pytest.importorskip("llama_cpp")

PROMPTS = ("Once upon a time", "The little girl saw a big dog", "He said", "they went to the park")
N_GENERATE = 40


def load(path: Path) -> llama_cpp.Llama:
    # logits_all keeps every position's logits, for teacher-forced comparison.
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False
    )


def all_logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    """Logits after each token of `tokens`, evaluated from an empty context."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


def greedy(llm: llama_cpp.Llama, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, n greedily generated tokens)."""
    prompt_tokens = llm.tokenize(prompt.encode())
    llm.reset()
    llm.eval(prompt_tokens)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return prompt_tokens, out


@pytest.mark.parametrize(
    "fixture", ["target_model", "draft_model", "other_vocab_model", "padded_vocab_model"]
)
def test_fixture_models_load_and_tokenize(fixture: str, request: pytest.FixtureRequest) -> None:
    llm = load(request.getfixturevalue(fixture))
    tokens = llm.tokenize(b"Once upon a time, the cat ran.")
    assert tokens[0] == 1  # BOS added
    assert llm.n_ctx() == 256
    greedy(llm, "Once upon a time", 5)


def test_tokenization_is_sensible(target_model: Path, vocab: Vocab) -> None:
    llm = load(target_model)
    pieces = [vocab.tokens[t] for t in llm.tokenize(b"the cat ran", add_bos=False)]
    assert pieces == ["▁the", "▁cat", "▁ran"]
    # Text outside the pieces falls back to byte tokens instead of <unk>.
    assert 0 not in llm.tokenize("zébre ✓".encode())


def test_layouts(target_model: Path, draft_model: Path) -> None:
    target, draft = load(target_model), load(draft_model)
    assert target.metadata["llama.block_count"] == str(TARGET_HPARAMS.n_layer)
    assert draft.metadata["llama.block_count"] == str(DRAFT_LAYERS)
    assert target.n_vocab() == draft.n_vocab()


def test_target_is_peaked_and_does_not_collapse(target_model: Path) -> None:
    llm = load(target_model)
    top1: list[float] = []
    for prompt in PROMPTS:
        prompt_tokens, out = greedy(llm, prompt, N_GENERATE)
        assert len(set(out)) > N_GENERATE // 4, "greedy generation repeats itself"
        assert min(out) >= FIRST_PIECE_ID, "only word pieces are generated"
        logits = all_logits(llm, prompt_tokens + out)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        top1 += list(probs.max(axis=1) / probs.sum(axis=1))
    assert np.mean(np.array(top1) > 0.3) > 0.5


def test_draft_agrees_with_target_often_but_not_always(
    target_model: Path, draft_model: Path
) -> None:
    target, draft = load(target_model), load(draft_model)
    agree: list[bool] = []
    for prompt in PROMPTS:
        prompt_tokens, out = greedy(target, prompt, N_GENERATE)
        sequence = prompt_tokens + out
        # Predictions for the generated positions: from the last prompt token on.
        first = len(prompt_tokens) - 1
        want = all_logits(target, sequence)[first:-1].argmax(axis=1)
        got = all_logits(draft, sequence)[first:-1].argmax(axis=1)
        assert list(want) == out
        agree += list(want == got)
    assert 0.2 < np.mean(agree) < 0.95


def test_pair_with_chosen_eos(model_pair_factory: ModelPairFactory) -> None:
    default_pair = model_pair_factory(2)
    _, out = greedy(load(default_pair[0]), "Once upon a time", 10)
    eos = out[5]  # a token the target produces greedily
    for default, with_eos in zip(default_pair, model_pair_factory(eos), strict=True):
        llm = load(with_eos)
        assert llm.token_eos() == eos
        # Same weights: the raw greedy continuation does not change.
        assert greedy(llm, "He said", 10) == greedy(load(default), "He said", 10)


def test_padded_vocab_model(target_model: Path, padded_vocab_model: Path) -> None:
    target, padded = load(target_model), load(padded_vocab_model)
    assert padded.n_vocab() == target.n_vocab() + N_PAD
    shared = range(target.n_vocab())
    assert [padded.detokenize([t]) for t in shared] == [target.detokenize([t]) for t in shared]
    assert greedy(padded, "He said", 20) == greedy(target, "He said", 20)


def test_other_vocab_model(target_model: Path, other_vocab_model: Path) -> None:
    target, other = load(target_model), load(other_vocab_model)
    assert other.n_vocab() == target.n_vocab()
    assert target.tokenize(b"the cat") != other.tokenize(b"the cat")


def test_stories260k_loads(stories260k: Path) -> None:
    llm = load(stories260k)
    assert llm.n_vocab() == 512
    assert len(greedy(llm, "Once upon a time", 5)[1]) == 5


def test_write_llama_model_in_one_call(tmp_path: Path, vocab: Vocab) -> None:
    hparams = HParams(n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=64, n_ctx_train=128)
    path = write_llama_model(tmp_path / "one.gguf", vocab, hparams, seed=7, eos_token_id=300)
    llm = load(path)
    assert llm.metadata["llama.embedding_length"] == "32"
    assert llm.token_eos() == 300


def test_a_tokenizer_copied_from_another_file(
    tmp_path: Path, target_model: Path, vocab: Vocab
) -> None:
    """read_real_vocab + write_gguf(copied=...): the way real vocabularies are carried,
    here with the synthetic one, so it runs without ../shared/vocab."""
    copied = read_real_vocab(target_model)
    assert len(copied) == len(vocab) and list(copied.types) == vocab.types
    assert copied.records.count == 9  # every tokenizer.* key llama_metadata writes
    hparams = HParams(n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=64)
    tensors = llama_tensors(hparams, copied, seed=1)
    path = write_gguf(tmp_path / "copy.gguf", llama_keys(hparams), tensors, copied.records)
    original, carried = load(target_model), load(path)
    text = "Once upon a time, zébre ✓".encode()
    assert carried.tokenize(text) == original.tokenize(text)
    assert carried.token_eos() == original.token_eos()
    assert carried.metadata["llama.embedding_length"] == "32"
