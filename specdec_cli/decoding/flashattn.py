"""-fa auto: whether flash attention runs a model faster on this machine, and the
evidence behind that choice, kept in the cache per model and settings.

The choice is only as good as the timing behind it, and one timing was not enough: taken
once, 512 tokens deep, it kept flash attention off for a target whose runs (under 200
tokens) ran 7 % faster with it on. So, as the cost curve is:

- it is measured where the runs are: as deep as the runs on this model went (the median
  of the last RUNS_KEPT, to the nearest power of two; FIRST_DEPTH before any ran);
- more than once: each run adds a measurement at that depth until there are
  costcache.MEASUREMENTS, and their median decides;
- and checked against what the runs then spend: every run keeps what its small decode
  calls (a verification's, not a prompt's) cost a call, and how many tokens they held.
  Where the runs of the setting in use spent more or less than its measurements say a
  call of that size costs, by more than STALE, the measurements were not taken as the
  runs are (another depth, a busy machine): they are taken again.

A choice, once made, changes only where new evidence (at whatever depth the runs have
moved to) puts the other setting ahead by more than NEAR_TIE: each change changes the
logits' last bits, and with them a seeded sampled text, so a noisy near tie must not flip
it from run to run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from specdec_cli.llamacpp import costcache

FIRST_DEPTH = 128  # where runs are before any ran: a prompt and a reply
DEPTHS = (32, 8192)  # the shallowest and deepest measurement
RUNS_KEPT = 16
# Measured gaps smaller than this are noise (a measurement of the same setting twice
# differs by a few percent on these machines): they do not change a choice.
NEAR_TIE = 0.05
# Runs that spend this much more or less a call than measured: measure again.
STALE = 0.25
RUNS_TO_CHECK = 3
MIN_CALLS = 8  # a run with fewer small decode calls says too little to keep


def depth_bucket(depth: float) -> int:
    """A depth to measure at: the nearest power of two, within DEPTHS."""
    low, high = DEPTHS
    return int(min(high, max(low, 2 ** round(math.log2(max(depth, 1))))))


@dataclass
class FlashAttnRecord:
    """What was measured of flash attention for one model and settings, what was chosen,
    and what the runs spent (see the module's docstring)."""

    key: str
    # depth, and for "on" and "off" the seconds of a call by tokens a slot ("1", "4")
    measurements: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # depth, used, per_call, size
    chosen: str | None = None

    @classmethod
    def load(cls, key: str) -> FlashAttnRecord:
        entry = costcache.load_entry("flash_attn", key) or {}
        try:
            return cls(
                key,
                [dict(m) for m in entry.get("measurements", [])],
                [dict(r) for r in entry.get("runs", [])],
                entry["chosen"] if entry.get("chosen") in ("on", "off") else None,
            )
        except (TypeError, ValueError):  # another format: measured again
            return cls(key)

    def save(self) -> None:
        data = {
            "measurements": self.measurements,
            "runs": self.runs[-RUNS_KEPT:],
            "chosen": self.chosen,
        }
        costcache.save_entry("flash_attn", self.key, data)

    def depth(self, deepest: int) -> int:
        """The depth to measure and decide at: where the runs went, at most `deepest`."""
        depths = [r["depth"] for r in self.runs[-RUNS_KEPT:]]
        typical = statistics.median(depths) if depths else FIRST_DEPTH
        return min(depth_bucket(typical), max(1, deepest))

    def measured_at(self, depth: int) -> list[dict[str, Any]]:
        return [m for m in self.measurements if m["depth"] == depth]

    def add_measurement(self, depth: int, seconds: dict[str, dict[int, float]]) -> None:
        by_size = {used: {str(n): s for n, s in seconds[used].items()} for used in ("on", "off")}
        self.measurements.append({"depth": depth, **by_size})
        self.save()

    def add_run(self, depth: int, used: str, per_call: float, size: float) -> None:
        """A run's small decode calls: `per_call` seconds and `size` tokens a slot each."""
        run = {"depth": depth_bucket(depth), "used": used, "per_call": per_call, "size": size}
        self.runs.append(run)
        self.save()

    def verdict(self, depth: int) -> str:
        """Flash attention on or off: the median of the measurements at this depth, where
        it puts one setting ahead by more than NEAR_TIE of what was chosen before (a tie,
        with nothing chosen, goes to on: llama.cpp's own choice on a CPU)."""
        measured = self.measured_at(depth)
        ratio = statistics.median(_total(m["off"]) / _total(m["on"]) for m in measured)
        faster = "on" if ratio >= 1.0 else "off"
        if self.chosen is None or (faster != self.chosen and abs(ratio - 1.0) > NEAR_TIE):
            self.chosen = faster
            self.save()
        return self.chosen

    def runs_disagree(self, depth: int) -> bool:
        """Whether the last RUNS_TO_CHECK runs at this depth, with the setting chosen
        there, spent a call more or less than its measurements say by more than STALE."""
        used, measured = self.chosen, self.measured_at(depth)
        runs = [r for r in self.runs if r["depth"] == depth and r["used"] == used]
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


def _total(seconds: dict[str, float]) -> float:
    return sum(seconds.values())


def _call_seconds(measured: list[dict[str, Any]], used: str, size: float) -> float:
    """What the measurements say a call of `size` tokens a slot costs with `used`: their
    median, between the sizes measured (a straight line through them)."""
    sizes = sorted(int(n) for n in measured[0][used])
    seconds = [statistics.median(m[used][str(n)] for m in measured) for n in sizes]
    low, high = sizes[0], sizes[-1]
    slope = (seconds[-1] - seconds[0]) / (high - low) if high > low else 0.0
    return seconds[0] + slope * (size - low)
