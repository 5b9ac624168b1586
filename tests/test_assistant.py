"""Drafting with a Gemma 4 assistant (`-d ASSISTANT.gguf`), a drafter whose memory is the
target's own cache: the output is the target's alone, token for token and in
distribution; its drafts follow from the known-answer pair's tables (gemma4gen), as
llama.cpp's own driver's do; it reads the target's state and the target's cache as it
stands after each round's rollback."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import pin_costs
from gemma4gen import AssistantKnownAnswer, write_assistant_known_answer
from ggufgen import spm_vocab
from test_cli_run import specdec
from test_decode import PROMPT, SAMPLING
from test_head_trees import FLAT_COSTS
from test_heads import (
    _MislabelledHead,
    assert_sampled_like_the_target,
    expected_rounds,
    first_step_logits,
    generate,
    llama_cpp_counts,
    llama_cpp_rounds,
    open_with_head_file,
    run_in_slots,
    without_target_states,
)

from specdec_cli.decoding.heads import AssistantDrafter
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.llamacpp.heads import AssistantHead
from specdec_cli.llamacpp.hiddenstates import record_hidden_states
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams

N_PREDICT = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, AssistantKnownAnswer]:
    """The known-answer pair: a round's first draft is right three times in four; where
    it is wrong, the assistant's second choice is right (a tree's branch)."""
    folder = tmp_path_factory.mktemp("gemma4")
    target, assistant = folder / "gemma4-target.gguf", folder / "gemma4-assistant.gguf"
    ka = write_assistant_known_answer(target, assistant, spm_vocab(), seed=7, second=0.8)
    return target, assistant, ka


def assistant_drafts(ka: AssistantKnownAnswer, tokens: list[int], k: int) -> list[int]:
    """Its greedy chain after `tokens`, from the tables: each step reads a token beside a
    state that stands for the token before it (the target's, then its own)."""
    if len(tokens) < 2:
        return []
    token, before, drafts = tokens[-1], tokens[-2], []
    for _ in range(k):
        draft = int(
            ka.succ[ka.succ[before]] if ka.good[before] else ka.succ[ka.succ[ka.succ[before]]]
        )
        drafts.append(draft)
        before, token = token, draft
    return drafts


@pytest.fixture(scope="module")
def reference(pair) -> list[int]:
    target, assistant, _ = pair
    with open_with_head_file(target, assistant, 1, sampling=GREEDY) as engine:
        return generate(engine, engine.make_decoder(None, "1"), n=N_PREDICT)[0]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_assistant_drafts_what_its_tables_say(pair, reference: list[int], k: int) -> None:
    """The text is the target's alone, and the drafts accepted are those the tables give:
    the target's state reaches the first row, the assistant's own state each next one."""
    target, assistant, ka = pair
    with open_with_head_file(target, assistant, k, sampling=GREEDY) as engine:
        assert isinstance(engine.decoder.drafter, AssistantDrafter)
        prompt = engine.tokenize(PROMPT)
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert all(ka.succ[a] == b for a, b in zip([prompt[-1], *out], out, strict=False))
    expected = expected_rounds(ka.succ, partial(assistant_drafts, ka), prompt, N_PREDICT, k, stats)
    assert (stats.drafted, stats.accepted) == expected
    assert 0 < stats.accepted < stats.drafted
    assert stats.proposed_by["assistant"] == stats.drafted


def test_assistant_without_the_targets_states_accepts_nothing(pair, monkeypatch) -> None:
    """The control: zeros for the target's states, and the decoy wins every first step."""
    target, assistant, _ = pair
    without_target_states(monkeypatch)
    with open_with_head_file(target, assistant, 1, sampling=GREEDY) as engine:
        stats = generate(engine, n=32)[1]
    assert stats.drafted > 0 and stats.accepted == 0


@pytest.mark.parametrize("k", [1, 3])
def test_llama_cpp_drafts_what_the_tables_say_too(pair, k: int) -> None:
    """llama.cpp's own driver (`--spec-type draft-mtp -md ASSISTANT`) on the same files
    accepts what the tables say, and so what specdec accepts."""
    target, assistant, ka = pair
    counts = llama_cpp_counts(target, k, "--spec-type", "draft-mtp", "-md", str(assistant))
    with open_with_head_file(target, assistant, k) as engine:
        prompt = engine.tokenize(PROMPT)
    assert counts == llama_cpp_rounds(ka.succ, partial(assistant_drafts, ka), prompt, 48, k)


@pytest.mark.usefixtures("moderate_costs")
def test_greedy_assistant_with_the_lookup_and_k_auto(pair, reference: list[int]) -> None:
    target, assistant, _ = pair
    with open_with_head_file(target, assistant, "auto", ngram=None, sampling=GREEDY) as engine:
        assert engine.decoder.drafter.name == "assistant+ngram"
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.proposed_by["assistant"] > 0


@pytest.mark.parametrize("tree", ["auto", "16"])
def test_greedy_assistant_trees(pair, reference, monkeypatch: pytest.MonkeyPatch, tree) -> None:
    """Trees, fixed or priced on a curve where they pay: every node of a depth at the same
    position, beside its own parent's state. The text is the target's alone, and the
    second choices drafted beside the chain were taken where the first was wrong."""
    pin_costs(monkeypatch, FLAT_COSTS)
    target, assistant, _ = pair
    with open_with_head_file(target, assistant, 3, tree, sampling=GREEDY) as engine:
        assert engine.decoder.tree is not None
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.accepted_beside > 0


@pytest.mark.parametrize("tree", ["off", "16"])
def test_greedy_assistant_in_four_slots(pair, reference, monkeypatch, tree: str) -> None:
    """Four generations at once, one assistant context over the target's four sequences,
    started at different times: each slot reads its own sequence of the target's cache."""
    pin_costs(monkeypatch, FLAT_COSTS)
    target, assistant, _ = pair
    with open_with_head_file(
        target, assistant, 3, tree, sampling=GREEDY, parallel=4, n_ctx=1024
    ) as engine:
        outs, runs = run_in_slots(engine, [N_PREDICT - 4 * slot for slot in range(4)])
    for slot, out in enumerate(outs):
        assert out == reference[: N_PREDICT - 4 * slot]
    assert sum(g.stats.accepted for g in runs) > 0


class _FreshPair:
    """A target and its assistant, fed a history from scratch."""

    def __init__(self, target: Path, assistant: Path) -> None:
        self.models = [Model(target, ModelParams()), Model(assistant, ModelParams())]
        self.target = Context(self.models[0], ContextParams(256, 1, "off"))
        self.head = AssistantHead(self.target, 1, self.models[1])
        self.states = record_hidden_states(self.target)

    def logits_after(self, tokens: list[int]) -> np.ndarray:
        """The assistant's logits for the token after `tokens` (the target has read all
        but the last, as in a round)."""
        self.target.rewind(0)
        self.target.decode(tokens[:-1], 0)
        last = len(tokens) - 1
        self.head.stage_at(tokens[-1:], last, self.states.after(last - 1, last))
        self.head.flush()
        return self.head.logits().copy()

    def close(self) -> None:
        self.head.close()
        self.target.close()
        for model in self.models:
            model.close()


def test_after_a_partial_acceptance_the_assistant_reads_the_cache_a_fresh_target_would(
    pair,
) -> None:
    """Rounds of a greedy k=4 generation: at each round's first step, the assistant's
    logits equal those it gives over a fresh target fed the accepted text at once (the
    rejected rows left nothing in the cache it reads). The control: a fresh target fed
    another text before the same last two tokens (so the same state) gives other logits:
    what the cache holds reaches them."""
    target, assistant, _ = pair
    options = {"sampling": GREEDY}
    with (
        first_step_logits(AssistantDrafter) as seen,
        open_with_head_file(target, assistant, 4, **options) as engine,
    ):
        stats = generate(engine, n=40)[1]
    assert 0 < stats.accepted < stats.drafted  # partial acceptances happened
    fresh = _FreshPair(target, assistant)
    try:
        for tokens, logits in seen[1:]:
            np.testing.assert_allclose(logits, fresh.logits_after(tokens), rtol=1e-4, atol=1e-4)
        tokens = seen[-1][0]
        other = [tokens[0], *reversed(tokens[1:-2]), *tokens[-2:]]
        assert np.abs(fresh.logits_after(other) - seen[-1][1]).max() > 1e-3
    finally:
        fresh.close()
    assert len(seen) > 5


class _MislabelledAssistant(_MislabelledHead, AssistantDrafter):
    """The negative control: draws each token from its q, tells the verifier another."""


@pytest.mark.parametrize("tree", ["off", "8"])
def test_sampled_assistant_matches_target_distribution(tmp_path: Path, tree: str) -> None:
    """First tokens of many seeded runs, assistant-drafted (chains and trees) against
    target-only, on a pair whose target spreads its answers; the negative control (a q
    that is not what it drew from) must be told apart."""
    target, assistant = tmp_path / "target.gguf", tmp_path / "assistant.gguf"
    spread = {"target_blocks": 0.3, "target_output": 0.15, "assistant_output": 0.15}
    write_assistant_known_answer(target, assistant, spm_vocab(), 9, second=0.8, **spread)
    with open_with_head_file(target, assistant, 3, tree, sampling=SAMPLING) as engine:
        assert_sampled_like_the_target(engine, _MislabelledAssistant)


def test_check_info_and_run_say_what_the_assistant_is(pair) -> None:
    target, assistant, _ = pair
    info = specdec("info", str(assistant))
    assert info.returncode == 0, info.stderr
    assert "a Gemma 4 assistant (2 layers)" in info.stdout
    check = specdec("check", "-m", str(target), "-d", str(assistant), "--json")
    assert check.returncode == 0, check.stderr
    record = json.loads(check.stdout)
    assert (record["method"], record["problem"]) == ("gemma4-assistant", None)
    assert record["draft"] == str(assistant)  # (it said "mtp" for every head file)
    args = ["-p", PROMPT, "-n", "16", "--temp", "0", "-k", "3", "-fa", "off", "-t", "1"]
    run = specdec("run", "-m", str(target), "-d", str(assistant), *args, "--json")
    assert run.returncode == 0, run.stderr
    assert "assistant" in json.loads(run.stdout)["drafters"]


def test_an_assistant_for_another_target_is_refused(pair, target_model: Path) -> None:
    """Offered to a llama target: one line, before anything loads."""
    _, assistant, _ = pair
    result = specdec("run", "-m", str(target_model), "-d", str(assistant), "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert "drafts for Gemma 4 models, target.gguf is a llama model" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bench_drafts_with_the_assistant_it_is_given(pair, tmp_path: Path) -> None:
    """`specdec bench -d ASSISTANT.gguf`: its rows are the assistant's (they were refused:
    "no draft model is loaded"), and their ideal speedup charges its steps."""
    target, assistant, _ = pair
    out = tmp_path / "bench.json"
    args = ["-k", "3", "-n", "16", "--repeat", "1", "-fa", "off", "-t", "1", "--json", str(out)]
    result = specdec("bench", "-m", str(target), "-d", str(assistant), "--no-ngram", *args)
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["name"], run["acceptance_rate"] > 0) == ("assistant k=3", True)
