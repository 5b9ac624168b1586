"""Drafting with the target's own MTP head: the output is the target's alone, token for
token and in distribution; the head reads the target's hidden states; after a partial
acceptance it drafts as a fresh pair of contexts fed the same history would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType
from ggufgen import (
    Eagle3KnownAnswer,
    KnownAnswer,
    Qwen35Params,
    read_f32_model,
    spm_vocab,
    write_eagle3_known_answer,
    write_gguf,
    write_mtp_known_answer,
    write_mtp_sidecar,
    write_qwen35_model,
)
from llamatools import llama_tool
from scipy.stats import chi2_contingency
from test_cli_run import specdec
from test_decode import N_FIRST, PROMPT, SAMPLING, contingency, first_tokens

from specdec_cli.commands.cli import main
from specdec_cli.decoding.decode import step
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.heads import HeadDrafter
from specdec_cli.decoding.sampling import GREEDY, SamplingParams, distribution
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp import hiddenstates
from specdec_cli.llamacpp.heads import MtpHead
from specdec_cli.llamacpp.hiddenstates import record_hidden_states
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams

N_PREDICT = 64


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3.5 target (a gated-delta-net layer, an attention layer) with one MTP block
    that agrees with it about three times in four (see write_qwen35_model)."""
    path = tmp_path_factory.mktemp("qwen35") / "qwen35-mtp.gguf"
    return write_qwen35_model(path, spm_vocab(), Qwen35Params(), seed=1, weak_scale=0.05)


def open_engine(
    target: Path,
    k: int | str = 3,
    sampling: SamplingParams = GREEDY,
    parallel: int = 1,
    head: bool | None = None,
    ngram: bool | None = False,
    n_batch: int = 2048,
    tree: str = "off",
) -> Engine:
    """The target drafting for itself (head None: as by default, with its head)."""
    return Engine(
        EngineOptions(
            target=target,
            head=head,
            ngram=ngram,
            n_ctx=256 * parallel,
            n_batch=n_batch,
            parallel=parallel,
            threads=1,
            flash_attn="off",
            sampling=sampling,
            drafting=DraftOptions(k=str(k), tree=tree),
        )
    )


def generate(engine: Engine, decoder=None, n: int = N_PREDICT, seed: int = 0, text: str = PROMPT):
    stats, out = Stats(), []
    prompt = engine.tokenize(text)
    decoder = decoder or engine.decoder
    for new in decoder.generate(prompt, n, np.random.default_rng(seed), stats):
        out += new.tokens
    return out, stats


@pytest.fixture(scope="module")
def reference(mtp_model: Path) -> list[int]:
    with open_engine(mtp_model, head=False) as engine:
        assert engine.decoder.drafter is None
        return generate(engine)[0]


def test_reference_is_a_real_continuation(reference: list[int]) -> None:
    assert len(reference) == N_PREDICT
    assert len(set(reference)) > 5


@pytest.mark.usefixtures("moderate_costs")
@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_greedy_head_equal_to_target(mtp_model: Path, reference: list[int], k) -> None:
    """By default (no -d) the target drafts with its head; rejected drafts leave no trace
    in the hybrid target's recurrent state nor in the head's memory."""
    with open_engine(mtp_model, k) as engine:
        assert isinstance(engine.decoder.drafter, HeadDrafter)
        out, stats = generate(engine)
    assert out == reference
    assert stats.proposed_by["mtp"] > 0
    assert 0.0 < stats.acceptance_rate < 1.0  # some drafts kept, some rejected


def test_greedy_head_beside_the_lookup(mtp_model: Path, reference: list[int]) -> None:
    """The default: lookup first, the head elsewhere."""
    with open_engine(mtp_model, 3, ngram=None) as engine:
        assert engine.decoder.drafter.name == "mtp+ngram"
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.proposed_by["mtp"] > 0


