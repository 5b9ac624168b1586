"""Can a draft model be paired with a target model for speculative decoding, and how?

Any two complete models can: where their vocabularies differ, drafts are translated
(see translate.py). Whether they share one follows llama.cpp's
common_speculative_are_compatible (common/speculative.cpp): the same vocabulary type,
the same add-BOS/add-EOS flags and, where a flag is set, the same token for it, sizes
within 128 tokens, and the same token text from id 5 on. Where it refuses, specdec
translates, and says why. The differences it lets through are reported as warnings:
the target checks every drafted token and decides when generation ends, so they can only
cost acceptance, never change the output. A file without a model or a vocabulary is
refused.

The tokenizer facts come from llama.cpp itself (a vocabulary-only load); the token texts
from the file's header, which is what llama.cpp loads them from (tokenizer.ggml.tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import VocabInfo, read_vocab
from specdec_cli.models.gguf_meta import GGUFFile, read_gguf

MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_ID = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
_TOKEN_TYPE_UNUSED = 5  # tokenizer.ggml.token_type value of padding placeholders
# Placeholder texts that converters and tokenizers use for padding or never-used slots:
# [PAD123], <pad>, <unused12>, <|reserved_special_token_5|>, <extra_id_3>, [unused7]...
_PADDING_TEXT = re.compile(
    r"\[PAD\d*\]|\[unused\d*\]|<\|?(pad|unused|reserved|extra|dummy)[\w-]*\|?>",
    re.IGNORECASE,
)
_MAX_EXAMPLES = 3


@dataclass(frozen=True)
class ModelFacts:
    """What pairing needs to know of one model file: its header, and its vocabulary as
    llama.cpp reads it (None when the file has no vocabulary to read)."""

    file: GGUFFile
    vocab: VocabInfo | None

    @property
    def path(self) -> Path:
        return self.file.path


def read_facts(path: Path, need_vocab: bool = True) -> ModelFacts:
    """Read a model file's header, then its vocabulary through llama.cpp (no weights).
    Without `need_vocab`, a vocabulary llama.cpp cannot load is left as None."""
    return facts_of(read_gguf(path), need_vocab)


def facts_of(file: GGUFFile, need_vocab: bool = True) -> ModelFacts:
    """A read header's facts, with its vocabulary as llama.cpp reads it: see read_facts."""
    if not file.tokens:
        return ModelFacts(file, None)
    try:
        return ModelFacts(file, read_vocab(file.path))
    except UserError:
        if need_vocab:
            raise
        return ModelFacts(file, None)


