"""Chained MTP blocks (MiMo-V2, Step-3.5, Hunyuan v3, ...): block i drafts the (i + 1)-th
token. The output is the target's alone, token for token and in distribution; each block
reads the right states and its own cache; llama.cpp's own driver drafts the same."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from ggufgen import read_f32_model, spm_vocab, write_gguf, write_mtp_sidecar
from mimo2gen import ChainedKnownAnswer, write_chained_known_answer
from test_cli_run import specdec
from test_decode import PROMPT, SAMPLING
from test_heads import (
    _MislabelledHead,
    assert_a_long_prompt_drafts,
    assert_refused_in_one_line,
    assert_sampled_like_the_target,
    assert_served_in_two_slots,
    expected_rounds,
    generate,
    llama_cpp_counts,
    llama_cpp_rounds,
    open_engine,
    open_with_head_file,
    run_in_slots,
    without_target_states,
)

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.draftlength import RoundCosts
from specdec_cli.decoding.heads import ChainedHeadDrafter
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.heads import ChainedMtpHead
from specdec_cli.llamacpp.hiddenstates import record_hidden_states
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams

N_HEADS = 3


@pytest.fixture(scope="module")
def chained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ChainedKnownAnswer]:
    path = tmp_path_factory.mktemp("mimo2") / "mimo2-known-answer.gguf"
    return path, write_chained_known_answer(path, spm_vocab(), seed=3, n_heads=N_HEADS)


@pytest.fixture(scope="module")
def reference(chained) -> list[int]:
    with open_engine(chained[0], head=False) as engine:
        return generate(engine)[0]


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_acceptance_follows_from_the_tables(chained, k: int) -> None:
    """The target writes its cycle, and the blocks' drafts, one a block (k = 8 drafts 3),
    are accepted exactly as often as their tables say: each block reads the right state
    at the right row."""
    path, ka = chained
    with open_engine(path, k) as engine:
        assert isinstance(engine.decoder.drafter, ChainedHeadDrafter)
        prompt = engine.tokenize(PROMPT)
        out, stats = generate(engine, n=48)
    tokens = [*prompt, *out]
    assert all(ka.succ[a] == b for a, b in zip(tokens[len(prompt) - 1 :], out, strict=False))
    drafts = lambda text, n: ka.drafts(text, min(n, N_HEADS))  # noqa: E731
    assert (stats.drafted, stats.accepted) == expected_rounds(ka.succ, drafts, prompt, 48, k, stats)
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("k", [1, 3])
def test_llama_cpp_accepts_what_the_tables_say_too(chained, k: int) -> None:
    """llama.cpp's own driver (chain_heads) on the same file drafts what the tables say,
    and so what specdec drafts."""
    path, ka = chained
    counts = llama_cpp_counts(path, k, "--spec-type", "draft-mtp")
    with open_engine(path, k) as engine:
        prompt = engine.tokenize(PROMPT)
    assert counts == llama_cpp_rounds(ka.succ, ka.drafts, prompt, 48, k)


def test_without_the_targets_states_nothing_is_accepted(chained, monkeypatch) -> None:
    """The control: with zeros for the target's states, the decoy wins every first step."""
    without_target_states(monkeypatch)
    with open_engine(chained[0], 1) as engine:
        stats = generate(engine, n=32)[1]
    assert stats.drafted > 0 and stats.accepted == 0


@pytest.mark.usefixtures("moderate_costs")
def test_greedy_equal_to_target_with_the_lookup_and_auto(chained, reference: list[int]) -> None:
    with open_engine(chained[0], "auto", ngram=None) as engine:
        out, stats = generate(engine)
    assert out == reference
    assert stats.proposed_by["mtp"] > 0


def test_greedy_in_four_slots(chained, reference: list[int]) -> None:
    """Four generations at once, their rounds interleaved: one block's rows of every slot
    a call."""
    with open_engine(chained[0], 3, parallel=4) as engine:
        outs, runs = run_in_slots(engine, [48 - 4 * slot for slot in range(4)])
    for slot, out in enumerate(outs):
        assert out == reference[: 48 - 4 * slot]
    assert sum(g.stats.accepted for g in runs) > 0


def test_greedy_in_sixteen_slots_of_a_small_batch(chained, reference: list[int]) -> None:
    """-np 16 -b 32: a slot's share of a call (2 tokens) is less than its 3 blocks need, a
    sequence and a row each. Each slot's blocks keep sequences of their own (the head's
    sequences were capped at the batch, and a slot's last block wrote into the next
    slot's), and every text is the target's."""
    with open_engine(chained[0], 3, parallel=16, n_batch=32) as engine:
        outs, runs = run_in_slots(engine, [24 - slot for slot in range(16)])
    for slot, out in enumerate(outs):
        assert out == reference[: 24 - slot]
    assert sum(g.stats.accepted for g in runs) > 0