def run_in_slots(engine: Engine, lengths: list[int]) -> tuple[list[list[int]], list]:
    """Generations of these lengths from PROMPT, one a slot, stepped together until all
    are done (the shorter ones finish first): each one's tokens, and the generations."""
    prompt = engine.tokenize(PROMPT)
    runs = [
        engine.decoders[slot].start(prompt, n, np.random.default_rng(0), Stats())
        for slot, n in enumerate(lengths)
    ]
    outs: list[list[int]] = [[] for _ in runs]
    while not all(g.finished for g in runs):
        busy = [g for g in runs if not g.finished]
        step(busy)
        for i, g in enumerate(runs):
            if g in busy and g.round:
                outs[i] += g.round.tokens
    return outs, runs


def test_greedy_head_in_four_slots(mtp_model: Path, reference: list[int]) -> None:
    """Four generations at once, one head context for all: each slot's text is the
    target's alone, started at different times so that their rounds interleave."""
    with open_engine(mtp_model, 3, parallel=4) as engine:
        outs, runs = run_in_slots(engine, [N_PREDICT - 4 * slot for slot in range(4)])
        drafted = sum(g.stats.drafted for g in runs)
    for slot, out in enumerate(outs):
        assert out == reference[: N_PREDICT - 4 * slot]
    assert drafted > 0


def test_a_prompt_longer_than_a_call_holds(mtp_model: Path) -> None:
    """A prompt the head cannot read in one staged call (-b 32 here) goes in before the
    round's first call, a batch at a time (it raised "the head's batch is full")."""
    assert_a_long_prompt_drafts(mtp_model, lambda: open_engine(mtp_model, 3, n_batch=32))


def assert_a_long_prompt_drafts(target: Path, drafting: Callable[[], Engine]) -> None:
    """Greedy from a prompt of more than two batches of 32, the target alone and with
    the `drafting` engine (-b 32): the same text, and drafts accepted."""
    long_prompt = " ".join([PROMPT] * 24)
    with open_engine(target, head=False, n_batch=32) as engine:
        assert len(engine.tokenize(long_prompt)) > 2 * 32
        reference = generate(engine, n=24, text=long_prompt)[0]
    with drafting() as engine:
        out, stats = generate(engine, n=24, text=long_prompt)
    assert out == reference
    assert stats.accepted > 0


def without_target_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controls: zeros in place of the target's states, for every head."""
    monkeypatch.setattr(
        hiddenstates.HiddenStates,
        "after",
        lambda self, first, last: np.zeros((last - first, self.n_embd), np.float32),
    )


def test_the_head_reads_the_targets_hidden_states(known_answer, monkeypatch) -> None:
    """Every round's first draft is the known-answer head's for the target's state after
    the token before the last (head_drafts: the tables). The control records each state
    one position late, so that a row reads the state after the token two before it: every
    first draft is then the tables' answer for that state, another token in most rounds."""
    path, ka = known_answer

    def first_drafts() -> list[tuple[list[int], int]]:
        with first_step_logits(HeadDrafter) as seen, open_engine(path, 3) as engine:
            generate(engine, n=32)
        return [(tokens, int(np.argmax(logits))) for tokens, logits in seen]

    right = first_drafts()
    assert len(right) > 5
    assert all(draft == head_drafts(ka, tokens, 1)[0] for tokens, draft in right)
    record = hiddenstates.HiddenStates.record
    monkeypatch.setattr(
        hiddenstates.HiddenStates,
        "record",
        lambda self, pos, blocks: record(self, pos + 1, blocks),
    )
    late = first_drafts()
    assert all(draft == head_drafts(ka, tokens[-3::2], 1)[0] for tokens, draft in late)
    assert sum(draft != head_drafts(ka, tokens, 1)[0] for tokens, draft in late) > len(late) / 2


class _FreshPair:
    """A target and its head, fed a history from scratch: what the running pair's head
    must match after any rollback."""

    def __init__(self, path: Path) -> None:
        self.model = Model(path, ModelParams(load_mtp=True))
        self.target = Context(self.model, ContextParams(256, 1, "off", n_rs_seq=8))
        self.head = MtpHead(self.target, 1)
        self.states = record_hidden_states(self.target)

    def head_logits_after(self, tokens: list[int]) -> np.ndarray:
        """The head's logits drafting the token after `tokens` (the target has read all
        but the last, as in a round)."""
        self.target.decode(tokens[:-1], 0)
        self.head.stage(tokens, hidden=self.states.after(-1, len(tokens) - 1))
        self.head.flush()
        return self.head.logits().copy()

    def close(self) -> None:
        self.head.close()
        self.target.close()
        self.model.close()


