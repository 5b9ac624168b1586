"""Draft trees grown by a drafting head (EAGLE-3 on a llama target): the output is the
target's alone, token for token and in distribution; each node reads the head's state at
its parent's row; after any acceptance, a branch's included, the head drafts as fresh
contexts fed the same history would."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import pin_costs
from ggufgen import (
    Eagle3KnownAnswer,
    spm_vocab,
    write_dflash_known_answer,
    write_eagle3_known_answer,
)
from mimo2gen import write_chained_known_answer
from test_cli_run import specdec
from test_decode import PROMPT, SAMPLING, first_tokens
from test_heads import (
    assert_same_distribution,
    generate,
    open_engine,
    open_with_head_file,
    run_in_slots,
)

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.heads import HeadDrafter
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.heads import Eagle3Head, HeadContext
from specdec_cli.llamacpp.hiddenstates import record_hidden_states
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams

N_PREDICT = 48
# Verifying up to 64 tokens (four slots' trees) costs what one does: --tree auto grows trees.
FLAT_COSTS = Costs(1e-4, 0.05, {n: 1.0 + max(0, n - 64) for n in range(1, 130)})


@pytest.fixture(scope="module")
def branching(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """The known-answer EAGLE-3 pair (ggufgen.write_eagle3_known_answer): a round's first
    draft is right three times in four; where it is wrong, the head's second choice is
    right; its block adds a little of a random layer, so that its state changes with
    every token it reads (a node reading another node's state gets other logits)."""
    folder = tmp_path_factory.mktemp("eagle3-branching")
    return write_eagle3_known_answer(folder, spm_vocab(), seed=5, block_scale=0.05, second=0.8)


@pytest.fixture(scope="module")
def reference(branching) -> list[int]:
    target, head, _ = branching
    with open_with_head_file(target, head, 1, sampling=GREEDY) as engine:
        return generate(engine, engine.make_decoder(None, "1"), n=N_PREDICT)[0]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("tree", ["auto", "16"])
def test_greedy_eagle3_tree_equals_target(
    branching, reference: list[int], monkeypatch: pytest.MonkeyPatch, k: int, tree: str
) -> None:
    """Trees drafted at any depth, fixed or priced (on a cost curve where they pay): the
    text is the target's alone, and branches were drafted (more nodes than depth)."""
    pin_costs(monkeypatch, FLAT_COSTS)
    target, head, _ = branching
    with open_with_head_file(target, head, k, tree, sampling=GREEDY) as engine:
        assert isinstance(engine.decoder.drafter, HeadDrafter)
        assert engine.decoder.tree is not None
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.tree == tree
    assert stats.accepted_beside > 0  # the second choices were drafted, and taken
    assert stats.mean_k > min(k, stats.accepted_depth + 1)  # wider than deep


@pytest.mark.parametrize("tree", ["auto", "16"])
def test_greedy_mtp_tree_on_an_attention_target_equals_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree: str
) -> None:
    """An MTP head on a target without recurrent layers (a MiMo-V2 with one block) grows
    trees: the text is the target's alone, and second choices were taken."""
    pin_costs(monkeypatch, FLAT_COSTS)
    path = tmp_path / "mimo2-one-block.gguf"
    write_chained_known_answer(path, spm_vocab(), seed=3, n_heads=1, second=0.8)
    with open_engine(path, head=False) as engine:
        reference = generate(engine, n=N_PREDICT)[0]
    with open_engine(path, 3, tree=tree) as engine:
        assert type(engine.decoder.drafter) is HeadDrafter
        out, stats = generate(engine, n=N_PREDICT)
    assert out == reference
    assert stats.accepted_beside > 0


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("tree", ["auto", "16"])
def test_greedy_eagle3_trees_in_four_slots(
    branching, reference: list[int], monkeypatch: pytest.MonkeyPatch, k: int, tree: str
) -> None:
    """Four generations at once, one head context for all, each slot's tree in branches
    of its own, started at different times: each text is the target's alone."""
    pin_costs(monkeypatch, FLAT_COSTS)
    target, head, _ = branching
    lengths = [N_PREDICT - 4 * slot for slot in range(4)]
    with open_with_head_file(
        target, head, k, tree, sampling=GREEDY, parallel=4, n_ctx=1024
    ) as engine:
        outs, runs = run_in_slots(engine, lengths)
    for out, n in zip(outs, lengths, strict=True):
        assert out == reference[:n]
    assert sum(g.stats.accepted_beside for g in runs) > 0


