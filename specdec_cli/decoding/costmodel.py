"""What speculative decoding can gain at best, from acceptance and measured costs.

Costs are in units of one target forward pass on one token:
  c            the draft's cost per decode call (one token),
  verify[n]    the target's cost to evaluate n tokens in one batch (verify[1] == 1).
Target-only decoding costs 1 per token, so a speedup is tokens / cost.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.llamacpp import costcache

if TYPE_CHECKING:
    from specdec_cli.llamacpp.llama import Context


def verify_cost(verify: Mapping[int, float], n: int) -> float:
    """verify[n], extrapolated past the largest batch measured (a tree can be wider than
    any chain, a prompt read beside drafts wider still): each further token costs what
    one added, on average, over the upper half of the measured sizes. Not the last one
    alone: a measured curve wobbles, and a last step that fell would make every larger
    batch cheaper."""
    if n in verify:  # a lookup: this is priced many times a decode step (fit_to_batch)
        return verify[n]
    top = max(verify)
    half = top // 2
    step = (verify[top] - verify[half]) / (top - half) if half else verify[top]
    return verify[top] + (n - top) * max(0.0, step)


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens one round yields when each draft token is accepted independently with
    probability alpha: 1 + alpha + ... + alpha^k (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, verify: Mapping[int, float]) -> float:
    """Speedup of a perfect implementation drafting k tokens every round."""
    return expected_tokens_per_pass(alpha, k) / (k * c + verify[k + 1])


def ideal_speedup(
    tokens: int,
    draft_calls: int,
    batch_sizes: Mapping[int, int],
    c: float,
    verify: Mapping[int, float],
) -> float:
    """Speedup a perfect implementation would reach on the rounds a run actually had:
    the same tokens, draft calls and verification batches, with no time spent outside
    llama.cpp. This is the bound a measured speedup is held against."""
    cost = draft_calls * c + sum(verify_cost(verify, n) * r for n, r in batch_sizes.items())
    return tokens / cost if cost > 0 else 0.0


def best_expected_k(alpha: float, c: float, verify: Mapping[int, float]) -> tuple[int, float]:
    """The k with the highest expected speedup among those verify covers, and that speedup."""
    ks = [n - 1 for n in verify if n >= 2]
    best = max(ks, key=lambda k: expected_speedup(alpha, k, c, verify))
    return best, expected_speedup(alpha, best, c, verify)


@dataclass(frozen=True)
class Costs:
    """Measured costs: seconds for one target token, and the ratios above.

    `switch` is the extra cost, in the same units, of a target pass whose batch size
    differs from the previous one's: llama.cpp reuses its compute graph only while the
    batch keeps its shape, and rebuilding it is not free.
    """

    target_seconds: float
    draft_over_target: float  # a draft call (one token), over one target token
    verify: dict[int, float]
    switch: float = 0.0
    # Draft calls that draft one target token: 1 with the target's vocabulary; more for
    # a draft of another vocabulary, whose tokens are shorter (set by the policy, not
    # measured: see Policy's costs for a drafter).
    calls_per_token: float = 1.0
    # Draft calls a round pays whatever its length: 1 for a block drafter (DFlash), whose
    # one call drafts the whole block (set by the policy, as calls_per_token is).
    calls_per_round: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "target_ms_per_token": round(self.target_seconds * 1e3, 4),
            "draft_over_target": round(self.draft_over_target, 4),
            "verify_cost": {str(n): round(v, 4) for n, v in sorted(self.verify.items())},
            "batch_size_switch_cost": round(self.switch, 4),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Costs:
        """Costs as to_dict writes them (a `specdec bench --json` file's "cost")."""
        verify = {int(n): float(v) for n, v in data["verify_cost"].items()}
        return cls(
            data["target_ms_per_token"] / 1e3,
            data["draft_over_target"],
            verify,
            data["batch_size_switch_cost"],
        )


SETTLE = 3  # passes of one batch shape, the last timed as its steady cost
# One-token passes are decoded until they stop getting faster, in windows of
# SETTLE_WINDOW passes, at most MAX_SETTLE of them (see _steady_one_token).
SETTLE_WINDOW = 4
MAX_SETTLE = 32
STILL_FALLING = 0.99  # a window this much faster than the one before: not settled yet


def measure_costs(
    target: Context,
    draft: Context | None,
    sizes: Iterable[int],
    reps: int = 9,
    position: int = 8,
) -> Costs:
    """Time the target on batches of each size in `sizes` and the draft on one token;
    sizes in between are interpolated linearly.

    Batches are evaluated after `position` context tokens and cut away again, so the
    caches are left empty. Each repetition starts with one-token target passes, decoded
    until they stop getting faster, and times the draft and then each size, smallest
    first, as a ratio to them: the machine's speed drifts by tens of percent within
    seconds, and a ratio of timings a fraction of a second apart cancels most of that.
    The order matters: a pass after a bigger batch is slow, and on a model whose
    weights nearly fit the CPU's caches it stays slow for tens of passes (the wide pair:
    benchmarks/README.md, "Draft length"); timed there, one token looked dear and every
    batch cheap (two tokens cheaper than one). A pass after a smaller one is at its
    steady cost at once.

    Each batch is decoded SETTLE times in a row: the first pass pays for the change of
    batch shape, the last is the steady cost (on a GPU the second is slow too:
    llama.cpp's CUDA backend captures a graph there; timed second, every batch looked
    nearly free: benchmarks/README.md, "On a GPU"). Medians, after one untimed round.
    """
    sizes = sorted({1, *sizes})
    probes = ([(draft, 1)] if draft is not None else []) + [(target, n) for n in sizes[1:]]
    for ctx, _ in [(target, 1), *probes]:
        _fill([ctx], position)

    one: list[float] = []
    ratio: dict[int, list[float]] = {i: [] for i in range(len(probes))}
    rebuild: list[float] = []  # the extra cost of a first pass, in one-token passes
    for rep in range(reps + 1):
        base = _steady_one_token(target, position)
        for i, (ctx, n) in enumerate(probes):
            first, steady = _settled([ctx], n, position)
            if rep:
                ratio[i].append(steady / base)
                if ctx is target:
                    rebuild.append((first - steady) / base)
        if rep:
            one.append(base)
    for ctx, _ in [(target, 1), *probes]:
        ctx.rewind(0)
    medians = [statistics.median(ratio[i]) for i in range(len(probes))]
    c = medians.pop(0) if draft is not None else 0.0
    ratios = [1.0, *medians]
    verify = {n: float(np.interp(n, sizes, ratios)) for n in range(1, sizes[-1] + 1)}
    switch = max(0.0, statistics.median(rebuild)) if rebuild else 0.0
    return Costs(statistics.median(one), c, verify, switch)


FLASH_ATTN_BATCHES = (1, 4)  # a slot's drafting step, and a typical verification batch


def time_decodes(
    contexts: Mapping[str, Sequence[Context]], position: int, reps: int = 5
) -> dict[str, dict[int, float]]:
    """Seconds each context takes, with each of its slots `position` tokens into its
    cache, to decode one batch of each size in FLASH_ATTN_BATCHES from every slot in one
    call, as a server's step does: by size. Each size is decoded SETTLE times and the
    last, steady pass is timed; the contexts take turns, in alternating order, so that
    the machine's drift hits them alike; medians, after one untimed round."""
    names = list(contexts)
    for slots in contexts.values():
        _fill(slots, position)

    samples = {name: {n: [] for n in FLASH_ATTN_BATCHES} for name in names}
    for rep in range(reps + 1):
        for name in names if rep % 2 else names[::-1]:
            for n in FLASH_ATTN_BATCHES:
                seconds = _settled(contexts[name], n, position)[1]
                if rep:
                    samples[name][n].append(seconds)
    for slots in contexts.values():
        for ctx in slots:
            ctx.rewind(0)
    return {
        name: {n: statistics.median(times) for n, times in by_size.items()}
        for name, by_size in samples.items()
    }


def _filler(ctx: Context) -> int:
    """A token to fill a context with: BOS, or id 0 for a model without one."""
    return max(ctx.model.bos, 0)


def _fill(slots: Sequence[Context], position: int) -> None:
    """Each slot (of one llama.cpp context: see Context.split) `position` tokens deep."""
    for ctx in slots:
        ctx.rewind(0)
        ctx.decode([_filler(ctx)] * position, 0)


def _settled(slots: Sequence[Context], n: int, position: int) -> tuple[float, float]:
    """Seconds of the first pass of a batch of n tokens a slot (the shape changed) and
    of the last of SETTLE passes (the steady cost)."""
    times = [_timed_pass(slots, n, position) for _ in range(SETTLE)]
    return times[0], times[-1]


def _steady_one_token(target: Context, position: int) -> float:
    """Seconds of a one-token target pass once they stop getting faster: decoded in
    windows of SETTLE_WINDOW until a window's median is no longer STILL_FALLING below
    the one before (at most MAX_SETTLE passes); the last window's median."""
    times: list[float] = []
    while len(times) < MAX_SETTLE:
        times += [_timed_pass([target], 1, position) for _ in range(SETTLE_WINDOW)]
        if len(times) >= 2 * SETTLE_WINDOW:
            window = statistics.median(times[-SETTLE_WINDOW:])
            before = statistics.median(times[-2 * SETTLE_WINDOW : -SETTLE_WINDOW])
            if window >= STILL_FALLING * before:
                break
    return statistics.median(times[-SETTLE_WINDOW:])


def _timed_pass(slots: Sequence[Context], n: int, position: int) -> float:
    """Seconds of one _decode_and_drop (every slot's clock counts the call they share)."""
    clock = slots[0]
    before = clock.decode_seconds
    _decode_and_drop(slots, n, position)
    return clock.decode_seconds - before


def _decode_and_drop(slots: Sequence[Context], n: int, position: int) -> None:
    """n tokens a slot with logits for all, as a verification has, in one decode call;
    then forgotten (a recurrent state back to its checkpoint, taken at `position`)."""
    for ctx in slots:
        if ctx.recurrent:
            ctx.checkpoint()  # the whole batch goes: more than snapshots undo
        ctx.stage([_filler(ctx)] * n, n)
    slots[0].flush()
    for ctx in slots:
        ctx.rewind(position)


def median_costs(measured: Sequence[Costs]) -> Costs:
    """Field by field medians of several measurements."""

    def median(get: Callable[[Costs], float]) -> float:
        return statistics.median(get(m) for m in measured)

    sizes = measured[0].verify
    return Costs(
        median(lambda m: m.target_seconds),
        median(lambda m: m.draft_over_target),
        {n: median(lambda m, n=n: m.verify[n]) for n in sizes},
        median(lambda m: m.switch),
    )


def load_costs(key: str) -> list[Costs]:
    """The measurements kept in the cache under `key` (see costcache), oldest first
    (none: an empty list)."""
    data = costcache.load_entry("costs", key)
    if data is None:
        return []
    try:
        return [_cached_costs(dict(measurement)) for measurement in data["measurements"]]
    except (ValueError, KeyError, TypeError, AttributeError):  # damaged, or an old format
        return []


def _cached_costs(data: dict[str, Any]) -> Costs:
    verify = {int(n): float(v) for n, v in data.pop("verify").items()}
    return Costs(**{name: float(v) for name, v in data.items()}, verify=verify)


def save_costs(key: str, measured: Sequence[Costs]) -> None:
    """Keep the last costcache.MEASUREMENTS of `measured` under `key`. (LoadedModels adds
    to fewer than MEASUREMENTS only, so the first, which rejection-sampled generations
    price with, is never dropped.)"""
    kept = [dataclasses.asdict(costs) for costs in measured[-costcache.MEASUREMENTS :]]
    costcache.save_entry("costs", key, {"measurements": kept})