@contextmanager
def first_step_logits(
    drafter: type[HeadDrafter],
) -> Iterator[list[tuple[list[int], np.ndarray]]]:
    """While in it, each round of a `drafter` records its text and its logits at the
    round's first draft step."""
    seen: list[tuple[list[int], np.ndarray]] = []
    original = drafter.children

    def children(self, logits, rng, n, need_confidence, position=0, *rest):
        if position == len(self._tokens):  # a round's first draft step
            seen.append((self._tokens, logits.copy()))
        return original(self, logits, rng, n, need_confidence, position, *rest)

    original_drafting = drafter.drafting

    def drafting(self, request):
        self._tokens = list(request.tokens)
        return original_drafting(self, request)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drafter, "children", children)
        mp.setattr(drafter, "drafting", drafting)
        yield seen


def test_after_a_partial_acceptance_the_head_drafts_as_fresh_contexts(mtp_model: Path) -> None:
    """Rounds of a greedy k=4 generation: at each round's first draft step, the head's
    logits equal those of a fresh target and head fed the accepted text at once."""
    with first_step_logits(HeadDrafter) as seen, open_engine(mtp_model, 4) as engine:
        stats = generate(engine, n=40)[1]
    assert 0 < stats.accepted < stats.drafted  # partial acceptances happened
    fresh = _FreshPair(mtp_model)
    try:
        checked = 0
        for tokens, logits in seen[1:]:
            fresh.target.rewind(0)
            fresh.head.rewind(0)
            expected = fresh.head_logits_after(tokens)
            np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
            checked += 1
    finally:
        fresh.close()
    assert checked > 5


N_RUNS = 1500


class _MislabelledHead(HeadDrafter):
    """A broken head, for the negative control: it draws each token from its q but tells
    the verifier another distribution (q at a lower temperature), from its draft's
    `from_depth`-th token on (0: the first; a chain's drafts so far are its path)."""

    from_depth = 0

    def children(self, logits, rng, n, need_confidence, position=0, path=()):
        ids, probs, dists = super().children(logits, rng, n, need_confidence, position, path)
        if len(path) < self.from_depth:
            return ids, probs, dists
        sharper = SamplingParams(temp=self.sampling.temp / 3, top_k=20, top_p=0.95, min_p=0.0)
        return ids, probs, [distribution(logits, sharper) if d is not None else d for d in dists]


def test_sampled_head_matches_target_distribution(mtp_model: Path) -> None:
    """First tokens of many seeded runs, head-drafted against target-only; the negative
    control (a q that is not what the head drew from) must be told apart."""
    with open_engine(mtp_model, 3, SAMPLING) as engine:
        assert_sampled_like_the_target(engine, _MislabelledHead)


def assert_sampled_like_the_target(
    engine: Engine, mislabelled: type[HeadDrafter], runs: int = N_RUNS, n_first: int = N_FIRST
) -> None:
    """The first `n_first` tokens of `runs` seeded runs of the engine's head against
    target-only, by chi-square; then the negative control: the head replaced by
    `mislabelled` (drafting otherwise than the q it tells the verifier), which must be
    told apart. After the prompt's token a round drafts k deep only where k + 1 tokens
    are still to come: generations of k + 2 tokens reach every depth."""
    baseline = first_tokens(engine, range(runs), engine.make_decoder(None, "1"), n_first, n_first)
    speculative = first_tokens(engine, range(runs, 2 * runs), None, n_first, n_first)
    decoder = engine.decoder
    head = decoder.drafter
    decoder.drafter = mislabelled(head.head, head.states, head.sampling)
    broken = first_tokens(engine, range(2 * runs, 3 * runs), None, n_first, n_first)
    assert_same_distribution(baseline, speculative, broken)


