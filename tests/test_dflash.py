"""DFlash drafting (`-d DFLASH.gguf`): a block drafter that reads the target's layer
inputs through its cache and drafts a whole chain in one decode. The output is the
target's alone, token for token and in distribution; its drafts are what its tables
say, and what llama.cpp's own driver drafts on the same files."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import MODERATE_COSTS, TARGET_HPARAMS, pin_costs
from ggufgen import (
    Eagle3KnownAnswer,
    spm_vocab,
    write_dflash_known_answer,
    write_random_dflash,
)
from test_cli_run import specdec
from test_decode import PROMPT, SAMPLING
from test_heads import (
    accepts_nothing_without_states,
    assert_sampled_like_the_target,
    eagle3_drafts,
    expected_rounds,
    generate,
    llama_cpp_counts,
    llama_cpp_rounds,
    open_with_head_file,
    run_in_slots,
    serve_two_at_once,
)

from specdec_cli.decoding.heads import BlockDrafter
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.llamacpp.heads import DFlashHead
from specdec_cli.llamacpp.hiddenstates import record_hidden_states
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams

N_PREDICT = 48


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """A one-hot llama target writing a cycle, and a DFlash file whose every row drafts
    the answer for the token before the last (see ggufgen.write_dflash_known_answer)."""
    return write_dflash_known_answer(tmp_path_factory.mktemp("dflash"), spm_vocab(), seed=7)


@pytest.fixture(scope="module")
def tempered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """The same kind of pair, its target repeating one token (every row's draft can then
    be right, the deepest too), with softened outputs: the right token's logit 5 over
    noise."""
    folder = tmp_path_factory.mktemp("dflash-tempered")
    return write_dflash_known_answer(folder, spm_vocab(), seed=7, temper=5.0, cycle=1)


@pytest.fixture(scope="module")
def random_dflash(tmp_path_factory: pytest.TempPathFactory, target_model: Path) -> Path:
    """Random weights for the test target, reading the inputs of its layers 1 and 3."""
    path = tmp_path_factory.mktemp("dflash-random") / "dflash.gguf"
    return write_random_dflash(path, spm_vocab(), TARGET_HPARAMS, [1, 3], seed=11)


def the_cycle(ka: Eagle3KnownAnswer, prompt: list[int], out: list[int]) -> bool:
    tokens = [*prompt, *out]
    return all(ka.succ[a] == b for a, b in zip(tokens[len(prompt) - 1 :], out, strict=False))


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_dflash_drafts_what_its_tables_say(known, k, monkeypatch) -> None:
    """The output is the target's cycle, and its drafts are accepted; at a fixed k exactly
    as the tables say: the right layer inputs reach the right positions of its cache. -k
    auto prices with pinned costs: on this tiny target a head call costs more than a
    target token, and whether drafting pays there at all turns on the measurement's noise."""
    target, head, ka = known
    if k == "auto":
        pin_costs(monkeypatch, MODERATE_COSTS)
    with open_with_head_file(target, head, k) as engine:
        assert isinstance(engine.decoder.drafter, BlockDrafter)
        prompt = engine.tokenize(PROMPT)
        out, stats = generate(engine, n=N_PREDICT)
    assert the_cycle(ka, prompt, out)
    assert 0 < stats.accepted < stats.drafted
    if k != "auto":
        drafts = partial(eagle3_drafts, ka)
        assert (stats.drafted, stats.accepted) == expected_rounds(
            ka.succ, drafts, prompt, N_PREDICT, k, stats
        )


def test_dflash_without_the_targets_states_accepts_nothing(known, monkeypatch) -> None:
    """The control: with zeros for the target's layer inputs, the masks copy nothing."""
    target, head, _ = known
    accepts_nothing_without_states(target, head, 3, monkeypatch)


