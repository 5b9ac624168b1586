"""compat.check_pair: llama.cpp's pairing rules (common_speculative_are_compatible), the
reasons when a pair is refused, and warnings for what llama.cpp lets through."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import N_PAD
from gguf import GGUFValue, TokenType
from ggufgen import Vocab, padded, spm_vocab
from test_gguf_meta import flag, tiny_model, u32

from specdec_cli.llamacpp.model import VocabInfo, init_backend, read_vocab
from specdec_cli.models.compat import (
    CompatReport,
    ModelFacts,
    check_pair,
    is_padding_token,
    read_facts,
)

NORMAL, CONTROL, UNUSED = int(TokenType.NORMAL), int(TokenType.CONTROL), int(TokenType.UNUSED)
N_VOCAB = len(spm_vocab())  # 495


@pytest.fixture(scope="module", autouse=True)
def quiet_llama() -> None:
    init_backend()


def extended(vocab: Vocab, tokens: list[str], token_type: int) -> Vocab:
    return Vocab(
        vocab.tokens + tokens,
        vocab.scores + [0.0] * len(tokens),
        vocab.types + [token_type] * len(tokens),
    )


def tiny_facts(
    path: Path, vocab: Vocab | None = None, changes=None, n_params: int = 64
) -> ModelFacts:
    """A tiny model's facts; it has some weights, for a file without is vocabulary-only."""
    return read_facts(tiny_model(path, vocab, changes, {"w": np.zeros(n_params, np.float32)}))


def check_tiny(
    tmp_path: Path,
    draft_vocab: Vocab | None = None,
    draft_changes: dict[str, GGUFValue | None] | None = None,
    target_vocab: Vocab | None = None,
) -> CompatReport:
    """check_pair on two tiny models: the default one, and one with the given changes."""
    target = tiny_facts(tmp_path / "target.gguf", target_vocab)
    draft = tiny_facts(tmp_path / "draft.gguf", draft_vocab, draft_changes, n_params=8)
    return check_pair(target, draft)


def check_vocab(tmp_path: Path, target: dict[str, object], draft: dict[str, object]):
    """check_pair on the same tiny model twice, with llama.cpp's facts of each side
    replaced as given: the rules on special tokens, apart from reading them."""
    big = tiny_facts(tmp_path / "big.gguf")
    small = tiny_facts(tmp_path / "small.gguf", n_params=8)
    return check_pair(
        replace(big, vocab=replace(big.vocab, **target)),
        replace(small, vocab=replace(small.vocab, **draft)),
    )


def test_target_and_draft_fixtures_are_compatible(target_model: Path, draft_model: Path) -> None:
    report = check_pair(read_facts(target_model), read_facts(draft_model))
    assert report.ok
    assert (report.problems, report.warnings) == ([], [])


def test_foreign_vocabulary_is_translated(target_model: Path, other_vocab_model: Path) -> None:
    report = check_pair(read_facts(target_model), read_facts(other_vocab_model))
    assert report.ok and report.translated
    [problem] = report.differences
    # Pieces are rot13'd from id 260 ("▁" is 259, then single characters): 'a' became 'n'.
    assert problem.startswith("token texts differ at ")
    assert "id 260: 'a' vs 'n'" in problem


def test_padded_vocabulary_is_a_warning(target_model: Path, padded_vocab_model: Path) -> None:
    report = check_pair(read_facts(padded_vocab_model), read_facts(target_model))
    assert report.ok, report.problems
    assert report.warnings == [
        f"vocabulary sizes differ: target has {N_VOCAB + N_PAD} tokens, draft has {N_VOCAB}; "
        f"the {N_PAD} extra target tokens are padding (unused placeholders); "
        f"the first {N_VOCAB} ids are compared"
    ]


# --- llama.cpp's own facts: its defaults and per-family rules, not the header's keys ---


def test_llama_defaults_when_keys_are_missing(tmp_path: Path) -> None:
    # llama.cpp's defaults for a SentencePiece vocabulary: BOS 1, EOS 2, add BOS only.
    missing = ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token")
    changes = {f"tokenizer.ggml.{key}": None for key in missing}
    path = tiny_model(tmp_path / "m.gguf", changes=changes)
    assert read_vocab(path) == VocabInfo("SPM", N_VOCAB, 1, 2, True, False)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        # No add_bos_token key: llama.cpp adds BOS for the llama-bpe pre-tokenizer anyway.
        ("llama-bpe", VocabInfo("BPE", 128_256, 128_000, 128_001, True, False)),
        ("qwen2", VocabInfo("BPE", 151_936, 151_643, 151_643, False, False)),
        # tokenizer.ggml.model is "gemma4", but to llama.cpp it is BPE like gpt2.
        ("gemma-4", VocabInfo("BPE", 262_144, 2, 1, True, False)),
        ("llama-spm", VocabInfo("SPM", 32_000, 1, 2, True, False)),
    ],
)
def test_real_vocabularies(
    family: str, expected: VocabInfo, vocab_file: Callable[[str], Path]
) -> None:
    assert read_vocab(vocab_file(family)) == expected


