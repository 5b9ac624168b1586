"""The cost model: hand-computed speedups, and cost measurement on the tiny fixture models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from specdec_cli.decoding.costmodel import (
    Costs,
    best_expected_k,
    expected_speedup,
    expected_tokens_per_pass,
    ideal_speedup,
    measure_costs,
    verify_cost,
)
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, init_backend

# --- expected_tokens_per_pass: 1 + alpha + ... + alpha^k ---


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_nothing_accepted_gives_one_token_per_pass(k: int) -> None:
    assert expected_tokens_per_pass(0.0, k) == 1.0


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_everything_accepted_gives_k_plus_one(k: int) -> None:
    assert expected_tokens_per_pass(1.0, k) == k + 1


@pytest.mark.parametrize(
    ("alpha", "k", "tokens"),
    [
        (0.5, 1, 1.5),  # 1 + 0.5
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.5, 3, 1.875),  # 1 + 0.5 + 0.25 + 0.125
        (0.8, 4, 3.3616),  # 1 + 0.8 + 0.64 + 0.512 + 0.4096
        (0.1, 2, 1.11),  # 1 + 0.1 + 0.01
    ],
)
def test_tokens_per_pass_hand_computed(alpha: float, k: int, tokens: float) -> None:
    assert expected_tokens_per_pass(alpha, k) == pytest.approx(tokens)


def test_tokens_per_pass_grows_with_alpha_and_k() -> None:
    assert expected_tokens_per_pass(0.6, 3) < expected_tokens_per_pass(0.7, 3)
    assert expected_tokens_per_pass(0.6, 3) < expected_tokens_per_pass(0.6, 4)
    # Near 1 the closed form must still approach k + 1 without dividing by ~0 badly.
    assert expected_tokens_per_pass(0.999999, 4) == pytest.approx(5.0, rel=1e-5)


# --- expected_speedup: tokens per round / (k * c + verify[k + 1]) ---


def test_expected_speedup_hand_computed() -> None:
    # alpha 0.8, k 4: tokens = 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616
    # cost = 4 draft calls * 0.05 + verify[5] = 0.2 + 1.3 = 1.5
    # speedup = 3.3616 / 1.5 = 2.241066...
    assert expected_speedup(0.8, 4, 0.05, {5: 1.3}) == pytest.approx(3.3616 / 1.5)
    assert expected_speedup(0.8, 4, 0.05, {5: 1.3}) == pytest.approx(2.2410667, rel=1e-6)


def test_expected_speedup_free_draft_flat_verify() -> None:
    # c = 0, verify[2] = 1: one round costs one target pass and yields 1 + alpha tokens.
    assert expected_speedup(0.6, 1, 0.0, {2: 1.0}) == pytest.approx(1.6)


def test_expected_speedup_nothing_accepted_is_a_slowdown() -> None:
    # alpha 0: 1 token for 2 * 0.1 + 1.2 = 1.4 -> 1 / 1.4
    assert expected_speedup(0.0, 2, 0.1, {3: 1.2}) == pytest.approx(1 / 1.4)


# --- ideal_speedup: tokens / (draft_calls * c + sum verify[n] * rounds) ---


def test_ideal_speedup_hand_computed() -> None:
    # cost = 120 * 0.1 + verify[4] * 30 + verify[1] * 10 = 12 + 36 + 10 = 58
    # speedup = 100 / 58 = 1.72413...
    verify = {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2}
    assert ideal_speedup(100, 120, {4: 30, 1: 10}, 0.1, verify) == pytest.approx(100 / 58)


def test_ideal_speedup_of_target_only_is_one() -> None:
    # 50 rounds of one token each, no draft: cost 50 * verify[1] = 50.
    assert ideal_speedup(50, 0, {1: 50}, 0.3, {1: 1.0}) == 1.0


def test_ideal_speedup_zero_cost_is_zero() -> None:
    assert ideal_speedup(0, 0, {}, 0.1, {1: 1.0}) == 0.0
    assert ideal_speedup(10, 0, {}, 0.0, {1: 1.0}) == 0.0


# --- best_expected_k ---


def test_best_expected_k_hand_computed() -> None:
    verify = {1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0}
    # alpha 0.5, c 0:  k=1: 1.5 / 1.1 = 1.364;  k=2: 1.75 / 1.2 = 1.458;  k=3: 1.875 / 2.0 = 0.9375
    k, speedup = best_expected_k(0.5, 0.0, verify)
    assert k == 2
    assert speedup == pytest.approx(1.75 / 1.2)


def test_best_expected_k_nothing_accepted_picks_one_and_stays_below_one() -> None:
    # alpha 0: every k yields 1 token; k=1 is the cheapest at 0.1 + 1.1 = 1.2.
    k, speedup = best_expected_k(0.0, 0.1, {1: 1.0, 2: 1.1, 3: 1.2})
    assert k == 1
    assert speedup == pytest.approx(1 / 1.2)


def test_best_expected_k_free_drafting_and_flat_verify_takes_the_largest_k() -> None:
    verify = {n: 1.0 for n in range(1, 9)}
    k, speedup = best_expected_k(0.9, 0.0, verify)
    assert k == 7
    assert speedup == pytest.approx(expected_tokens_per_pass(0.9, 7))


# --- measure_costs on the tiny fixture models ---

N_CTX = 64


@pytest.fixture(scope="module")
def contexts(target_model: Path, draft_model: Path) -> Iterator[tuple[Context, Context]]:
    init_backend()
    target = Model(target_model)
    draft = Model(draft_model)
    target_ctx = Context(target, ContextParams(N_CTX, 1))
    draft_ctx = Context(draft, ContextParams(N_CTX, 1))
    yield target_ctx, draft_ctx
    for obj in (draft_ctx, target_ctx, draft, target):
        obj.close()


def cache_end(ctx: Context) -> int:
    """The last position the KV cache holds for sequence 0; -1 when it is empty."""
    return llama_cpp.llama_memory_seq_pos_max(ctx.memory, 0)


def test_measure_costs_shape_and_values(contexts: tuple[Context, Context]) -> None:
    target, draft = contexts
    costs = measure_costs(target, draft, [4, 8], reps=2)
    assert isinstance(costs, Costs)
    assert costs.target_seconds > 0
    assert costs.draft_over_target > 0
    assert costs.verify[1] == 1.0
    assert sorted(costs.verify) == list(range(1, 9))
    assert all(v > 0 for v in costs.verify.values())


def test_measure_costs_interpolates_linearly(contexts: tuple[Context, Context]) -> None:
    target, draft = contexts
    v = measure_costs(target, draft, [4, 8], reps=2).verify
    # 1, 4 and 8 are measured; 2 and 3 lie on the line from 1 to 4, 5 to 7 from 4 to 8.
    assert v[2] == pytest.approx(v[1] + (v[4] - v[1]) / 3)
    assert v[3] == pytest.approx(v[1] + 2 * (v[4] - v[1]) / 3)
    for n in (5, 6, 7):
        assert v[n] == pytest.approx(v[4] + (n - 4) * (v[8] - v[4]) / 4)


def test_measure_costs_without_draft(contexts: tuple[Context, Context]) -> None:
    target, _ = contexts
    costs = measure_costs(target, None, [3], reps=1)
    assert costs.draft_over_target == 0.0
    assert sorted(costs.verify) == [1, 2, 3]


def test_measure_costs_leaves_the_caches_empty(contexts: tuple[Context, Context]) -> None:
    target, draft = contexts
    prompt = target.model.tokenize("Once upon a time")
    target.rewind(0)
    target.decode(prompt, 0)
    before = np.array(target.logits(-1))
    target.rewind(0)

    measure_costs(target, draft, [2, 5], reps=1, position=8)

    assert cache_end(target) == -1
    assert cache_end(draft) == -1
    # Decoding from position 0 works (llama.cpp refuses it when positions are cached)
    # and gives the same logits as before the measurement.
    target.decode(prompt, 0)
    np.testing.assert_array_equal(np.array(target.logits(-1)), before)
    target.rewind(0)
    draft.decode(prompt, 0)
    draft.rewind(0)


def test_measure_costs_of_one_token_only(contexts: tuple[Context, Context]) -> None:
    target, _ = contexts
    costs = measure_costs(target, None, [1], reps=1)
    assert costs.verify == {1: 1.0} and costs.target_seconds > 0


class LingeringContext:
    """A fake target whose n-token pass costs 1 + (n - 1) / 2 units once steady, and
    whose passes after a bigger batch run slow: LINGER times the bigger size's excess
    tokens, fading by FADE a pass (as the wide pair's do on a CPU, over tens of
    passes). measure_costs reads only its clock."""

    UNIT, LINGER, FADE = 1e-3, 0.05, 0.85

    def __init__(self) -> None:
        self.model = type("FakeModel", (), {"bos": 1})()
        self.recurrent = False
        self.decode_seconds = 0.0
        self.staged = 0
        self.slow, self.slow_after = 0.0, 1  # the fading excess, and the size that left it

    def steady(self, n: int) -> float:
        return self.UNIT * (1 + (n - 1) / 2)

    def rewind(self, position: int) -> None:
        pass

    def decode(self, tokens: list[int], position: int) -> None:
        pass

    def stage(self, tokens: list[int], n_logits: int) -> None:
        self.staged += len(tokens)

    def flush(self) -> None:
        n, self.staged = self.staged, 0
        lingering = self.slow if n < self.slow_after else 0.0
        self.decode_seconds += self.steady(n) * (1 + lingering)
        if n >= self.slow_after:
            self.slow, self.slow_after = self.LINGER * (n - 1), n
        else:
            self.slow *= self.FADE


def test_measure_costs_waits_out_a_bigger_batch_s_slowdown() -> None:
    """One-token passes are timed once steady, not in the slowdown a bigger batch leaves:
    there they looked dear, and 2 tokens cheaper than 1."""
    target = LingeringContext()
    costs = measure_costs(target, None, [2, 3, 5, 17], reps=3)  # type: ignore[arg-type]
    assert costs.target_seconds == pytest.approx(target.steady(1), rel=0.02)
    for n in (2, 3, 5, 17):
        assert costs.verify[n] == pytest.approx(target.steady(n) / target.steady(1), rel=0.02)


def test_costs_read_back_as_bench_writes_them() -> None:
    """A bench's --json "cost" is Costs.to_dict: from_dict reads it back (replay_costs.py
    plans with another machine's costs so)."""
    costs = Costs(0.0012, 0.45, {1: 1.0, 2: 1.1, 3: 1.19}, 1.08)
    assert Costs.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs


def test_verify_cost_past_the_measured_sizes_never_falls() -> None:
    """A measured curve's last step can fall (noise, as on the benchmark pair's 130 to
    132 tokens): extrapolated from it, every larger batch would cost less. The slope of
    the upper half goes on instead."""
    curve = {n: 1.0 + 0.25 * (n - 1) for n in range(1, 130)} | {130: 32.0, 131: 31.5, 132: 31.0}
    assert verify_cost(curve, 131) == 31.5  # measured: as measured
    beyond = [verify_cost(curve, n) for n in (133, 150, 200)]
    assert beyond == sorted(beyond) and beyond[0] > curve[132]
    assert verify_cost(curve, 200) - verify_cost(curve, 150) == pytest.approx(50 * 0.22, rel=0.1)
    assert verify_cost({1: 1.0}, 3) == 3.0  # one size measured: each token a pass
