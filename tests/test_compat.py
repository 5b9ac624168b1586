"""compat.check_pair: which draft/target pairs share a vocabulary, and the reasons when not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import N_PAD
from gguf import GGUFValue, TokenType
from ggufgen import Vocab, padded, spm_vocab
from test_gguf_meta import flag, string, tiny_model, u32

from specdec_cli.compat import CompatReport, check_pair, is_padding_token
from specdec_cli.gguf_meta import read_gguf

SAME_FAMILY = "the draft must use the target's tokenizer (same model family)"
NORMAL, CONTROL, UNUSED = int(TokenType.NORMAL), int(TokenType.CONTROL), int(TokenType.UNUSED)


def extended(vocab: Vocab, tokens: list[str], token_type: int) -> Vocab:
    return Vocab(
        vocab.tokens + tokens, vocab.scores + [0.0] * len(tokens),
        vocab.types + [token_type] * len(tokens),
    )


def check_tiny(
    tmp_path: Path,
    draft_vocab: Vocab | None = None,
    draft_changes: dict[str, GGUFValue | None] | None = None,
    target_vocab: Vocab | None = None,
) -> CompatReport:
    """check_pair on two tiny models: the default one, and one with the given changes."""
    target = tiny_model(tmp_path / "target.gguf", target_vocab)
    draft = tiny_model(tmp_path / "draft.gguf", draft_vocab, draft_changes)
    return check_pair(read_gguf(target), read_gguf(draft))


def test_target_and_draft_fixtures_are_compatible(target_model: Path, draft_model: Path) -> None:
    report = check_pair(read_gguf(target_model), read_gguf(draft_model))
    assert report.ok
    assert (report.problems, report.warnings) == ([], [])


def test_foreign_vocabulary_is_refused(target_model: Path, other_vocab_model: Path) -> None:
    report = check_pair(read_gguf(target_model), read_gguf(other_vocab_model))
    assert not report.ok
    [problem] = report.problems
    # Pieces are rot13'd from id 260 ("▁" is 259, then single characters): 'a' became 'n'.
    assert problem.startswith("token texts differ at ")
    assert "id 260: 'a' vs 'n'" in problem
    assert problem.endswith(SAME_FAMILY)


def test_padded_vocabulary_is_a_warning(target_model: Path, padded_vocab_model: Path) -> None:
    report = check_pair(read_gguf(padded_vocab_model), read_gguf(target_model))
    assert report.ok, report.problems
    n = len(spm_vocab())
    assert report.warnings == [
        f"vocabulary sizes differ only by padding: target has {n + N_PAD} tokens, draft has "
        f"{n}; the {N_PAD} extra target tokens are unused placeholders, so only the first {n} "
        "ids are compared"
    ]


def test_vocab_type_must_match(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.model": string("gpt2")})
    assert report.problems == [
        f"vocabulary types differ: target uses 'llama', draft uses 'gpt2'; {SAME_FAMILY}"
    ]


def test_bos_and_eos_ids_must_match(tmp_path: Path) -> None:
    changes = {"tokenizer.ggml.bos_token_id": u32(3), "tokenizer.ggml.eos_token_id": None}
    report = check_tiny(tmp_path, draft_changes=changes)
    # Without the key, a SentencePiece vocabulary's EOS is 2 anyway: only BOS differs.
    assert report.problems == [f"BOS token ids differ: target uses 1, draft uses 3; {SAME_FAMILY}"]


def test_missing_special_token_is_named(tmp_path: Path) -> None:
    gpt2 = {"tokenizer.ggml.model": string("gpt2")}
    target = read_gguf(tiny_model(tmp_path / "t.gguf", changes=gpt2))
    draft_changes = {**gpt2, "tokenizer.ggml.eos_token_id": None}
    draft = read_gguf(tiny_model(tmp_path / "d.gguf", changes=draft_changes))
    assert check_pair(target, draft).problems == [
        f"EOS token ids differ: target uses 2, draft uses none; {SAME_FAMILY}"
    ]


def test_add_bos_flags_must_match(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.add_bos_token": flag(False)})
    assert report.problems == [
        f"BOS handling differs: the target adds BOS to prompts, the draft does not; {SAME_FAMILY}"
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
    assert report.warnings[0].startswith(
        "vocabulary sizes differ only by padding: target has 495 tokens, draft has 499; "
        "the 4 extra draft tokens"
    )


def test_real_extra_tokens_are_a_problem(tmp_path: Path) -> None:
    draft_vocab = extended(padded(spm_vocab(), 2), ["real"], NORMAL)
    report = check_tiny(tmp_path, draft_vocab=draft_vocab)
    assert report.problems == [
        f"vocabulary sizes differ: target has 495 tokens, draft has 498; {SAME_FAMILY}"
    ]


def test_differing_texts_are_counted_with_three_examples(tmp_path: Path) -> None:
    vocab = spm_vocab()
    tokens = list(vocab.tokens)
    for i in (0, 300, 301, 302, 494):
        tokens[i] = f"x{i}"
    report = check_tiny(tmp_path, draft_vocab=Vocab(tokens, vocab.scores, vocab.types))
    # Id 0 counts too: llama.cpp skips ids below 5, this check compares every shared id.
    assert report.problems == [
        "token texts differ at 5 of 495 shared ids (target vs draft, e.g. "
        f"id 0: '<unk>' vs 'x0', id 300: {vocab.tokens[300]!r} vs 'x300', "
        f"id 301: {vocab.tokens[301]!r} vs 'x301'); {SAME_FAMILY}"
    ]


def test_missing_vocabulary(tmp_path: Path) -> None:
    changes = {"tokenizer.ggml.tokens": None, "tokenizer.ggml.token_type": None}
    report = check_tiny(tmp_path, draft_changes=changes)
    [problem] = report.problems
    assert problem == (
        f"the draft model {tmp_path / 'draft.gguf'} has no vocabulary "
        "(no tokenizer.ggml.tokens); use a complete GGUF model file"
    )


def test_draft_not_smaller_warns(tmp_path: Path) -> None:
    small = read_gguf(tiny_model(tmp_path / "s.gguf", tensors={"w": np.zeros(8, np.float32)}))
    big = read_gguf(tiny_model(tmp_path / "b.gguf", tensors={"w": np.zeros(64, np.float32)}))
    report = check_pair(small, big)
    assert report.ok
    assert report.warnings[0].startswith("the draft is not smaller than the target (64 vs 8 ")
    assert check_pair(big, small).warnings == []


def test_report_to_dict_is_json(tmp_path: Path) -> None:
    report = check_tiny(tmp_path, draft_changes={"tokenizer.ggml.bos_token_id": u32(5)})
    assert json.loads(json.dumps(report.to_dict())) == {
        "ok": False,
        "problems": [f"BOS token ids differ: target uses 1, draft uses 5; {SAME_FAMILY}"],
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
    stories = read_gguf(stories260k)
    report = check_pair(stories, stories)
    assert report.ok
    assert report.warnings[0].startswith("the draft is not smaller than the target")


def test_stories260k_with_a_different_vocabulary(stories260k: Path, target_model: Path) -> None:
    report = check_pair(read_gguf(stories260k), read_gguf(target_model))
    assert report.problems[0] == (
        f"vocabulary sizes differ: target has 512 tokens, draft has 495; {SAME_FAMILY}"
    )
    assert report.problems[1].startswith("token texts differ at ")
