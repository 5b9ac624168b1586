"""benchmarks/replay_tree.py: its replayed rounds are a real greedy run's rounds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from benchscripts import load_benchmark
from test_decode import open_engine

from specdec_cli.decoding.draft import Draft
from specdec_cli.decoding.draftlength import AutoLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.modeldrafter import ModelDrafter
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.decoding.treeshape import AutoTree

N_PREDICT = 40


@pytest.fixture(scope="module")
def replay_tree() -> ModuleType:
    return load_benchmark("replay_tree")


def test_accepted_path_follows_the_text_down_the_tree(replay_tree: ModuleType) -> None:
    # 5 -> 7 and 6 -> 8 from the root; the text goes 6, 8, 9: the second branch, whole.
    draft = Draft(tokens=[5, 7, 6, 8], parents=[-1, 0, -1, 2])
    assert replay_tree.accepted_path(draft, [6, 8, 9]) == [2, 3]
    assert replay_tree.accepted_path(Draft(tokens=[6, 9]), [6, 8, 9]) == [0]


@pytest.mark.parametrize("tree", [None, 8])
def test_replay_has_the_rounds_of_a_real_run(
    replay_tree: ModuleType, target_model: Path, draft_model: Path, tree: int | None
) -> None:
    """Per built-in prompt, the rounds replayed on the target's recorded text are a real
    greedy run's with the same k and tree: the tokens each kept, the batches the target
    verified, the draft calls made."""
    drafting = DraftOptions(k="3", tree="off" if tree is None else str(tree))
    options = EngineOptions(
        target=target_model, draft=draft_model, ngram=False, n_ctx=256, threads=1,
        sampling=GREEDY, drafting=drafting,
    )  # fmt: skip
    policy = replay_tree.Policy(3, tree)
    with Engine(options) as engine:
        assert engine.draft_ctx is not None
        drafter = ModelDrafter(engine.draft_ctx, GREEDY, engine.model.n_vocab)
        for prompt, text in replay_tree.record_texts(engine, N_PREDICT).values():
            stats = Stats()
            real = list(engine.decoder.generate(prompt, N_PREDICT, np.random.default_rng(0), stats))
            assert stats.stop_reason == "length"
            assert [t for r in real for t in r.tokens] == text
            made = policy.make(engine.policy, "model", None)
            rounds = replay_tree.simulate(drafter, prompt, text, *made)
            assert [r.tokens for r in rounds] == [len(r.tokens) for r in real]
            assert Counter(r.batch for r in rounds) == stats.batch_sizes
            assert sum(r.calls for r in rounds) == stats.draft_calls


def test_a_replayed_policy_is_the_engines_for_its_drafter(
    replay_tree: ModuleType,
    real_vocab_pair: Callable[[str], tuple[Path, Path]],
    stories260k: Path,
) -> None:
    """A replay prices -k auto and --tree auto with a modelled curve, but otherwise makes
    them as the engine does for its drafter: a translated draft's prior, margin and draft
    calls a target token included (without them it drafted deeper than a run would)."""
    memory = replay_tree.MODEL_CURVES["memory"]
    with open_engine(real_vocab_pair("gemma-4")[0], stories260k, "auto") as engine:
        assert engine.translation is not None
        calls = engine.translation.calls_per_token
        length, tree = replay_tree.Policy(None, "auto").make(engine.policy, "model", memory)
        engines = engine.make_decoder("model", "auto").length
    assert isinstance(length, AutoLength) and isinstance(engines, AutoLength)
    assert (length.prior, length.margin) == (engines.prior, engines.margin)
    assert (length.prior, length.margin) != (AutoLength.PRIOR, 0.0)  # a translated draft's
    assert length.costs.calls_per_token == engines.costs.calls_per_token == calls > 1.5
    assert length.costs.verify == memory.verify  # the modelled curve, not the measured one
    assert isinstance(tree, AutoTree) and tree.costs.calls_per_token == calls