def test_more_sequences_than_llama_cpp_holds_are_refused(tmp_path: Path) -> None:
    """64 slots of 5 chained blocks need 320 sequences, llama.cpp holds 256: one line."""
    path = tmp_path / "mimo2-five.gguf"
    write_chained_known_answer(path, spm_vocab(), seed=3, n_heads=5)
    with pytest.raises(UserError, match="-np 64: the drafting head needs 5 sequences a slot, "):
        open_engine(path, 3, parallel=64)


@contextmanager
def block_logits() -> Iterator[list[tuple[list[int], list[int], np.ndarray]]]:
    """While in it, every draft step of a ChainedHeadDrafter records the round's text,
    the drafts before the step, and the step's logits."""
    seen: list[tuple[list[int], list[int], np.ndarray]] = []
    original_take, original_drafting = ChainedHeadDrafter.take_next, ChainedHeadDrafter.drafting

    def take(self, draft, logits, *rest):
        seen.append((self._text, list(draft.tokens), logits.copy()))
        return original_take(self, draft, logits, *rest)

    def drafting(self, request):
        self._text = list(request.tokens)
        return original_drafting(self, request)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ChainedHeadDrafter, "take_next", take)
        mp.setattr(ChainedHeadDrafter, "drafting", drafting)
        yield seen


@contextmanager
def fresh_head(path: Path, text: list[int]) -> Iterator[tuple[ChainedMtpHead, np.ndarray]]:
    """A fresh head context and the states a fresh target gave for `text` (it read all
    but the last token, as in a round)."""
    model = Model(path, ModelParams(load_mtp=True))
    target = Context(model, ContextParams(256, 1, "off"))
    head = ChainedMtpHead(target, 1)
    try:
        states = record_hidden_states(target)
        target.decode(text[:-1], 0)
        yield head, states.after(-1, len(text) - 1)
    finally:
        head.close()
        target.close()
        model.close()


def fresh_block_logits(path: Path, text: list[int], drafts: list[int]) -> np.ndarray:
    """Block len(drafts)'s logits drafting after text + drafts, from fresh contexts: each
    block before it fed the text and the drafts before its own."""
    with fresh_head(path, text) as (head, states):
        read = [states]
        for block in range(len(drafts) + 1):
            head.stage_head(block, text + drafts[:block], 0, np.concatenate(read))
            head.flush()
            read.append(head.hidden().copy())
        return head.logits().copy()