def test_a_tree_accepts_at_least_what_its_chain_does(branching) -> None:
    """On the known-answer pair the chain's first draft is right three times in four;
    where it is wrong the tree's second choice is right (and the head's wrong answer
    right one token later): the tree's branches are drafted and taken, and it accepts
    at least what the chain does."""
    target, head, _ = branching
    with open_with_head_file(target, head, 3, "16", sampling=GREEDY) as engine:
        _, chain = generate(engine, engine.make_decoder("eagle3", "3", "off"), n=N_PREDICT)
        _, tree = generate(engine, engine.make_decoder("eagle3", "3", "16"), n=N_PREDICT)
    assert chain.accepted_beside == 0 and chain.mean_k <= 3
    assert tree.mean_k > 3  # nodes beside the chain's depth: branches were drafted
    assert tree.accepted_beside > 0
    assert tree.accepted >= chain.accepted > 0


class _FreshPair:
    """A target and its EAGLE-3 head, fed a history and a draft path from scratch, as a
    chain: what every node of a running tree must match."""

    def __init__(self, target: Path, head: Path) -> None:
        self.model = Model(target, ModelParams())
        self.head_model = Model(head, ModelParams())
        self.target = Context(self.model, ContextParams(256, 1, "off"))
        self.states = record_hidden_states(self.target, [0, 1, 2])
        self.head = Eagle3Head(self.target, 1, self.head_model)

    def logits_after(self, tokens: list[int], path: tuple[int, ...]) -> np.ndarray:
        """The head's logits for the token after `path`, drafted after `tokens` (the
        target has read all but the last, as in a round)."""
        self.target.rewind(0)
        self.head.rewind(0)
        self.target.decode(tokens[:-1], 0)
        hidden = self.head.states_for(self.states.after(0, len(tokens) - 1))
        self.head.stage(tokens[1:], hidden=hidden)
        self.head.flush()
        for token in path:
            self.head.stage([token], hidden=self.head.hidden())
            self.head.flush()
        return self.head.logits().copy()

    def close(self) -> None:
        for owned in (self.head, self.target, self.head_model, self.model):
            owned.close()


Rounds = list[tuple[list[int], dict[tuple[int, ...], np.ndarray]]]


def record_trees(target: Path, head: Path, mp: pytest.MonkeyPatch) -> tuple[Rounds, object]:
    """A greedy k=3 --tree 16 generation; each round's text, and the logits every node
    of its tree was evaluated to, by the node's path (the root's: ())."""
    rounds: Rounds = []
    paths: dict[int, tuple[int, ...]] = {}  # by row of the head's last call
    drafting, stage_nodes, logits = (
        HeadDrafter.drafting,
        HeadDrafter.stage_nodes,
        HeadContext.logits,
    )

    def drafting_recorded(self, request):
        rounds.append((list(request.tokens), {}))
        paths.clear()
        paths[-1] = ()
        return drafting(self, request)

    def stage_nodes_recorded(self, tokens, positions, seqs, parent_rows):
        rows = {
            row: paths[parent] + (token,)
            for row, (token, parent) in enumerate(zip(tokens, parent_rows, strict=True))
        }
        paths.clear()
        paths.update(rows)
        stage_nodes(self, tokens, positions, seqs, parent_rows)

    def logits_recorded(self, row=-1):
        out = logits(self, row)
        rounds[-1][1][paths[row]] = out.copy()
        return out

    mp.setattr(HeadDrafter, "drafting", drafting_recorded)
    mp.setattr(HeadDrafter, "stage_nodes", stage_nodes_recorded)
    mp.setattr(HeadContext, "logits", logits_recorded)
    with open_with_head_file(target, head, 3, "16", sampling=GREEDY) as engine:
        stats = generate(engine, n=N_PREDICT)[1]
    return rounds, stats


def mismatches(target: Path, head: Path, rounds: Rounds, paths: str) -> tuple[int, int]:
    """Of the recorded nodes (`paths`: "roots", or "all"), how many were checked against
    fresh contexts, and how many differed."""
    fresh = _FreshPair(target, head)
    checked = differed = 0
    try:
        for tokens, nodes in rounds:
            for path, got in nodes.items():
                if paths == "roots" and path:
                    continue
                expected = fresh.logits_after(tokens, path)
                checked += 1
                # The cache's rows came in other batch shapes: float noise alone.
                differed += not np.allclose(got, expected, rtol=1e-3, atol=1e-3)
    finally:
        fresh.close()
    return checked, differed


