"""Tree drafting on real llama.cpp models: one target pass over a tree gives each node
the logits its path alone would, the accepted branch is kept exactly, and speculative
output still equals the target's alone. The verification math is in test_tree_verify."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_decode import PROMPT, generate, open_engine

from specdec_cli.commands.bench import variants, widest_tree
from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.draft import Draft, TreeShape, propose
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.ngram import NgramDrafter
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions, parse_tree
from specdec_cli.decoding.treegrowth import TreeGrowth
from specdec_cli.decoding.treeshape import AutoTree, FixedTree, NodeOdds
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model

# A tree hanging from the last prompt token (index 0 of the call): three children, the
# first with two of its own, the third with one.
TREE_TOKENS = [100, 200, 300, 101, 102, 301]
TREE_PARENTS = [-1, -1, -1, 0, 0, 2]
RNG = np.random.default_rng(0)


def call_tree(last: int) -> tuple[list[int], list[int]]:
    """The decode call: the last prompt token, then the tree below it."""
    return [last, *TREE_TOKENS], [-1, *(p + 1 if p >= 0 else 0 for p in TREE_PARENTS)]


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.fixture(scope="module")
def contexts(target_model: Path):
    model = Model(target_model)
    tree = Context(model, ContextParams(256, 1, "off", n_seq_max=8))
    chain = Context(model, ContextParams(256, 1, "off"))
    yield model, tree, chain
    tree.close()
    chain.close()
    model.close()


def test_each_node_sees_its_own_path(contexts) -> None:
    """Row i of one tree pass equals the last row of decoding i's path as a chain."""
    model, tree, chain = contexts
    prompt = model.tokenize(PROMPT)
    start = len(prompt) - 1
    tree.prefill(prompt[:-1])
    chain.prefill(prompt[:-1])
    tokens, parents = call_tree(prompt[-1])
    tree.decode(tokens, start, n_logits=len(tokens), parents=parents)
    rows = [tree.logits(i).copy() for i in range(len(tokens))]
    for i in range(len(tokens)):
        chain.rewind(start)
        chain.decode([tokens[j] for j in path_to(parents, i)], start)
        assert np.allclose(rows[i], chain.logits(-1), atol=1e-3), f"node {i}"
    # A sibling's token is invisible to the others: node 2 (200) differs from node 1's
    # child (101) though both are at the same position.
    assert not np.allclose(rows[2], rows[4], atol=1e-3)


def test_what_a_tree_call_spends(target_model: Path) -> None:
    """Context.spend counts the small calls with logits at every row (a verification's,
    a draft step's: what -fa auto checks its choice against), and the deepest position
    decoded: a tree's is its deepest node's, not its last row's."""
    model = Model(target_model)
    ctx = Context(model, ContextParams(256, 1, "off", n_seq_max=8))
    try:
        prompt = model.tokenize(PROMPT)
        start = len(prompt) - 1
        ctx.decode(prompt[:-1], 0)  # logits at its last row alone: not counted
        assert ctx.spend()[:2] == (0, 0) and ctx.spend()[3] == start
        tokens, parents = call_tree(prompt[-1])
        ctx.decode(tokens, start, n_logits=len(tokens), parents=parents)
        calls, n_tokens, seconds, deepest = ctx.spend()
        assert (calls, n_tokens) == (1, len(tokens)) and seconds > 0
        # The last prompt token at `start`, its children after it, two of theirs after them
        assert deepest == start + 3
    finally:
        ctx.close()
        model.close()