def assert_same_distribution(
    baseline: np.ndarray, speculative: np.ndarray, broken: np.ndarray
) -> None:
    """First tokens of seeded runs: the speculative ones as the target's alone by
    chi-square, at every position; the negative control's told apart at some position."""
    positions = range(baseline.shape[1])
    for position in positions:
        table = contingency(baseline[:, position], speculative[:, position])
        assert table.shape[1] > 3
        assert chi2_contingency(table).pvalue > 1e-3, f"token {position} differs"
    # Position 0 comes with the prompt, undrafted: the control shows after it.
    controls = [
        chi2_contingency(contingency(baseline[:, p], broken[:, p])).pvalue for p in positions[1:]
    ]
    assert min(controls) < 1e-3


def test_run_uses_the_head_by_default_and_says_so(mtp_model: Path) -> None:
    result = specdec(
        "run",
        "-m",
        str(mtp_model),
        "-p",
        PROMPT,
        "-n",
        "24",
        "--temp",
        "0",
        "-k",
        "3",
        "-fa",
        "off",
        "-t",
        "1",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert "mtp" in json.dumps(record.get("drafters", record))


# A model whose answers are known (ggufgen.write_mtp_known_answer): what its head drafts
# and the target accepts follows from its tables, simulated here in numpy.


@pytest.fixture(scope="module")
def known_answer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, KnownAnswer]:
    path = tmp_path_factory.mktemp("known") / "qwen35-known-answer.gguf"
    return path, write_mtp_known_answer(path, spm_vocab(), seed=3)


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + 1e-6)


def head_drafts(ka: KnownAnswer, tokens: list[int], k: int) -> list[int]:
    """The head's greedy chain after `tokens`, computed from the tables: it reads the last
    token beside the trunk's state after the one before it, then its own states."""
    state = _rms(ka.token_embd[tokens[-2]]) if len(tokens) > 1 else np.zeros(ka.n_embd)
    token, drafts = tokens[-1], []
    for _ in range(k):
        read = np.concatenate([_rms(ka.token_embd[token]), _rms(state) if state.any() else state])
        state = _rms(ka.eh_proj @ read)
        token = int(np.argmax(ka.head @ state))
        drafts.append(token)
    return drafts


Drafts = Callable[[list[int], int], list[int]]  # a head's chain after tokens, k long


def expected_rounds(
    succ: np.ndarray, drafts: Drafts, prompt: list[int], n: int, k: int, stats: Stats
) -> tuple[int, int]:
    """(drafted, accepted) of a greedy generation of n tokens at draft length k, as the
    decode loop runs it: its first token comes with the prompt, undrafted, where the
    prompt's end was read with the first round (`stats.with_prompt`; a prompt read in a
    call of its own drafts from the first round); each round drafts at most one token
    fewer than are still to come."""
    tokens = [*prompt, int(succ[prompt[-1]])] if stats.with_prompt else list(prompt)
    drafted = accepted = 0
    while len(tokens) - len(prompt) < n:
        room = n - (len(tokens) - len(prompt))
        draft = drafts(tokens, min(k, room - 1)) if room > 1 else []
        truth = [int(succ[tokens[-1]])]
        while len(truth) <= len(draft):  # the target's answers, one past the draft
            truth.append(int(succ[truth[-1]]))
        taken = next(
            (i for i, (d, t) in enumerate(zip(draft, truth[:-1], strict=True)) if d != t),
            len(draft),
        )
        drafted, accepted = drafted + len(draft), accepted + taken
        tokens += truth[: taken + 1]
    return drafted, accepted


@pytest.mark.parametrize("k", [1, 3, 8])
def test_known_answer_acceptance_follows_from_the_tables(known_answer, k: int) -> None:
    """The target writes its successor cycle, and the head's drafts are accepted exactly
    as often as its tables say: the right hidden state reaches it at the right row."""
    path, ka = known_answer
    with open_engine(path, k) as engine:
        prompt = engine.tokenize(PROMPT)
        out, stats = generate(engine, n=48)
    tokens = [*prompt, *out]
    assert all(ka.succ[a] == b for a, b in zip(tokens[len(prompt) - 1 :], out, strict=False))
    drafted, accepted = expected_rounds(ka.succ, partial(head_drafts, ka), prompt, 48, k, stats)
    assert (stats.drafted, stats.accepted) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_known_answer_head_without_states_accepts_nothing(known_answer, monkeypatch) -> None:
    """The control: with zeros for the target's states, the decoy wins every first step."""
    path, _ = known_answer
    without_target_states(monkeypatch)
    with open_engine(path, 1) as engine:
        stats = generate(engine, n=32)[1]
    assert stats.drafted > 0 and stats.accepted == 0