@pytest.mark.parametrize("k", [1, 3])
def test_llama_cpp_dflash_accepts_what_the_tables_say_too(known, k: int) -> None:
    """llama.cpp's own DFlash driver on the same files drafts what the tables say (and so
    what specdec drafts: the test above)."""
    target, head, ka = known
    counts = llama_cpp_counts(target, k, "--spec-type", "draft-dflash", "-md", str(head))
    with open_with_head_file(target, head, k) as engine:
        prompt = engine.tokenize(PROMPT)
    assert counts == llama_cpp_rounds(ka.succ, partial(eagle3_drafts, ka), prompt, N_PREDICT, k)


def test_dflash_in_four_slots(known) -> None:
    """Four generations at once, one DFlash context for all (their blocks decoded in one
    call), started at different times: each is the cycle, drafted as its tables say."""
    target, head, ka = known
    with open_with_head_file(target, head, 3, parallel=4, n_ctx=1024) as engine:
        prompt = engine.tokenize(PROMPT)
        outs, runs = run_in_slots(engine, [N_PREDICT - 4 * slot for slot in range(4)])
    for slot, (out, run) in enumerate(zip(outs, runs, strict=True)):
        n = N_PREDICT - 4 * slot
        assert len(out) == n and the_cycle(ka, prompt, out)
        expected = expected_rounds(ka.succ, partial(eagle3_drafts, ka), prompt, n, 3, run.stats)
        assert (run.stats.drafted, run.stats.accepted) == expected


def test_greedy_random_dflash_equal_to_target(target_model: Path, random_dflash: Path) -> None:
    """Random weights on the random test target: the text is the target's alone."""
    with open_with_head_file(target_model, random_dflash, 4, sampling=GREEDY) as engine:
        reference = generate(engine, engine.make_decoder(None, "1"), n=N_PREDICT)[0]
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.proposed_by["dflash"] > 0


class _FreshPair:
    """A target and a DFlash context fed a history from scratch."""

    def __init__(self, target: Path, head: Path) -> None:
        self.model = Model(target, ModelParams())
        self.head_model = Model(head, ModelParams())
        self.target = Context(self.model, ContextParams(256, 1, "off"))
        self.states = record_hidden_states(self.target, [1, 3])
        self.head = DFlashHead(self.target, 1, self.head_model, 16)

    def block_logits_after(self, tokens: list[int], k: int) -> list[np.ndarray]:
        self.target.decode(tokens[:-1], 0)
        self.head.inject(tokens[:-1], self.states.after(0, len(tokens) - 1))
        self.head.stage_block(tokens[-1], k)
        self.head.flush()
        return [self.head.logits(i).copy() for i in range(1, k + 1)]

    def close(self) -> None:
        for owned in (self.head, self.target, self.head_model, self.model):
            owned.close()


def test_after_a_partial_acceptance_dflash_drafts_as_fresh_contexts(
    target_model: Path, random_dflash: Path
) -> None:
    """At each round of a greedy k=4 generation, the block's logits equal those of a fresh
    target and DFlash context fed the accepted text at once (no rejected row's keys,
    no earlier block, left in its cache)."""
    seen: list[tuple[list[int], list[np.ndarray]]] = []
    original = BlockDrafter.drafting

    def drafting(self, request):
        draft = yield from original(self, request)
        rows = [self.head.logits(i).copy() for i in range(1, 5)] if request.k == 4 else []
        seen.append((list(request.tokens), rows))
        return draft

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockDrafter, "drafting", drafting)
        with open_with_head_file(target_model, random_dflash, 4) as engine:
            stats = generate(engine, n=40)[1]
    assert stats.drafted > 0
    fresh = _FreshPair(target_model, random_dflash)
    try:
        checked = 0
        for tokens, rows in seen[1:]:
            if not rows:
                continue
            fresh.target.rewind(0)
            fresh.head.rewind(0)
            fresh.head.drop_block()
            for got, expected in zip(rows, fresh.block_logits_after(tokens, 4), strict=True):
                # The cache's keys came in other batch shapes: float noise alone.
                np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
            checked += 1
    finally:
        fresh.close()
    assert checked > 5