def test_a_chain_is_grown_a_node_a_call_without_ranking(
    target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain (one branch a node) is the one-wide tree's primary path, grown without
    the tree's ranking and forking: the same tokens, each depth one token staged alone
    in the slot's own sequence, its row read from the call before."""
    options = EngineOptions(
        target=target_model, draft=draft_model, ngram=False, n_ctx=256, threads=1,
        sampling=GREEDY, drafting=DraftOptions(k="4", tree="off"),
    )  # fmt: skip
    staged: list[tuple[int, ...]] = []
    stage_nodes = ModelDrafter.stage_nodes

    def recorded(self: ModelDrafter, tokens, positions, seqs, parent_rows) -> None:
        staged.append((len(tokens), *seqs, *parent_rows))
        stage_nodes(self, tokens, positions, seqs, parent_rows)

    def ranked(self: TreeGrowth, nodes: list[int], n: int) -> list[int]:
        raise AssertionError("a chain's frontier was ranked")

    monkeypatch.setattr(ModelDrafter, "stage_nodes", recorded)
    with Engine(options) as engine:
        assert engine.draft_ctx is not None
        drafter = ModelDrafter(engine.draft_ctx, GREEDY, engine.model.n_vocab)
        prompt = engine.tokenize(PROMPT)
        # Side children below a score of 2 are never drafted: a one-wide tree's only
        # nodes are its primary path, grown by the tree's code.
        drafter.begin(prompt)
        tree = propose(drafter, prompt, 4, RNG, shape=TreeShape(4, branch=2, min_score=2.0))
        staged.clear()
        monkeypatch.setattr(TreeGrowth, "_to_extend", ranked)  # a chain ranks nothing
        drafter.begin(prompt)
        chain = propose(drafter, prompt, 4, RNG, shape=TreeShape(4))
    assert len(chain.tokens) == 4 and chain.tokens == tree.tokens
    assert chain.parents is None and chain.calls == 4  # the prompt's last token, 3 nodes
    # Nodes 0-2 staged alone in sequence 0, each beside its parent's row: the last of the
    # call before the tree for node 0, then row 0 of each one-row call.
    assert staged == [(1, 0, -1), (1, 0, 0), (1, 0, 0)]


@pytest.mark.parametrize("kept", range(len(TREE_TOKENS) + 1))
def test_keep_branch_leaves_exactly_that_path(contexts, kept: int) -> None:
    """After keeping any node's path, the memory is that path alone: the next token's
    logits equal a chain's, and the sequence length is right."""
    model, tree, chain = contexts
    prompt = model.tokenize(PROMPT)
    start = len(prompt) - 1
    tree.prefill(prompt[:-1])
    tokens, parents = call_tree(prompt[-1])
    tree.decode(tokens, start, n_logits=len(tokens), parents=parents)
    tree.keep_branch(kept)
    path = [tokens[j] for j in path_to(parents, kept)]
    assert tree.tokens == [*prompt[:-1], *path]
    tree.decode([7], len(tree.tokens))
    chain.prefill(prompt[:-1])
    chain.decode([*path, 7], start)
    assert np.allclose(tree.logits(-1), chain.logits(-1), atol=1e-3)


@pytest.fixture(scope="module")
def reference(target_model: Path) -> list[int]:
    with open_engine(target_model) as engine:
        return generate(engine, 64)[0]


@pytest.mark.parametrize("drafter", ["model", "ngram", "model+ngram"])
@pytest.mark.parametrize(("k", "tree"), [("3", "8"), ("2", "6"), ("4", "16"), ("auto", "auto")])
def test_greedy_tree_equals_target(
    target_model: Path, draft_model: Path, reference, drafter: str, k: str, tree: str
) -> None:
    with open_engine(target_model, draft_model, k, GREEDY, tree=tree) as engine:
        out, stats = generate(engine, 64, decoder=engine.make_decoder(drafter, k))
    assert out == reference
    assert stats.tree == tree


def test_a_tree_accepts_more_per_pass_than_its_chain(
    target_model: Path, draft_model: Path, reference
) -> None:
    """The draft's second choices are right often enough on the test pair: the same k
    with a tree yields more tokens per target pass, through its branches."""
    with open_engine(target_model, draft_model, 3, GREEDY, tree="12") as engine:
        _, chain = generate(engine, 64, decoder=engine.make_decoder("model", "3", "off"))
        out, tree = generate(engine, 64, decoder=engine.make_decoder("model", "3", "12"))
    assert out == reference
    assert tree.accepted_beside > 0
    assert tree.tokens_per_pass > chain.tokens_per_pass
    assert tree.mean_k > chain.mean_k  # more tokens drafted per round


def test_recurrent_models_draft_chains(mamba_pair: tuple[Path, Path]) -> None:
    """A recurrent state is one per sequence: an explicit tree is refused in one line,
    auto (the default) drafts chains (still lossless)."""
    target, draft = mamba_pair
    with pytest.raises(UserError, match=r"recurrent.*--tree off"):
        open_engine(target, draft, 3, tree="8")
    with open_engine(target, draft, 3, tree="auto") as engine:
        assert engine.tree_nodes == 0
        assert engine.decoder.tree is None
        out, _ = generate(engine, 24)
    with open_engine(target) as engine:
        assert out == generate(engine, 24)[0]


@pytest.mark.parametrize("value", ["1", "0", "-3", "wide", "2.5"])
def test_bad_tree_values_are_refused(value: str) -> None:
    with pytest.raises(UserError, match="--tree must be"):
        parse_tree(value)


def test_fixed_tree_shape() -> None:
    assert FixedTree(4).shape(k=4, limit=100) is None  # no room beside the chain
    policy = FixedTree(16)
    odds = policy.odds.chance
    assert policy.shape(k=4, limit=100) == TreeShape(16, 4, 4, odds=odds)
    assert policy.shape(k=4, limit=10) == TreeShape(10, 2, 2, odds=odds)  # near the end


def flat_costs(per_token: float) -> Costs:
    return Costs(0.01, 0.05, {n: 1.0 + per_token * (n - 1) for n in range(1, 34)})


def test_auto_tree_follows_the_cost_curve() -> None:
    """Where a token more in the batch costs next to nothing, alternatives pay; where
    each costs a whole target pass, a side node would need odds beyond any draft's."""
    assert AutoTree(flat_costs(1.0), 32).shape(k=3, limit=100) is None
    shape = AutoTree(flat_costs(0.003), 32).shape(k=3, limit=100)
    assert shape is not None and shape.nodes == 32 and shape.min_score < 0.01
    assert shape.verify[0] == 1.0 and len(shape.verify) == 33


def test_a_rejection_sampled_generation_prices_trees_with_the_first_measurement() -> None:
    """The first measurement (steep: chains) for a generation whose shapes decide its
    random numbers; the median of the runs' measurements (flat: trees) for one whose
    text no draft changes."""
    policy = AutoTree(flat_costs(0.003), 32, first=flat_costs(1.0))
    policy.begin(invariant=False)
    assert policy.shape(k=3, limit=100) is None
    policy.begin(invariant=True)
    shape = policy.shape(k=3, limit=100)
    assert shape is not None and shape.nodes == 32
    policy.begin(invariant=False)
    assert policy.shape(k=3, limit=100) is None


def test_auto_tree_pauses_after_trees_that_did_not_pay() -> None:
    """A tree cut back to a chain pauses trees for 8 rounds, then 16, ...; a tree that
    was kept brings the pause back to 8."""
    policy = AutoTree(flat_costs(0.003), 32)
    chain, tree = Draft([1, 2, 3], calls=3), Draft([1, 2, 3], calls=3, parents=[-1, 0, 0])

    def offered(rounds: int, result: Draft) -> list[bool]:
        out = []
        for _ in range(rounds):
            shape = policy.shape(k=3, limit=100)
            out.append(shape is not None)
            policy.observe(result if shape else chain, [0])
        return out

    assert offered(1, chain) == [True]
    assert offered(9, chain) == [False] * 8 + [True]
    assert offered(17, tree) == [False] * 16 + [True]
    assert offered(3, tree) == [True] * 3
    # A translated tree whose alternatives merged into its primary path is no cut.
    lost = Draft([1, 2, 3], calls=3, alternatives_lost=True)
    assert offered(3, lost) == [True] * 3


def knee_costs(flat_to: int) -> Costs:
    """Verifying up to `flat_to` tokens costs as much as one; each more, a whole pass."""
    return Costs(0.01, 0.05, {n: 1.0 + max(0, n - flat_to) for n in range(1, 34)})


def test_auto_tree_sees_past_an_uneven_curve() -> None:
    """4 draft tokens cost less than 3 (as measured on this kind of CPU with a large
    vocabulary): a fourth beside a 3-token chain is free, not dear."""
    costs = Costs(0.01, 0.1, {1: 1.0, 2: 1.7, 3: 2.7, 4: 2.2, 5: 3.2, 6: 2.8, 7: 3.8})
    policy = AutoTree(costs, 6)
    assert policy.cheapest_extra(2, 6) < 0  # from a batch of 3 to one of 4
    assert policy.cheapest_extra(3, 6) > 0.2


def test_auto_tree_widens_only_where_the_curve_leaves_room_beside_the_chain() -> None:
    """Width as for --tree N, from the tokens that verify for the chain's price: flat to
    17 tokens, a 3-deep chain leaves room for 4 alternatives per depth, a 9-deep one
    for a second choice per depth; on a knee at 8 the 6-deep chain too."""
    policy = AutoTree(knee_costs(17), 32)
    assert policy.flat_nodes(3, 32) == policy.flat_nodes(9, 32) == 16
    assert [policy.shape(k, 100).width for k in (3, 5, 9)] == [4, 3, 2]  # type: ignore[union-attr]
    assert AutoTree(knee_costs(8), 32).shape(6, 100).width == 2  # type: ignore[union-attr]


def test_auto_tree_shares_the_flat_part_with_other_slots() -> None:
    """Flat to 8 tokens: alone, a 3-deep chain leaves room for alternatives; beside 4
    tokens of other slots in the same call, its batch fills the flat part (a chain),
    and a 1-deep chain's still leaves room."""
    policy = AutoTree(knee_costs(8), 32)
    assert policy.shape(3, 100) is not None
    assert policy.shape(3, 100, beside=4) is None
    assert policy.shape(1, 100, beside=3) is not None


def test_auto_tree_fills_the_flat_part_of_the_curve(
    target_model: Path, draft_model: Path, reference
) -> None:
    """Where 8 tokens cost as much as 1 and each more a whole pass, trees grow to 7
    draft tokens (a batch of 8), never beyond, and stay lossless."""
    with open_engine(target_model, draft_model, 3, GREEDY, tree="auto") as engine:
        decoder = engine.make_decoder("model", "3", "auto")
        decoder.tree = AutoTree(knee_costs(8), 32)
        out, stats = generate(engine, 64, decoder=decoder)
    assert out == reference
    assert max(stats.batch_sizes) == 8


# The draft's first choice at the root (0.04), an alternative beside it (0.03), and the
# first choice below the first (0.04): a draft unsure even where it is right.
UNSURE_TREE = Draft([5, 6, 7], confidences=[0.04, 0.03, 0.04], calls=2, parents=[-1, -1, 0])


def test_first_choices_score_what_they_were_worth() -> None:
    odds = NodeOdds()
    assert odds.chance(0, 0.04) == 0.04  # nothing learnt yet: the draft's own
    for _ in range(20):
        odds.observe(UNSURE_TREE, [0, 2])  # the target took both first choices
    assert odds.chance(0, 0.04) > 0.9
    assert odds.chance(0, 0.6) == 0.6  # another band: nothing learnt there
    assert odds.chance(1, 0.03) == 0.03  # alternatives keep the draft's probability
    odds.begin()
    for _ in range(20):
        odds.observe(UNSURE_TREE, [1])  # it took the alternative: the first was refused,
    assert odds.chance(0, 0.04) < 0.01  # and the one below it was never offered
    odds.observe(Draft([5, 6]), [0, 1])  # a lookup's draft: no probabilities to learn
    assert odds.chance(0, 0.04) < 0.01


@pytest.mark.parametrize(
    "make", [lambda: FixedTree(16), lambda: AutoTree(flat_costs(0.003), 32)], ids=["fixed", "auto"]
)
def test_tree_policies_score_nodes_with_what_this_generation_learnt(make) -> None:
    policy = make()
    for _ in range(10):
        policy.shape(k=3, limit=100)
        policy.observe(UNSURE_TREE, [0, 2])
    shape = policy.shape(k=3, limit=100)
    assert shape is not None and shape.odds is not None and shape.odds(0, 0.04) > 0.8
    policy.begin()  # a new generation starts from the draft's own probabilities
    assert policy.shape(k=3, limit=100).odds(0, 0.04) == 0.04  # type: ignore[union-attr]


def test_draft_paths() -> None:
    draft = Draft([10, 20, 30, 11, 12, 31], parents=[-1, -1, -1, 0, 0, 2])
    assert draft.primary_path() == [10, 11]
    assert draft.depth == 2
    assert draft.beside_primary([0, 3]) == 0
    assert draft.beside_primary([2, 5]) == 2
    assert draft.beside_primary([0, 4]) == 1
    chain = Draft([5, 6, 7])
    assert (
        chain.primary_path() == [5, 6, 7]
        and chain.depth == 3
        and chain.parent_list()
        == [
            -1,
            0,
            1,
        ]
    )


def test_ngram_tree_branches_on_every_continuation() -> None:
    """ "a b" was followed by c d, then by e f, then by c g: the latest first, a shared
    start (c) is one node; a chain takes the latest alone."""
    a, b, c, d, e, f, g = range(1, 8)
    tokens = [a, b, c, d, 0, a, b, e, f, 0, a, b, c, g, 0, a, b]
    lookup = NgramDrafter(1, 2)
    rng = np.random.default_rng(0)
    lookup.begin(tokens)
    tree = propose(lookup, tokens, 2, rng, shape=TreeShape(8, 3, 3))
    assert tree.tokens == [c, g, e, f, d]
    assert tree.parents == [-1, 0, -1, 2, 0]
    lookup.begin(tokens)
    assert propose(lookup, tokens, 2, rng).tokens == [c, g]
    lookup.begin(tokens)
    small = propose(lookup, tokens, 2, rng, shape=TreeShape(3, 3, 3))
    assert small.tokens == [c, g, e] and small.parents == [-1, 0, -1]


def test_bench_variants_with_trees() -> None:
    names = [v.name for v in variants(["model"], ["3"], ["off", "auto", "16"])]
    assert names == ["target only", "model k=3", "model k=3 tree=auto", "model k=3 tree=16"]
    assert widest_tree(["off", "16", "auto"]) == "auto"  # auto's 32 covers 16
    assert widest_tree(["off", "64", "auto"]) == "64"
    assert widest_tree(["off"]) == "off"
    with pytest.raises(UserError, match="--tree must be"):
        variants(["model"], ["3"], ["1"])