def test_only_a_heads_policy_weighs_its_depths_by_bayes(mtp_model: Path) -> None:
    """-k auto's estimates by depth: a head's are its training's (see
    PositionAcceptance), a lookup's the text's, even beside the head."""
    with open_engine(mtp_model, "auto", ngram=True) as engine:
        decoder = engine.decoder
        assert decoder.length.positions.bayes_weight
        assert not decoder.lengths["ngram"].positions.bayes_weight


def test_info_and_check_say_what_the_head_reads(mtp_model: Path, target_model: Path) -> None:
    info = specdec("info", str(mtp_model))
    assert info.returncode == 0, info.stderr
    assert "drafting head: MTP, 1 block(s) (2), reading the output of layer 1" in info.stdout
    check = specdec("check", "-m", str(mtp_model), "-d", "mtp", "--json")
    assert check.returncode == 0, check.stderr
    record = json.loads(check.stdout)
    assert (record["method"], record["heads"], record["reads_layers"]) == ("mtp", 1, [1])
    refused = specdec("check", "-m", str(target_model), "-d", "mtp")
    assert refused.returncode == 1
    assert "has no MTP layers" in refused.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-d", "mtp"], "-d mtp: target.gguf has no MTP layers to draft with"),
        (["-d", "mtp", "-d", "DRAFT"], "one draft model at a time"),
    ],
)
def test_an_impossible_head_is_refused_in_one_line(
    target_model: Path, draft_model: Path, args: list[str], message: str
) -> None:
    args = [str(draft_model) if a == "DRAFT" else a for a in args]
    result = specdec("run", "-m", str(target_model), *args, "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("k", ["3", "2,auto"])
def test_bench_verifies_within_the_recurrent_snapshots(
    mtp_model: Path, k: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specdec bench`'s rounds on a hybrid target are undone by llama.cpp's snapshots,
    as `run`'s are. Its engine was made for -k 1: each longer draft first copied the whole
    recurrent state, outside the decode calls (over RPC, tens of milliseconds a round,
    and -k auto took that for the price of Python)."""
    copies: list[tuple[int, int]] = []  # a round's (draft length, snapshots) that copied
    checkpoint = Context.checkpoint

    def spy(self: Context, n_ahead: int | None = None) -> None:
        if n_ahead is not None and n_ahead > self.n_rs_seq:
            copies.append((n_ahead, self.n_rs_seq))
        checkpoint(self, n_ahead)

    monkeypatch.setattr(Context, "checkpoint", spy)
    out = tmp_path / "bench.json"
    args = ["-m", str(mtp_model), "-d", "mtp", "--no-ngram", "-k", k, "-n", "24", "--repeat", "1"]
    monkeypatch.setattr(sys, "argv", ["specdec", "bench", *args, "-fa", "off", "--json", str(out)])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    runs = json.loads(out.read_text())["runs"]
    drafted = [int(n) for run in runs for n in run["k_histogram"]]
    assert max(drafted) > 1  # rounds that drafted past -k 1 (and were spied on)
    assert not copies


def test_a_head_on_a_hybrid_target_refuses_a_tree(mtp_model: Path) -> None:
    """The head could grow one, but the target's recurrent state cannot verify it."""
    result = specdec("run", "-m", str(mtp_model), "--tree", "8", "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert "is recurrent and cannot verify or draft a tree" in result.stderr


def llama_cpp_rounds(
    succ: np.ndarray, drafts: Drafts, prompt: list[int], n: int, k: int
) -> tuple[int, int]:
    """(n_drafted, n_accept) that llama.cpp's llama-speculative-simple reports for a greedy
    run of -n n at --spec-draft-n-max k, from the tables and its loop: it drafts from the
    first round on and stops once it has more than n tokens. Each draft is cut to the
    tokens still to come, less one, unless that is none: common_speculative_draft cuts
    only to a positive limit, so its last rounds draft k whole."""
    tokens, n_predict, drafted, accepted = list(prompt), 0, 0, 0
    while n_predict <= n:
        limit = min(k, n - n_predict - 1)
        draft = drafts(tokens, limit if limit > 0 else k)
        truth = [int(succ[tokens[-1]])]
        while len(truth) <= len(draft):  # the target's answers, one past the draft
            truth.append(int(succ[truth[-1]]))
        pairs = zip(draft, truth[:-1], strict=True)
        taken = next((i for i, (d, t) in enumerate(pairs) if d != t), len(draft))
        drafted, accepted = drafted + len(draft), accepted + taken
        tokens += truth[: taken + 1]
        n_predict += taken + 1
    return drafted, accepted


def llama_cpp_counts(target: Path, k: int, *spec: str) -> tuple[int, int]:
    """(n_drafted, n_accept) of llama.cpp's llama-speculative-simple, greedy, -n 48."""
    tool = llama_tool("llama-speculative-simple")
    command = [str(tool), "-m", str(target), *spec, "--spec-draft-n-max", str(k)]
    command += ["-p", PROMPT, "-n", "48", "--temp", "0", "-t", "1", "-fa", "off", "-c", "256"]
    for _ in range(5):  # llama.cpp's log thread now and then loses its last lines at exit
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        reported = dict(re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", result.stderr))
        if len(reported) == 2:
            return int(reported["n_drafted"]), int(reported["n_accept"])
    raise AssertionError(f"no n_drafted/n_accept in llama.cpp's output: {result.stderr[-2000:]}")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_llama_cpp_accepts_what_the_tables_say_too(known_answer, k: int) -> None:
    """llama.cpp's own MTP driver on the same file drafts what the tables say (and so
    what specdec drafts: test_known_answer_acceptance_follows_from_the_tables)."""
    path, ka = known_answer
    counts = llama_cpp_counts(path, k, "--spec-type", "draft-mtp")
    with open_engine(path, k) as engine:
        prompt = engine.tokenize(PROMPT)
    assert counts == llama_cpp_rounds(ka.succ, partial(head_drafts, ka), prompt, 48, k)


# EAGLE-3: a head file of its own, reading three of the target's layer inputs
# (ggufgen.write_eagle3_known_answer: its drafts follow from tables too).


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Eagle3KnownAnswer]:
    return write_eagle3_known_answer(tmp_path_factory.mktemp("eagle3"), spm_vocab(), seed=5)


def eagle3_drafts(ka: Eagle3KnownAnswer, tokens: list[int], k: int) -> list[int]:
    """Its chain: the answer for the token before the last, k times (see the writer)."""
    return [int(ka.answer[tokens[-2]])] * k if len(tokens) > 1 else []


def open_with_head_file(
    target: Path, head: Path, k: int | str, tree: str = "off", **options
) -> Engine:
    """`-d HEAD.gguf`: an EAGLE-3 or DFlash file, or an MTP sidecar."""
    settings = {"ngram": False, "n_ctx": 256, "threads": 1, "flash_attn": "off"} | options
    return Engine(
        EngineOptions(
            target=target, draft=head, drafting=DraftOptions(k=str(k), tree=tree), **settings
        )
    )


def test_eagle3_reads_a_prompt_longer_than_a_call_holds(eagle3_pair) -> None:
    target, head, _ = eagle3_pair
    assert_a_long_prompt_drafts(target, lambda: open_with_head_file(target, head, 3, n_batch=32))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_eagle3_drafts_what_its_tables_say(eagle3_pair, k: int) -> None:
    """`-d EAGLE3.gguf` drafts through the target's layer inputs: the output is the
    target's own cycle, and its acceptance what the tables say."""
    target, head, ka = eagle3_pair
    with open_with_head_file(target, head, k) as engine:
        assert engine.decoder.drafter.name == "eagle3"
        prompt = engine.tokenize(PROMPT)
        out, stats = generate(engine, n=48)
    tokens = [*prompt, *out]
    assert all(ka.succ[a] == b for a, b in zip(tokens[len(prompt) - 1 :], out, strict=False))
    expected = expected_rounds(ka.succ, partial(eagle3_drafts, ka), prompt, 48, k, stats)
    assert (stats.drafted, stats.accepted) == expected
    assert 0 < stats.accepted < stats.drafted


def accepts_nothing_without_states(target: Path, head: Path, k: int, monkeypatch) -> None:
    """The control of a file reading the target's states: zeros in their place, and
    nothing it drafts is accepted."""
    without_target_states(monkeypatch)
    with open_with_head_file(target, head, k) as engine:
        stats = generate(engine, n=32)[1]
    assert stats.drafted > 0 and stats.accepted == 0


def test_eagle3_without_the_targets_states_accepts_nothing(eagle3_pair, monkeypatch) -> None:
    target, head, _ = eagle3_pair
    accepts_nothing_without_states(target, head, 1, monkeypatch)


@pytest.mark.parametrize("k", [1, 3])
def test_llama_cpp_eagle3_accepts_what_the_tables_say_too(eagle3_pair, k: int) -> None:
    target, head, ka = eagle3_pair
    counts = llama_cpp_counts(target, k, "--spec-type", "draft-eagle3", "-md", str(head))
    with open_with_head_file(target, head, k) as engine:
        prompt = engine.tokenize(PROMPT)
    assert counts == llama_cpp_rounds(ka.succ, partial(eagle3_drafts, ka), prompt, 48, k)


def test_an_eagle3_head_for_another_target_is_refused(eagle3_pair, target_model: Path) -> None:
    """Made for a 512-wide target, offered to the 64-wide test target: one line, before
    anything loads; `specdec check` says the same, and says what fits."""
    target, head, _ = eagle3_pair
    result = specdec("run", "-m", str(target_model), "-d", str(head), "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert "was made for a hidden size of 512" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    refused = specdec("check", "-m", str(target_model), "-d", str(head))
    assert refused.returncode == 1 and "was made for a hidden size of 512" in refused.stdout
    fits = specdec("check", "-m", str(target), "-d", str(head), "--json")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    record = json.loads(fits.stdout)
    assert (record["method"], record["reads_layers"], record["problem"]) == (
        "eagle3",
        [0, 1, 2],
        None,
    )


def rewritten(path: Path, out: Path, keys=None, tensors=None) -> Path:
    """The F32 file at `path` written again at `out`, with these metadata keys and
    tensors put in (added, or in place of its own)."""
    metadata, weights = read_f32_model(path)
    return write_gguf(out, metadata | (keys or {}), weights | (tensors or {}))


def assert_refused_in_one_line(target: Path, head: Path, message: str) -> None:
    """`specdec run -m TARGET -d HEAD` exits 2 with one line saying `message`."""
    result = specdec("run", "-m", str(target), "-d", str(head), "-p", "Once", "-n", "4")
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_eagle3_vocabulary_map_is_checked(eagle3_pair, tmp_path: Path) -> None:
    """A d2t (the target's id of each token a head predicts) in range drafts as the file
    without one; one naming an id past the target's vocabulary (llama.cpp writes the row
    there: it aborted) or not I64 (llama.cpp asserts) is refused in one line, before
    anything loads."""
    target, head, ka = eagle3_pair
    n = read_f32_model(head)[1]["output.weight"].shape[0]
    identity = rewritten(head, tmp_path / "d2t.gguf", tensors={"d2t": np.arange(n)})
    with open_with_head_file(target, identity, 3) as engine:
        prompt = engine.tokenize(PROMPT)
        stats = generate(engine, n=24)[1]
    assert (stats.drafted, stats.accepted) == expected_rounds(
        ka.succ, partial(eagle3_drafts, ka), prompt, 24, 3, stats
    )
    past = np.arange(n)
    past[5] = n
    for ids, message in (
        (past, f"d2t maps its token 5 to id {n}, outside target.gguf's {n} tokens"),
        (np.arange(n, dtype=np.int32), f"d2t is I32 of shape [{n}]; llama.cpp takes"),
    ):
        bad = rewritten(head, tmp_path / "bad.gguf", tensors={"d2t": ids})
        assert_refused_in_one_line(target, bad, message)


@pytest.mark.parametrize(
    "layers",
    [
        GGUFValue(["0", "1", "2"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        GGUFValue([0.0, 1.0, 2.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
        GGUFValue(2, GGUFValueType.UINT32),
    ],
)
def test_target_layers_that_are_not_layer_numbers_are_refused(
    eagle3_pair, tmp_path: Path, layers: GGUFValue
) -> None:
    """run refuses them in one line, check says so, info reads the file (all three ended
    in a traceback)."""
    target, head, _ = eagle3_pair
    bad = rewritten(head, tmp_path / "bad.gguf", keys={"eagle3.target_layers": layers})
    message = "bad.gguf's eagle3.target_layers is "
    assert_refused_in_one_line(target, bad, message)
    check = specdec("check", "-m", str(target), "-d", str(bad), "--json")
    assert check.returncode == 1, check.stderr
    assert message in json.loads(check.stdout)["problem"]
    info = specdec("info", str(bad))
    assert info.returncode == 0, info.stderr


def test_measuring_costs_prices_a_head_step(mtp_model: Path) -> None:
    """-k auto measures a head step as it measures a draft model's call."""
    with open_engine(mtp_model, "auto") as engine:
        costs = engine.measure_costs({2, 4}, reps=1)
    assert costs.draft_over_target > 0.0
    assert set(costs.verify) >= {1, 2, 4}


def serve_two_at_once(tmp_path: Path, *args: str) -> tuple[list[str], int]:
    """Two greedy completions of PROMPT at once through `specdec serve -np 2` with these
    model flags: their texts, and the drafted tokens the server says were accepted."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import start

    server = start(tmp_path, *args, "-np", "2", "-k", "3", "-c", "512")
    try:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(
                    lambda _: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60),
                    range(2),
                )
            )
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        assert server.stop() == 0, server.output()
    accepted = re.search(r"spec_decode_num_accepted_tokens_total (\d+)", metrics)
    assert accepted
    return [r.json()["choices"][0]["text"] for r in replies], int(accepted.group(1))


def test_serve_drafts_with_the_head_in_two_slots(
    mtp_model: Path, reference: list[int], tmp_path: Path
) -> None:
    """Two requests at once through `specdec serve -np 2` (one head context for both
    slots): each is the target's own greedy text, and the head's drafts were accepted."""
    assert_served_in_two_slots(tmp_path, mtp_model, reference)


def assert_served_in_two_slots(tmp_path: Path, model: Path, reference: list[int]) -> None:
    """serve_two_at_once with the model's own head: both texts are the target's greedy
    one (`reference`'s first 24 tokens), and drafts were accepted."""
    texts, accepted = serve_two_at_once(tmp_path, "-m", str(model))
    with open_engine(model, head=False) as engine:
        expected = b"".join(engine.model.piece(t) for t in reference[:24]).decode()
    assert texts == [expected, expected]
    assert accepted > 0


def test_an_mtp_sidecar_drafts_as_the_models_own_head(
    known_answer, mtp_model: Path, tmp_path: Path
) -> None:
    """`-d mtp-*.gguf`: the MTP block in a file of its own (the trunk left out) drafts for
    the target as the target's own head does, table for table; one for another target
    is refused in one line."""
    path, ka = known_answer
    sidecar = write_mtp_sidecar(tmp_path / "mtp-known-answer.gguf", path)
    with open_engine(path, 3, head=False) as own:
        prompt = own.tokenize(PROMPT)
    with open_with_head_file(path, sidecar, 3) as engine:
        assert engine.decoder.drafter.name == "mtp"
        out, stats = generate(engine, n=48)
    tokens = [*prompt, *out]
    assert all(ka.succ[a] == b for a, b in zip(tokens[len(prompt) - 1 :], out, strict=False))
    expected = expected_rounds(ka.succ, partial(head_drafts, ka), prompt, 48, 3, stats)
    assert (stats.drafted, stats.accepted) == expected
    result = specdec("run", "-m", str(mtp_model), "-d", str(sidecar), "-p", "Once", "-n", "4")
    assert result.returncode == 2
    assert "reads a hidden state of 1024" in result.stderr