N_RUNS = 600  # the control fails at p about 1e-5 here: a wide model is slow
K_SAMPLED = 4  # the block's rows the sampled test drafts with


class _GreedyButSaysSampled(BlockDrafter):
    """The negative control, from the block's third row on: tells the verifier each row's
    q, but drafts its likeliest token, not one drawn from it (as if the rows' argmax,
    which llama.cpp drafts, could stand for a sample)."""

    def children(self, logits, rng, n, need_confidence, position=0, path=()):
        ids, probs, dists = super().children(logits, rng, n, need_confidence, position, path)
        if len(path) < 2:
            return ids, probs, dists
        return [int(dists[0].ids[np.argmax(dists[0].probs)])], probs, dists


def test_sampled_dflash_matches_target_distribution(tempered) -> None:
    """The first tokens of many seeded runs, DFlash-drafted (rows accepted at every
    depth) against target-only; the negative control (drafts from the third row on not
    drawn from the q the verifier is told) must be told apart."""
    target, head, _ = tempered
    with open_with_head_file(target, head, K_SAMPLED, sampling=SAMPLING) as engine:
        assert_sampled_like_the_target(engine, _GreedyButSaysSampled, N_RUNS, n_first=K_SAMPLED + 2)


def test_check_and_info_say_what_dflash_reads(known, target_model: Path) -> None:
    target, head, _ = known
    fits = specdec("check", "-m", str(target), "-d", str(head), "--json")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    record = json.loads(fits.stdout)
    assert (record["method"], record["reads_layers"], record["problem"]) == ("dflash", [0, 1], None)
    refused = specdec("run", "-m", str(target_model), "-d", str(head), "-p", "Once", "-n", "4")
    assert refused.returncode == 2
    assert "was made for a hidden size of 1024, target.gguf's is 64" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_dflash_file_without_a_mask_token_is_refused(known, tmp_path: Path) -> None:
    """llama.cpp would decode token -1: refused in one line, before anything loads."""
    from ggufgen import read_f32_model, write_gguf

    target, head, _ = known
    metadata, tensors = read_f32_model(head)
    del metadata["tokenizer.ggml.mask_token_id"]
    maskless = write_gguf(tmp_path / "maskless.gguf", metadata, tensors)
    result = specdec("run", "-m", str(target), "-d", str(maskless), "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert "has no mask token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_auto_prices_a_dflash_round_as_one_call(known) -> None:
    """-k auto: a DFlash round's drafting costs one call whatever its length (a draft
    model's, one call a token)."""
    from specdec_cli.decoding.costmodel import Costs
    from specdec_cli.decoding.draftlength import RoundCosts

    target, head, _ = known
    costs = Costs(0.01, 0.5, {n: 1.0 + 0.1 * n for n in range(1, 17)})
    with open_with_head_file(target, head, "auto") as engine:
        block = RoundCosts(engine.policy._costs_for("dflash+ngram", costs)[0])
        chain = RoundCosts(engine.policy._costs_for("model", costs)[0])
    drafting = [
        block.of(k) - block.of(0) - 0.01 * (costs.verify[k + 1] - costs.verify[1]) for k in (1, 8)
    ]
    assert drafting == pytest.approx([0.005, 0.005])
    assert chain.of(8) - chain.of(1) > 7 * 0.005


def test_serve_drafts_with_dflash_in_two_slots(known, tmp_path: Path) -> None:
    """`specdec serve -d DFLASH.gguf -np 2`: two requests at once, one DFlash context for
    both; each text is the target's cycle, and drafts were accepted."""
    target, head, ka = known
    texts, accepted = serve_two_at_once(tmp_path, "-m", str(target), "-d", str(head))
    with open_with_head_file(target, head, 3) as engine:
        prompt = engine.tokenize(PROMPT)
        cycle = [int(ka.succ[prompt[-1]])]
        while len(cycle) < 24:
            cycle.append(int(ka.succ[cycle[-1]]))
        expected = b"".join(engine.model.piece(t) for t in cycle).decode()
    assert texts == [expected, expected]
    assert accepted > 0