@pytest.fixture(scope="module")
def recorded(branching) -> tuple[Rounds, object]:
    target, head, _ = branching
    with pytest.MonkeyPatch.context() as mp:
        return record_trees(target, head, mp)


def test_after_a_trees_partial_acceptance_the_head_drafts_as_fresh_contexts(
    branching, recorded
) -> None:
    """Rounds after trees whose paths were taken in part, down a branch or the primary
    path: each round's first draft step (the root's logits) equals those of a fresh
    target and head fed the accepted text at once: no rejected node's row, no branch,
    is left in the head's memory."""
    target, head, _ = branching
    rounds, stats = recorded
    assert stats.accepted_beside > 0 and 0 < stats.accepted < stats.drafted
    checked, differed = mismatches(target, head, rounds[1:], "roots")
    assert checked > 5 and differed == 0


def test_every_node_reads_the_state_its_parent_gave(branching, recorded) -> None:
    """Every node of every tree is evaluated to the logits a chain down its path gives:
    beside its token, the head's own state at its parent's row. The control reads the
    previous call's last row for every node, as a chain's step does: it differs."""
    target, head, _ = branching
    rounds, _ = recorded
    checked, differed = mismatches(target, head, rounds, "all")
    assert checked > 3 * len(rounds) and differed == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            HeadContext,
            "hidden_rows",
            lambda self, rows: np.concatenate([self.hidden()] * len(rows)),
        )
        broken, _ = record_trees(target, head, mp)
    checked, differed = mismatches(target, head, broken, "all")
    assert differed > 0


@pytest.fixture(scope="module")
def tempered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """The branching pair with softened outputs: the right token's logit 5 over noise."""
    folder = tmp_path_factory.mktemp("eagle3-tempered")
    return write_eagle3_known_answer(
        folder, spm_vocab(), seed=5, temper=5.0, block_scale=0.05, second=0.8
    )


N_RUNS = 600


class _LikeliestButSaysSampled(HeadDrafter):
    """The negative control: tells the verifier each child's q (q, then q without the
    children before it), but drafts the likeliest tokens, not ones drawn from them."""

    def children(self, logits, rng, n, need_confidence, position=0, *rest):
        _, probs, dists = super().children(logits, rng, n, need_confidence, position, *rest)
        ids, told, q = [], [], dists[0]
        for _ in dists:
            if q is None:
                break
            ids.append(int(q.ids[np.argmax(q.probs)]))
            told.append(q)
            q = q.without(ids[-1])
        return ids, probs[: len(ids)], told


def test_sampled_eagle3_trees_match_target_distribution(tempered) -> None:
    """First tokens of many seeded runs, tree-drafted against target-only; the negative
    control (children that were not drawn from the q it tells) must be told apart."""
    target, head, _ = tempered
    with open_with_head_file(target, head, 3, "16", sampling=SAMPLING) as engine:
        baseline = first_tokens(engine, range(N_RUNS), engine.make_decoder(None, "1"))
        decoder = engine.decoder
        assert decoder.tree is not None
        speculative = first_tokens(engine, range(N_RUNS, 2 * N_RUNS), n_predict=8)
        drafter = decoder.drafter
        decoder.drafter = _LikeliestButSaysSampled(drafter.head, drafter.states, drafter.sampling)
        broken = first_tokens(engine, range(2 * N_RUNS, 3 * N_RUNS), n_predict=8)
    assert_same_distribution(baseline, speculative, broken)


def test_run_says_an_eagle3_tree_was_drafted(branching) -> None:
    """`specdec run -d EAGLE3.gguf --tree 16 --json`: the record names the tree, and
    its rounds drafted more nodes than their depth."""
    target, head, _ = branching
    result = specdec(
        "run", "-m", str(target), "-d", str(head), "--tree", "16", "-k", "3", "--no-ngram",
        "-p", PROMPT, "-n", "24", "--temp", "0", "-fa", "off", "-t", "1", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["tree"] == "16"
    assert record["k_mean"] > 3
    assert record["drafters"]["eagle3"]["accepted"] > 0


def test_a_dflash_drafter_refuses_a_tree(tmp_path: Path) -> None:
    """DFlash drafts a block in one call, its rows independent: chains only."""
    target, head, _ = write_dflash_known_answer(tmp_path, spm_vocab(), seed=7)
    with pytest.raises(UserError, match="a DFlash drafter drafts chains; use --tree off"):
        open_with_head_file(target, head, 3, "8")
    with open_with_head_file(target, head, 3, "auto") as engine:
        assert engine.tree_nodes == 0 and engine.decoder.tree is None
