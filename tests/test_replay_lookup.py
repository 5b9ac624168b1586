"""-k auto with the n-gram lookup, replayed over its real guesses on Spec-Bench's prompts
(tests/data/lookup: SmolLM2-135M-Instruct and Gemma 3 270M), under fixed cost curves: no
timing, so the rule itself is what is tested. Where verification is dear (a CPU), the
lookup must never make a category slower than the target alone; where it is nearly flat
(a GPU), it must keep what fixed lengths gain."""

from __future__ import annotations

import statistics
from pathlib import Path
from types import ModuleType

import pytest
from benchscripts import load_benchmark

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.decoding.draftlength import AutoLength

DATA = Path(__file__).resolve().parent / "data" / "lookup"
TRACES = ["smollm2-spec-bench.json", "gemma3-270m-spec-bench.json"]
# Verifying n tokens against one: Gemma 3 270M on two CPU cores (a 262k vocabulary: every
# row's logits are most of the work; ../shared/NOTES.md), and a GPU's nearly flat curve up
# to 8 tokens, a step at 9 (benchmarks/README.md, "On a GPU").
CPU = {1: 1.0, 2: 1.81, 3: 2.13, 4: 2.31, 5: 3.46, 6: 3.5, 7: 3.5, 8: 3.5, 9: 4.0}
GPU = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08, 6: 1.1, 7: 1.12, 8: 1.14, 9: 1.6}
PYTHON = 0.05  # a round's time outside llama.cpp, in target tokens


def costs(verify: dict[int, float]) -> Costs:
    full = {n: verify.get(n, verify[9] + 0.3 * (n - 9)) for n in range(1, 18)}
    return Costs(0.01, 0.0, full, switch=0.05)


@pytest.fixture(scope="module")
def replay_lookup() -> ModuleType:
    return load_benchmark("replay_lookup")


def speedups(module: ModuleType, name: str, curve: dict[int, float], **options) -> dict:
    """Each policy's speedup over the target alone, by category."""
    speeds = module.replay(module.load_traces(DATA / name), costs(curve), PYTHON, **options)
    base = speeds["target alone"]
    return {policy: {c: s[c] / base[c] for c in base} for policy, s in speeds.items()}


@pytest.mark.parametrize("name", TRACES)
def test_where_verifying_is_dear_auto_is_never_slower(replay_lookup: ModuleType, name) -> None:
    auto = speedups(replay_lookup, name, CPU)["auto"]
    slowest = min(auto, key=auto.__getitem__)
    assert auto[slowest] >= 0.98, (slowest, auto)


@pytest.mark.parametrize("name", TRACES)
def test_where_verifying_is_flat_auto_keeps_the_gain(replay_lookup: ModuleType, name) -> None:
    by_policy = speedups(replay_lookup, name, GPU)
    overall = {p: statistics.geometric_mean(s.values()) for p, s in by_policy.items()}
    best_fixed = max(v for p, v in overall.items() if p.startswith("k="))
    assert overall["auto"] >= 0.97 * best_fixed, overall
    assert min(by_policy["auto"].values()) > 1.0


def test_the_old_rule_was_slower(replay_lookup: ModuleType, monkeypatch) -> None:
    """The control: 1-gram matches looked up, and every generation starting afresh from
    the prior (the rule before), lose to the target alone in some category of SmolLM2's."""
    begin = AutoLength.begin
    monkeypatch.setattr(AutoLength, "begin", lambda self, invariant=False: begin(self, False))
    auto = speedups(replay_lookup, TRACES[0], CPU, n_min=1)["auto"]
    assert min(auto.values()) < 0.95, auto
