"""-fa auto: whether flash attention runs a model faster on this machine, and the
evidence behind that choice, kept in the cache per model and settings.

The choice is only as good as the timing behind it, and one timing was not enough: taken
once, 512 tokens deep, it kept flash attention off for a target whose runs (under 200
tokens) ran 7 % faster with it on. So, as the cost curve is:

- it is measured where the runs are: as deep as the runs on this model went (the median
  of the last RUNS_KEPT, to the nearest power of two; FIRST_DEPTH before any ran), and
  no deeper than half a slot's share of the context (rounded down to a power of two, as
  the runs' depths are, so that both land on the same depths);
- more than once: each run adds a measurement at that depth until there are
  costcache.MEASUREMENTS, and their median decides;
- and checked against what the runs then spend: every run keeps what its small decode
  calls (a verification's, not a prompt's) cost a call, and how many tokens they held.
  Where the runs of the setting in use spent more or less than its measurements say a
  call of that size costs, by more than STALE, the measurements were not taken as the
  runs are (another depth, a busy machine): they are taken again. Only runs whose calls
  were of sizes between those measured are checked: a cost curve bends, and a line
  drawn past the sizes measured says nothing about a call of 9 or 17 tokens.

A choice, once made, holds still: each change of setting changes the logits' last bits,
and with them a greedy text (llama.cpp's own `auto` decides by what the backend supports,
so its text never moves from one run to the next). It changes only where the median of
at least MEASUREMENTS measurements at the runs' depth puts the other setting ahead by
more than NEAR_TIE, and the last SHOWN_IN_A_ROW of them each do too: a noisy near tie,
measured afresh, does not flip it. The run that switches says so (FlashAttnChoice).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdec_cli.decoding.costmodel import FLASH_ATTN_BATCHES
from specdec_cli.llamacpp import costcache

# Seconds of a decode call, by setting ("on", "off") and tokens a slot.
Timings = dict[str, dict[int, float]]

FIRST_DEPTH = 128  # where runs are before any ran: a prompt and a reply
DEPTHS = (32, 8192)  # the shallowest and deepest measurement
RUNS_KEPT = 16
# Measured gaps smaller than this are noise (a measurement of the same setting twice
# differs by a few percent on these machines): they do not change a choice.
NEAR_TIE = 0.05
SHOWN_IN_A_ROW = 2  # the latest measurements that must each show the gap, to switch
# Runs that spend this much more or less a call than measured: measure again.
STALE = 0.25
RUNS_TO_CHECK = 3
MIN_CALLS = 8  # a run with fewer small decode calls says too little to keep
SETTINGS = ("on", "off")


def depth_bucket(depth: float, deepest: int = DEPTHS[1]) -> int:
    """A depth to measure at: the nearest power of two within DEPTHS, and at most the
    power of two at or below `deepest`."""
    low, high = DEPTHS
    nearest = min(high, max(low, 2 ** round(math.log2(max(depth, 1)))))
    return min(nearest, 1 << (max(deepest, 1).bit_length() - 1))


@dataclass
class FlashAttnRecord:
    """What was measured of flash attention for one model and settings, what was chosen,
    and what the runs spent (see the module's docstring)."""

    key: str
    # depth, and for "on" and "off" the seconds of a call by tokens a slot ("1", "4")
    measurements: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # depth, used, per_call, size
    chosen: str | None = None
    # Not kept: how deep this engine's context lets a measurement go (half a slot's share)
    deepest: int = DEPTHS[1]
    # ... and the setting this run's verdict switched from (None: it did not switch).
    switched_from: str | None = None

    @classmethod
    def load(cls, key: str, deepest: int = DEPTHS[1]) -> FlashAttnRecord:
        """The record kept under `key`; a damaged one (or another format) is forgotten,
        to be measured again."""
        entry = costcache.load_entry("flash_attn", key) or {}
        try:
            measurements = [_measurement(m) for m in entry.get("measurements", [])]
            runs = [_run(r) for r in entry.get("runs", [])]
            chosen = entry.get("chosen")
            chosen = None if chosen is None else _setting(chosen)
        except (KeyError, TypeError, ValueError, AttributeError):
            return cls(key, deepest=deepest)
        return cls(key, measurements, runs, chosen, deepest)

    def save(self) -> None:
        data = {
            "measurements": self.measurements,
            "runs": self.runs[-RUNS_KEPT:],
            "chosen": self.chosen,
        }
        costcache.save_entry("flash_attn", self.key, data)

    def choose(self, measure: Callable[[int], Timings], check_runs: bool = True) -> str:
        """On or off for this run: `measure` (called with a depth) adds a measurement at
        the runs' depth while fewer than MEASUREMENTS are kept there, after forgetting
        them where `check_runs` and the runs disagree with them; then the verdict."""
        depth = self.depth()
        if check_runs and self.runs_disagree(depth):
            self.measure_again(depth)
        if len(self.measured_at(depth)) < costcache.MEASUREMENTS:
            self.add_measurement(depth, measure(depth))
        return self.verdict(depth)

    def depth(self) -> int:
        """The depth to measure and decide at: where the runs went, at most `deepest`."""
        depths = [r["depth"] for r in self.runs[-RUNS_KEPT:]]
        typical = statistics.median(depths) if depths else FIRST_DEPTH
        return depth_bucket(typical, self.deepest)

    def measured_at(self, depth: int) -> list[dict[str, Any]]:
        return [m for m in self.measurements if m["depth"] == depth]

    def add_measurement(self, depth: int, seconds: Timings) -> None:
        by_size = {used: {str(n): s for n, s in seconds[used].items()} for used in SETTINGS}
        self.measurements.append({"depth": depth, **by_size})
        self.save()

    def add_run(self, depth: int, used: str, per_call: float, size: float) -> None:
        """A run's small decode calls: `per_call` seconds and `size` tokens a slot each,
        the deepest `depth` tokens."""
        run = {"depth": depth_bucket(depth, self.deepest), "used": used}
        self.runs.append(run | {"per_call": per_call, "size": size})
        self.save()

    def verdict(self, depth: int) -> str:
        """Flash attention on or off, from the measurements at this depth: with nothing
        chosen, their median (a tie goes to on: llama.cpp's own choice on a CPU); else
        what was chosen, unless the other setting is clearly ahead (see the module's
        docstring)."""
        measured, previous = self.measured_at(depth), self.chosen
        self.switched_from = None
        if previous is None:
            on_ahead = statistics.median(_gain("on", m) for m in measured) >= 0
            self.chosen = "on" if on_ahead else "off"
        elif _clearly_ahead(_other(previous), measured):
            self.chosen, self.switched_from = _other(previous), previous
        if self.chosen != previous:
            self.save()
        return self.chosen

    def runs_disagree(self, depth: int) -> bool:
        """Whether the last RUNS_TO_CHECK runs at this depth, with the setting chosen
        there and calls of sizes measured, spent a call more or less than its
        measurements say by more than STALE."""
        used, measured = self.chosen, self.measured_at(depth)
        low, high = min(FLASH_ATTN_BATCHES), max(FLASH_ATTN_BATCHES)
        runs = [
            r
            for r in self.runs
            if r["depth"] == depth and r["used"] == used and low <= r["size"] <= high
        ]
        if not measured or len(runs) < RUNS_TO_CHECK:
            return False
        spent = statistics.median(
            r["per_call"] / _call_seconds(measured, used, r["size"]) for r in runs[-RUNS_TO_CHECK:]
        )
        return abs(spent - 1.0) > STALE

    def measure_again(self, depth: int) -> None:
        """Forget the measurements at this depth (and the runs checked against them);
        what was chosen stands until new ones say otherwise."""
        self.measurements = [m for m in self.measurements if m["depth"] != depth]
        self.runs = [r for r in self.runs if r["depth"] != depth]
        self.save()


def _other(setting: str) -> str:
    return "off" if setting == "on" else "on"


def _gain(setting: str, measurement: dict[str, Any]) -> float:
    """How much faster `setting` ran than the other in a measurement (0.1: 10 %)."""
    return _total(measurement[_other(setting)]) / _total(measurement[setting]) - 1.0


def _clearly_ahead(setting: str, measured: list[dict[str, Any]]) -> bool:
    """Whether `setting` is ahead by more than NEAR_TIE in the median of at least
    MEASUREMENTS measurements, and in each of the last SHOWN_IN_A_ROW."""
    gains = [_gain(setting, m) for m in measured]
    return (
        len(gains) >= costcache.MEASUREMENTS
        and statistics.median(gains) > NEAR_TIE
        and all(gain > NEAR_TIE for gain in gains[-SHOWN_IN_A_ROW:])
    )


def _total(seconds: dict[str, float]) -> float:
    return sum(seconds.values())


def _call_seconds(measured: list[dict[str, Any]], used: str, size: float) -> float:
    """What the measurements say a call of `size` tokens a slot costs with `used`: their
    median at each size measured, and a straight line between those (for a size within
    them only: a positive time)."""
    sizes = sorted(FLASH_ATTN_BATCHES)
    seconds = [statistics.median(m[used][str(n)] for m in measured) for n in sizes]
    return float(np.interp(size, sizes, seconds))


def _measurement(data: Any) -> dict[str, Any]:
    """A kept measurement, checked: a depth, and for each setting a positive time for
    each size in FLASH_ATTN_BATCHES."""
    sizes = {str(n) for n in FLASH_ATTN_BATCHES}
    by_setting = {used: _seconds_by_size(data[used]) for used in SETTINGS}
    if any(set(seconds) != sizes for seconds in by_setting.values()):
        raise ValueError("measured at other sizes")
    return {"depth": _positive_int(data["depth"]), **by_setting}


def _seconds_by_size(data: Any) -> dict[str, float]:
    return {str(int(n)): _positive(seconds) for n, seconds in data.items()}


def _run(data: Any) -> dict[str, Any]:
    """A kept run, checked."""
    return {
        "depth": _positive_int(data["depth"]),
        "used": _setting(data["used"]),
        "per_call": _positive(data["per_call"]),
        "size": _positive(data["size"]),
    }


def _setting(value: Any) -> str:
    if value not in SETTINGS:
        raise ValueError(f"not a flash attention setting: {value!r}")
    return value


def _positive(value: Any) -> float:
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"not a positive number: {value!r}")
    return number


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"not a positive integer: {value!r}")
    return value
