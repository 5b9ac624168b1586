"""Recurrent and hybrid models: a rejected draft must leave no trace in their state.

llama.cpp cannot cut a recurrent state back to an earlier position. specdec saves it
before each verification (or uses llama.cpp's own snapshots, where the family has
them) and goes back to it when a draft is rejected; these tests hold the output to
the target alone, token for token and in distribution.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from test_decode import (
    N_FIRST,
    SAMPLING,
    contingency,
    first_tokens,
    generate,
    open_engine,
    target_only,
)

from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model

K_VALUES = [1, 3, 8, "auto"]
FAMILIES = ["mamba", "hybrid"]


@pytest.fixture(scope="module")
def pairs(
    mamba_pair: tuple[Path, Path], hybrid_pair: tuple[Path, Path]
) -> dict[str, tuple[Path, Path]]:
    return {"mamba": mamba_pair, "hybrid": hybrid_pair}


@pytest.fixture(scope="module")
def references(pairs: dict[str, tuple[Path, Path]]) -> dict[str, list[int]]:
    return {family: target_only(target) for family, (target, _) in pairs.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_recurrent_draft_equal_to_target(
    pairs, references, family: str, k, moderate_costs: None
) -> None:
    """Costs pinned where drafting pays, so that -k auto drafts (and has drafts rejected)
    whatever this machine's curve for these tiny recurrent models."""
    target, draft = pairs[family]
    with open_engine(target, draft, k) as engine:
        out, stats = generate(engine)
    assert out == references[family]
    assert 0.0 < stats.acceptance_rate < 1.0  # drafts were rejected, and kept


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_recurrent_target_with_lookup_and_attention_draft(
    pairs, references, target_model: Path, family: str
) -> None:
    """An attention-only draft, and n-gram lookup, in front of a recurrent target."""
    target, _ = pairs[family]
    for draft in (target_model, "ngram"):
        with open_engine(target, draft, 3) as engine:
            out, stats = generate(engine)
        assert out == references[family]
        assert stats.drafted > 0


def test_greedy_recurrent_draft_for_attention_target(
    target_model: Path, mamba_pair: tuple[Path, Path]
) -> None:
    """The draft alone is recurrent: its own rejected tokens must be undone."""
    with open_engine(target_model, mamba_pair[1], 4) as engine:
        out, stats = generate(engine)
    assert out == target_only(target_model)
    assert stats.drafted > 0


def test_snapshots_where_llama_cpp_has_them(pairs) -> None:
    """LFM2 gets llama.cpp's recurrent snapshots; Mamba has none and uses checkpoints."""
    for family, expected in (("hybrid", True), ("mamba", False)):
        target, draft = pairs[family]
        with open_engine(target, draft, 4) as engine:
            assert (engine.target.n_rs_seq > 0) == expected
            assert engine.draft_ctx is not None and engine.draft_ctx.n_rs_seq == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_rewind_without_checkpoint_is_an_error_naming_the_model(pairs, family: str) -> None:
    target, _ = pairs[family]
    model = Model(target)
    ctx = Context(model, ContextParams(n_ctx=64, n_threads=1))
    try:
        ctx.decode([model.bos, 5, 6, 7], 0)
        with pytest.raises(RuntimeError, match=f"{target.name} is recurrent"):
            ctx.rewind(2)
    finally:
        ctx.close()
        model.close()


def logits_after(ctx: Context, tokens: list[int]) -> np.ndarray:
    ctx.rewind(0)
    ctx.decode(tokens, 0)
    return ctx.logits(-1).copy()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_rs_seq", [0, 4])
def test_rewind_leaves_no_trace_of_dropped_tokens(pairs, family: str, n_rs_seq: int) -> None:
    """bos 5 6, then a draft 7 8 9 of which only 7 is kept, then 10: the logits are
    those of bos 5 6 7 10 evaluated from scratch (snapshots or a checkpoint)."""
    target, _ = pairs[family]
    model = Model(target)
    ctx = Context(model, ContextParams(n_ctx=64, n_threads=1, n_rs_seq=n_rs_seq))
    try:
        expected = logits_after(ctx, [model.bos, 5, 6, 7, 10])
        logits_after(ctx, [model.bos, 5])
        ctx.checkpoint(3)
        ctx.decode([6, 7, 8, 9], 2, n_logits=4)
        kept = ctx.rewind(4)
        assert kept == (4 if ctx.n_rs_seq else 2)
        ctx.decode([model.bos, 5, 6, 7, 10][kept:], kept)
        np.testing.assert_allclose(ctx.logits(-1), expected, rtol=1e-4, atol=1e-4)
    finally:
        ctx.close()
        model.close()


N_RUNS = 1500


@pytest.mark.parametrize("target_family", FAMILIES)
def test_sampling_recurrent_matches_target_distribution(pairs, target_family: str) -> None:
    """First tokens of many seeded runs, speculative vs target-only; and a negative
    control: the draft's own distribution must be told apart from the target's."""
    target, draft = pairs[target_family]
    with open_engine(target, draft, 3, SAMPLING) as engine:
        baseline = first_tokens(engine, range(N_RUNS), engine.make_decoder(None, "1"))
        speculative = first_tokens(engine, range(N_RUNS, 2 * N_RUNS))
    with open_engine(draft, sampling=SAMPLING) as engine:
        draft_alone = first_tokens(engine, range(N_RUNS))
    for position in range(N_FIRST):
        table = contingency(baseline[:, position], speculative[:, position])
        assert table.shape[1] > 3  # a real distribution, not one forced token
        assert chi2_contingency(table).pvalue > 1e-3, f"token {position} differs"
    control = contingency(baseline[:, 0], draft_alone[:, 0])
    assert chi2_contingency(control).pvalue < 1e-3  # the test can tell models apart