# --- what llama.cpp refuses ---


def test_vocab_type_must_match(vocab_file: Callable[[str], Path]) -> None:
    report = check_pair(read_facts(vocab_file("llama-spm")), read_facts(vocab_file("qwen2")))
    assert (
        "vocabulary types differ: target uses SPM (llama), draft uses BPE (gpt2)"
        in report.differences
    )


def test_same_type_but_sizes_too_far_apart(vocab_file: Callable[[str], Path]) -> None:
    """Both BPE to llama.cpp; 23,680 tokens apart."""
    report = check_pair(read_facts(vocab_file("qwen2")), read_facts(vocab_file("llama-bpe")))
    assert not any(p.startswith("vocabulary types differ") for p in report.differences)
    assert (
        "vocabulary sizes differ by 23680 tokens (target has 151936 tokens, draft has 128256), "
        "more than the 128 llama.cpp allows"
    ) in report.differences


def test_add_bos_flags_must_match(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.add_bos_token": flag(False)})
    assert report.differences == [
        "BOS handling differs: the target adds BOS to prompts, the draft does not"
    ]


def test_add_eos_flags_must_match(tmp_path: Path) -> None:
    report = check_vocab(tmp_path, {}, {"add_eos": True})
    assert report.differences == [
        "EOS handling differs: the target does not add EOS to prompts, the draft does"
    ]


def test_bos_id_must_match_when_added(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.bos_token_id": u32(3)})
    assert report.differences == ["BOS token ids differ: target uses 1, draft uses 3"]


def test_eos_id_must_match_when_added(tmp_path: Path) -> None:
    report = check_vocab(tmp_path, {"add_eos": True}, {"add_eos": True, "eos": None})
    assert report.differences == ["EOS token ids differ: target uses 2, draft uses none"]


@pytest.mark.parametrize(("n_extra", "shared"), [(128, True), (129, False)])
def test_at_most_128_extra_tokens_even_of_padding(
    tmp_path: Path, n_extra: int, shared: bool
) -> None:
    report = check_tiny(tmp_path, draft_vocab=padded(spm_vocab(), n_extra))
    assert report.ok, report.problems
    assert report.translated is not shared
    if not shared:
        assert report.differences == [
            f"vocabulary sizes differ by 129 tokens (target has {N_VOCAB} tokens, draft has "
            f"{N_VOCAB + 129}), more than the 128 llama.cpp allows"
        ]


def test_differing_texts_are_counted_with_three_examples(tmp_path: Path) -> None:
    vocab = spm_vocab()
    tokens = list(vocab.tokens)
    for i in (0, 300, 301, 302, 494):
        tokens[i] = f"x{i}"
    report = check_tiny(tmp_path, draft_vocab=Vocab(tokens, vocab.scores, vocab.types))
    # Ids from 5 on are llama.cpp's to compare; id 0 only earns a warning (below).
    assert report.differences == [
        f"token texts differ at 4 of {N_VOCAB - 5} ids from 5 on (target vs draft, e.g. "
        f"id 300: {vocab.tokens[300]!r} vs 'x300', id 301: {vocab.tokens[301]!r} vs 'x301', "
        f"id 302: {vocab.tokens[302]!r} vs 'x302')"
    ]


# --- what llama.cpp lets through: warnings (the target still decides every token) ---


def test_texts_below_id_5_only_warn(tmp_path: Path) -> None:
    vocab = spm_vocab()
    tokens = ["[UNK]", *vocab.tokens[1:]]
    report = check_tiny(tmp_path, draft_vocab=Vocab(tokens, vocab.scores, vocab.types))
    assert report.ok, report.problems
    assert report.warnings == [
        "token texts differ below id 5, which llama.cpp does not compare (target vs draft: "
        "id 0: '<unk>' vs '[UNK]'); the draft's guesses of these tokens will be rejected"
    ]


def test_eos_id_only_warns_when_not_added(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.eos_token_id": u32(3)})
    assert report.ok, report.problems
    assert report.warnings == [
        "EOS token ids differ (target uses 2, draft uses 3); the target decides where "
        "generation ends, so only acceptance can suffer"
    ]


@pytest.mark.parametrize(
    ("extra_tokens", "token_type"),
    [
        (["<pad>", "<unused0>", "<|reserved_special_token_1|>", "<extra_id_0>"], CONTROL),
        (["anything", "at", "all", "here"], UNUSED),
    ],
)
def test_padding_in_the_draft_is_a_warning(
    tmp_path: Path, extra_tokens: list[str], token_type: int
) -> None:
    report = check_tiny(tmp_path, draft_vocab=extended(spm_vocab(), extra_tokens, token_type))
    assert report.ok, report.problems
    assert report.warnings == [
        f"vocabulary sizes differ: target has {N_VOCAB} tokens, draft has {N_VOCAB + 4}; "
        "the 4 extra draft tokens are padding (unused placeholders); "
        f"the first {N_VOCAB} ids are compared"
    ]


@pytest.mark.parametrize(
    ("bigger", "meaning"),
    [
        ("draft", "real tokens the target does not have, so the draft never proposes them"),
        ("target", "real tokens the draft never proposes (acceptance suffers where they occur)"),
    ],
)
def test_real_extra_tokens_are_a_warning(tmp_path: Path, bigger: str, meaning: str) -> None:
    """llama.cpp pairs vocabularies up to 128 tokens apart whatever the extra tokens are
    (specdec refused real ones before); the drafter never proposes an id the target lacks."""
    more = extended(padded(spm_vocab(), 2), ["real"], NORMAL)
    if bigger == "draft":
        report = check_tiny(tmp_path, draft_vocab=more)
        sizes = f"target has {N_VOCAB} tokens, draft has {N_VOCAB + 3}"
    else:
        report = check_tiny(tmp_path, target_vocab=more)
        sizes = f"target has {N_VOCAB + 3} tokens, draft has {N_VOCAB}"
    assert report.ok, report.problems
    assert report.warnings == [
        f"vocabulary sizes differ: {sizes}; the 3 extra {bigger} tokens are {meaning}; "
        f"the first {N_VOCAB} ids are compared"
    ]


def test_real_pair_llama2_and_phi3(vocab_file: Callable[[str], Path]) -> None:
    """Phi-3 extends Llama 2's SentencePiece vocabulary by 64 tokens and ends turns with its
    own EOS: llama.cpp pairs them (were they models, not vocabulary-only files)."""
    report = check_pair(read_facts(vocab_file("llama-spm")), read_facts(vocab_file("phi-3")))
    assert all("vocabulary-only file" in problem for problem in report.problems)
    assert report.warnings == [
        "EOS token ids differ (target uses 2, draft uses 32000); the target decides where "
        "generation ends, so only acceptance can suffer",
        "vocabulary sizes differ: target has 32000 tokens, draft has 32064; the 64 extra draft "
        "tokens are real tokens the target does not have, so the draft never proposes them; "
        "the first 32000 ids are compared",
    ]


# --- files that cannot pair at all ---


def test_missing_vocabulary(tmp_path: Path) -> None:
    changes = {"tokenizer.ggml.tokens": None, "tokenizer.ggml.token_type": None}
    report = check_tiny(tmp_path, draft_changes=changes)
    [problem] = report.problems
    assert problem == (
        f"the draft model {tmp_path / 'draft.gguf'} has no vocabulary "
        "(no tokenizer.ggml.tokens); use a complete GGUF model file"
    )


def test_vocabulary_only_file_is_a_problem(tmp_path: Path) -> None:
    target = tiny_facts(tmp_path / "target.gguf")
    vocab_only = read_facts(tiny_model(tmp_path / "vocab.gguf"))
    assert check_pair(target, vocab_only).problems == [
        "the draft vocab.gguf has no weights: it is a vocabulary-only file (a tokenizer "
        "without a model); pass a complete model file"
    ]


def test_draft_not_smaller_warns(tmp_path: Path) -> None:
    small = tiny_facts(tmp_path / "s.gguf", n_params=8)
    big = tiny_facts(tmp_path / "b.gguf", n_params=64)
    report = check_pair(small, big)
    assert report.ok
    assert report.warnings[0].startswith("the draft is not smaller than the target (64 vs 8 ")
    assert check_pair(big, small).warnings == []


def test_report_to_dict_is_json(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.bos_token_id": u32(5)})
    assert json.loads(json.dumps(report.to_dict())) == {
        "ok": True,
        "vocabulary": "translated",
        "problems": [],
        "differences": ["BOS token ids differ: target uses 1, draft uses 5"],
        "warnings": [],
    }


@pytest.mark.parametrize(
    ("text", "token_type", "padding"),
    [
        ("[PAD151646]", NORMAL, True),
        ("<pad>", CONTROL, True),
        ("<unused12>", None, True),
        ("<|reserved_special_token_250|>", CONTROL, True),
        ("whatever", UNUSED, True),
        ("padding", NORMAL, False),
        ("<|im_start|>", CONTROL, False),
        ("<s>", CONTROL, False),
    ],
)
def test_is_padding_token(text: str, token_type: int | None, padding: bool) -> None:
    assert is_padding_token(text, token_type) is padding


def test_stories260k_with_itself(stories260k: Path) -> None:
    stories = read_facts(stories260k)
    report = check_pair(stories, stories)
    assert report.ok
    assert report.warnings[0].startswith("the draft is not smaller than the target")


def test_stories260k_with_a_different_vocabulary(stories260k: Path, target_model: Path) -> None:
    report = check_pair(read_facts(stories260k), read_facts(target_model))
    # 17 tokens apart is within llama.cpp's 128: the texts are what sets them apart,
    # and translated, how llama.cpp would compare them is no matter.
    [problem] = report.differences
    assert problem.startswith("token texts differ at ")
    assert report.ok and not any("sizes differ" in w for w in report.warnings)