def test_after_partial_acceptances_each_block_drafts_as_fresh_contexts(chained) -> None:
    """Every draft step of a greedy generation: the block's logits equal those of fresh
    contexts fed the accepted text and the drafts before it. Each block's attention reads
    its own cache (a little): one reading another's, or rows a rollback left, differs."""
    path = chained[0]
    with block_logits() as seen, open_engine(path, 3) as engine:
        stats = generate(engine, n=40)[1]
    assert 0 < stats.accepted < stats.drafted
    assert {len(drafts) for _, drafts, _ in seen} == {0, 1, 2}
    for text, drafts, logits in seen:
        expected = fresh_block_logits(path, text, drafts)
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_block_that_skips_its_catch_up_is_caught(chained) -> None:
    """The control for the test above: block 1 drafting over cells only block 0 filled
    (it read the text's last token alone) gives other logits than fresh contexts."""
    path, ka = chained
    with open_engine(path, head=False) as engine:
        text = [*engine.tokenize(PROMPT), *generate(engine, n=12)[0]]
    first = int(ka.answers[0, text[-2]])
    expected = fresh_block_logits(path, text, [first])
    with fresh_head(path, text) as (head, read):
        head.stage_head(0, text, 0, read)
        head.flush()
        last = len(text) - 1
        mixed = np.concatenate([read[last:], head.hidden()])
        head.forget_head(0, last)
        head.stage_head(0, [text[-1], first], last, mixed)
        head._shared.head = 1  # decoded by block 1, over block 0's sequence
        head.flush()
        wrong = head.logits().copy()
    assert np.abs(wrong - expected).max() > 1e-3


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of model, its answers spread over many tokens (for sampling)."""
    path = tmp_path_factory.mktemp("mimo2-spread") / "mimo2-spread.gguf"
    write_chained_known_answer(path, spm_vocab(), seed=4, n_heads=N_HEADS, temper=7.0)
    return path


class _MislabelledChain(_MislabelledHead, ChainedHeadDrafter):
    """The negative control: its last block draws from its q and tells the verifier
    another (the blocks before it are right)."""

    from_depth = N_HEADS - 1


def test_sampled_chain_matches_target_distribution(spread: Path) -> None:
    """The first tokens of many seeded runs, each block drafting (the last one the fourth
    token), against target-only; the negative control, wrong in its last block alone,
    must be told apart."""
    with open_engine(spread, N_HEADS, SAMPLING) as engine:
        assert isinstance(engine.decoder.drafter, ChainedHeadDrafter)
        assert_sampled_like_the_target(engine, _MislabelledChain, n_first=N_HEADS + 2)


def test_a_sidecar_of_other_blocks_is_refused(chained, reference, tmp_path: Path) -> None:
    """The blocks alone in a sidecar draft as the model's own. One missing its first block
    (llama.cpp then took every block for optional and aborted at the first draft), or
    holding the blocks of a model of other depth, is refused in one line, before
    anything loads."""
    path = chained[0]
    sidecar = write_mtp_sidecar(tmp_path / "mtp.gguf", path)
    with open_with_head_file(path, sidecar, 3) as engine:
        assert isinstance(engine.decoder.drafter, ChainedHeadDrafter)
        out, stats = generate(engine, n=24)
    assert out == reference[:24] and stats.accepted > 0
    metadata, tensors = read_f32_model(sidecar)
    first_gone = {name: w for name, w in tensors.items() if not name.startswith("blk.2.")}
    missing = write_gguf(tmp_path / "missing.gguf", metadata, first_gone)
    assert_refused_in_one_line(path, missing, "missing.gguf has no MTP block 2")
    deeper = tmp_path / "deeper.gguf"
    write_chained_known_answer(deeper, spm_vocab(), seed=3, n_heads=N_HEADS, n_layer=3)
    other = write_mtp_sidecar(tmp_path / "other.gguf", deeper)
    message = f"other.gguf is the MTP of a model of 3 layers, {path.name} has 2"
    assert_refused_in_one_line(path, other, message)


def test_info_check_and_a_tree_refused(chained) -> None:
    path = str(chained[0])
    info = specdec("info", path)
    assert info.returncode == 0, info.stderr
    assert "MTP, 3 block(s) (2, 3, 4), chained, one a draft step," in info.stdout
    check = specdec("check", "-m", path, "-d", "mtp", "--json")
    assert check.returncode == 0, check.stderr
    assert '"heads": 3' in check.stdout
    tree = specdec("run", "-m", path, "--tree", "8", "-p", "Once", "-n", "4")
    assert tree.returncode == 2
    assert "3 chained MTP blocks draft chains; use --tree off" in tree.stderr
    assert len(tree.stderr.strip().splitlines()) == 1


def test_a_text_near_the_context_size(chained, reference: list[int]) -> None:
    """Each block's sequence holds the whole text: their cache has room for every block's
    (a bug once: it had the target's size, shared by three sequences)."""
    with open_engine(chained[0], 3) as engine:  # a context of 256 tokens
        n = 256 - len(engine.tokenize(PROMPT)) - 8
        out, stats = generate(engine, n=n)
    with open_engine(chained[0], head=False) as engine:
        assert out == generate(engine, n=n)[0]
    assert stats.accepted > 0


def test_auto_prices_a_round_as_a_call_a_block(chained) -> None:
    """-k auto: a round's drafting costs a call a block whatever its length (each block
    catches up every round), and no longer a draft than there are blocks is planned."""
    costs = Costs(0.01, 0.5, {n: 1.0 + 0.1 * n for n in range(1, 17)})
    with open_engine(chained[0], "auto") as engine:
        chained_round = RoundCosts(engine.policy._costs_for("mtp+ngram", costs)[0])
        assert engine.policy.draft_length("mtp", "auto", costs).k_max == N_HEADS
    drafting = [
        chained_round.of(k) - chained_round.of(0) - 0.01 * (costs.verify[k + 1] - costs.verify[1])
        for k in (1, 3)
    ]
    assert drafting == pytest.approx([N_HEADS * 0.005] * 2)


def test_a_prompt_longer_than_a_call_holds(chained) -> None:
    """A prompt the blocks cannot read in one staged call goes in before the round's
    first call, every block's, a batch at a time."""
    path = chained[0]
    assert_a_long_prompt_drafts(path, lambda: open_engine(path, 3, n_batch=32))


def test_serve_drafts_with_the_blocks_in_two_slots(chained, reference, tmp_path: Path) -> None:
    """Two requests at once through `specdec serve -np 2`: one block's rows of both slots
    a call; each text is the target's own."""
    assert_served_in_two_slots(tmp_path, chained[0], reference)
