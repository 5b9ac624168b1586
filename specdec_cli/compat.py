"""Can a draft model be paired with a target model for speculative decoding?

The target verifies token ids the draft proposes, so both must give every id the same
meaning. This follows llama.cpp's common_speculative_are_compatible (common/speculative.cpp)
but is stricter: it compares every shared token, not just those from id 5 on, and accepts a
size difference only when the extra tokens are padding, whatever their number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specdec_cli.gguf_meta import GGUFFile

SAME_FAMILY = "the draft must use the target's tokenizer (same model family)"
_TOKEN_TYPE_UNUSED = 5  # tokenizer.ggml.token_type value of padding placeholders
# Placeholder texts that converters and tokenizers use for padding or never-used slots:
# [PAD123], <pad>, <unused12>, <|reserved_special_token_5|>, <extra_id_3>, [unused7]...
_PADDING_TEXT = re.compile(
    r"\[PAD\d*\]|\[unused\d*\]|<\|?(pad|unused|reserved|extra|dummy)[\w-]*\|?>",
    re.IGNORECASE,
)
_MAX_EXAMPLES = 3


@dataclass
class CompatReport:
    """Problems make the pair unusable; warnings are worth knowing but not blocking."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "problems": list(self.problems), "warnings": list(self.warnings)}


def is_padding_token(text: str, token_type: int | None) -> bool:
    """True for a vocabulary slot that only pads the table and is never produced."""
    return token_type == _TOKEN_TYPE_UNUSED or _PADDING_TEXT.fullmatch(text) is not None


def _check_vocab_size(target: GGUFFile, draft: GGUFFile, report: CompatReport) -> None:
    n_target, n_draft = len(target.tokens), len(draft.tokens)
    if n_target == n_draft:
        return
    bigger_name, bigger = ("target", target) if n_target > n_draft else ("draft", draft)
    shared = min(n_target, n_draft)
    types = bigger.token_types
    extra_all_padding = all(
        is_padding_token(bigger.tokens[i], types[i] if i < len(types) else None)
        for i in range(shared, len(bigger.tokens))
    )
    sizes = f"target has {n_target} tokens, draft has {n_draft}"
    if extra_all_padding:
        report.warnings.append(
            f"vocabulary sizes differ only by padding: {sizes}; the {abs(n_target - n_draft)} "
            f"extra {bigger_name} tokens are unused placeholders, so only the first {shared} "
            "ids are compared"
        )
    else:
        report.problems.append(f"vocabulary sizes differ: {sizes}; {SAME_FAMILY}")


def _check_token_texts(target: GGUFFile, draft: GGUFFile, report: CompatReport) -> None:
    shared = min(len(target.tokens), len(draft.tokens))
    target_tokens, draft_tokens = target.tokens[:shared], draft.tokens[:shared]
    if target_tokens == draft_tokens:  # the common case, at C speed
        return
    pairs = zip(target_tokens, draft_tokens, strict=True)
    differing = [i for i, (a, b) in enumerate(pairs) if a != b]
    examples = ", ".join(
        f"id {i}: {target_tokens[i]!r} vs {draft_tokens[i]!r}" for i in differing[:_MAX_EXAMPLES]
    )
    report.problems.append(
        f"token texts differ at {len(differing)} of {shared} shared ids "
        f"(target vs draft, e.g. {examples}); {SAME_FAMILY}"
    )


def _id_text(token_id: int | None) -> str:
    return "none" if token_id is None else str(token_id)


def _check_special_tokens(target: GGUFFile, draft: GGUFFile, report: CompatReport) -> None:
    for name, t_id, d_id, t_add, d_add in (
        ("BOS", target.bos_id, draft.bos_id, target.add_bos, draft.add_bos),
        ("EOS", target.eos_id, draft.eos_id, target.add_eos, draft.add_eos),
    ):
        if t_id != d_id:
            report.problems.append(
                f"{name} token ids differ: target uses {_id_text(t_id)}, "
                f"draft uses {_id_text(d_id)}; {SAME_FAMILY}"
            )
        if t_add != d_add:
            target_does = "adds" if t_add else "does not add"
            draft_does = "does" if d_add else "does not"
            report.problems.append(
                f"{name} handling differs: the target {target_does} {name} to prompts, "
                f"the draft {draft_does}; {SAME_FAMILY}"
            )


def check_pair(target: GGUFFile, draft: GGUFFile) -> CompatReport:
    """Report whether draft can propose tokens for target, and exactly why not."""
    report = CompatReport()
    for role, model in (("target", target), ("draft", draft)):
        if not model.tokens:
            report.problems.append(
                f"the {role} model {model.path} has no vocabulary (no tokenizer.ggml.tokens); "
                "use a complete GGUF model file"
            )
    if not report.ok:
        return report
    if target.vocab_type != draft.vocab_type:
        report.problems.append(
            f"vocabulary types differ: target uses {target.vocab_type!r}, draft uses "
            f"{draft.vocab_type!r}; {SAME_FAMILY}"
        )
    _check_special_tokens(target, draft, report)
    _check_vocab_size(target, draft, report)
    _check_token_texts(target, draft, report)
    if target.n_params and draft.n_params >= target.n_params:
        report.warnings.append(
            f"the draft is not smaller than the target ({draft.n_params:,} vs {target.n_params:,} "
            "parameters), so speculative decoding will be slower than the target alone; "
            "pick a much smaller draft"
        )
    return report