@dataclass
class CompatReport:
    """Problems make the pair unusable; differences between the vocabularies make its
    drafts translated; warnings are worth knowing but not blocking."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def translated(self) -> bool:
        return bool(self.differences)

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "vocabulary": "translated" if self.translated else "same",
            "problems": list(self.problems),
            "differences": list(self.differences),
            "warnings": list(self.warnings),
        }


def vocab_only_message(file: GGUFFile) -> str:
    return (
        f"{file.path.name} has no weights: it is a vocabulary-only file (a tokenizer without "
        "a model); pass a complete model file"
    )


def is_padding_token(text: str, token_type: int | None) -> bool:
    """True for a vocabulary slot that only pads the table and is never produced."""
    return token_type == _TOKEN_TYPE_UNUSED or _PADDING_TEXT.fullmatch(text) is not None


def _check_vocab_size(target: ModelFacts, draft: ModelFacts, report: CompatReport) -> None:
    n_target, n_draft = len(target.file.tokens), len(draft.file.tokens)
    if n_target == n_draft:
        return
    sizes = f"target has {n_target} tokens, draft has {n_draft}"
    difference = abs(n_target - n_draft)
    if difference > MAX_SIZE_DIFFERENCE:
        report.problems.append(
            f"vocabulary sizes differ by {difference} tokens ({sizes}), more than the "
            f"{MAX_SIZE_DIFFERENCE} llama.cpp allows"
        )
        return
    bigger_name, bigger = ("target", target.file) if n_target > n_draft else ("draft", draft.file)
    shared = min(n_target, n_draft)
    types = bigger.token_types
    extra_all_padding = all(
        is_padding_token(bigger.tokens[i], types[i] if i < len(types) else None)
        for i in range(shared, len(bigger.tokens))
    )
    if extra_all_padding:
        meaning = "padding (unused placeholders)"
    elif bigger_name == "target":
        meaning = "real tokens the draft never proposes (acceptance suffers where they occur)"
    else:
        meaning = "real tokens the target does not have, so the draft never proposes them"
    report.warnings.append(
        f"vocabulary sizes differ: {sizes}; the {difference} extra {bigger_name} tokens are "
        f"{meaning}; the first {shared} ids are compared"
    )


def _differing_ids(target: list[str], draft: list[str], start: int, stop: int) -> list[int]:
    if target[start:stop] == draft[start:stop]:  # the common case, at C speed
        return []
    return [i for i in range(start, stop) if target[i] != draft[i]]


def _examples(target: list[str], draft: list[str], ids: list[int]) -> str:
    return ", ".join(f"id {i}: {target[i]!r} vs {draft[i]!r}" for i in ids[:_MAX_EXAMPLES])


def _check_token_texts(target: ModelFacts, draft: ModelFacts, report: CompatReport) -> None:
    t_tokens, d_tokens = target.file.tokens, draft.file.tokens
    shared = min(len(t_tokens), len(d_tokens))
    checked = _differing_ids(t_tokens, d_tokens, FIRST_CHECKED_ID, shared)
    if checked:
        report.problems.append(
            f"token texts differ at {len(checked)} of {shared - FIRST_CHECKED_ID} ids from "
            f"{FIRST_CHECKED_ID} on (target vs draft, e.g. "
            f"{_examples(t_tokens, d_tokens, checked)})"
        )
    first = _differing_ids(t_tokens, d_tokens, 0, min(FIRST_CHECKED_ID, shared))
    if first:
        report.warnings.append(
            f"token texts differ below id {FIRST_CHECKED_ID}, which llama.cpp does not compare "
            f"(target vs draft: {_examples(t_tokens, d_tokens, first)}); the draft's guesses "
            "of these tokens will be rejected"
        )


def _id_text(token_id: int | None) -> str:
    return "none" if token_id is None else str(token_id)


def _check_special_tokens(target: VocabInfo, draft: VocabInfo, report: CompatReport) -> None:
    for name, t_id, d_id, t_add, d_add in (
        ("BOS", target.bos, draft.bos, target.add_bos, draft.add_bos),
        ("EOS", target.eos, draft.eos, target.add_eos, draft.add_eos),
    ):
        if t_add != d_add:
            target_does = "adds" if t_add else "does not add"
            draft_does = "does" if d_add else "does not"
            report.problems.append(
                f"{name} handling differs: the target {target_does} {name} to prompts, "
                f"the draft {draft_does}"
            )
        elif t_id != d_id:
            ids = f"target uses {_id_text(t_id)}, draft uses {_id_text(d_id)}"
            if t_add:
                report.problems.append(f"{name} token ids differ: {ids}")
            else:  # never added to a prompt: the target alone decides where text starts and ends
                report.warnings.append(
                    f"{name} token ids differ ({ids}); the target decides where generation "
                    "ends, so only acceptance can suffer"
                )


def check_pair(target: ModelFacts, draft: ModelFacts) -> CompatReport:
    """Report whether draft can propose tokens for target (exactly why not), and whether
    through the target's own vocabulary or translated (exactly why)."""
    report = CompatReport()
    for role, model in (("target", target), ("draft", draft)):
        if model.vocab is None:
            report.problems.append(
                f"the {role} model {model.path} has no vocabulary (no tokenizer.ggml.tokens); "
                "use a complete GGUF model file"
            )
        elif model.file.vocab_only:
            report.problems.append(f"the {role} {vocab_only_message(model.file)}")
    if target.vocab is None or draft.vocab is None:
        return report
    vocabulary = same_vocabulary(target, draft)
    report.differences = vocabulary.problems
    if not vocabulary.problems:  # translated, the vocabularies' details do not matter
        report.warnings += vocabulary.warnings
    if target.file.n_params and draft.file.n_params >= target.file.n_params:
        report.warnings.append(
            f"the draft is not smaller than the target ({draft.file.n_params:,} vs "
            f"{target.file.n_params:,} parameters), so drafting with it is unlikely to pay (the "
            "n-gram lookup still may); pick a much smaller draft"
        )
    return report


def same_vocabulary(target: ModelFacts, draft: ModelFacts) -> CompatReport:
    """llama.cpp's rules for a draft of the target's own vocabulary: its problems are
    why the two differ."""
    assert target.vocab is not None and draft.vocab is not None
    report = CompatReport()
    if target.vocab.vocab_type != draft.vocab.vocab_type:
        report.problems.append(
            f"vocabulary types differ: target uses {_type_text(target)}, draft uses "
            f"{_type_text(draft)}"
        )
    _check_special_tokens(target.vocab, draft.vocab, report)
    _check_vocab_size(target, draft, report)
    _check_token_texts(target, draft, report)
    return report


def _type_text(model: ModelFacts) -> str:
    """llama.cpp's vocabulary type, with the file's tokenizer name: BPE (gpt2)."""
    return f"{model.vocab.vocab_type} ({model.file.vocab_type})"
