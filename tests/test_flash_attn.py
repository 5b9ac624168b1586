"""-fa auto: the engine measures flash attention on and off where the runs are, more than
once, checks near ties against what the runs spend, and uses the faster."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli_run import GREEDY as GREEDY_FLAGS
from test_cli_run import specdec

from specdec_cli.decoding import loading
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.flashattn import FIRST_DEPTH, FlashAttnRecord, Timings
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.llamacpp.decodecall import SharedCall
from specdec_cli.llamacpp.llama import ContextParams


@pytest.fixture
def contexts_made(monkeypatch: pytest.MonkeyPatch) -> list[ContextParams]:
    """The ContextParams of every context the engine makes, in order."""
    made: list[ContextParams] = []

    class RecordingContext(loading.Context):
        def __init__(self, model: loading.Model, params: ContextParams) -> None:
            made.append(params)
            super().__init__(model, params)

    monkeypatch.setattr(loading, "Context", RecordingContext)
    return made


def timing(on: float, off: float) -> dict[str, dict[int, float]]:
    """A measurement's seconds: a call of 1 token a slot, and of 4, twice as long."""
    return {"on": {1: on / 3, 4: 2 * on / 3}, "off": {1: off / 3, 4: 2 * off / 3}}


def record_of(*measured: tuple[float, float]) -> FlashAttnRecord:
    """A record with these measurements (on, off: seconds of both sizes) at FIRST_DEPTH."""
    record = FlashAttnRecord("test")
    for on, off in measured:
        record.add_measurement(FIRST_DEPTH, timing(on, off))
    return record


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        ([(1.0, 2.0)], "on"),
        ([(2.0, 1.0)], "off"),
        ([(1.0, 1.0)], "on"),  # a tie: llama.cpp's own choice on a CPU
        ([(1.0, 1.2), (1.2, 1.0), (1.0, 1.3)], "on"),  # the median
        ([(1.0, 0.8), (1.0, 1.3), (1.0, 0.9)], "off"),
    ],
)
def test_the_measurements_median_decides(cache: Path, measured, verdict: str) -> None:
    assert record_of(*measured).verdict(FIRST_DEPTH) == verdict


def test_a_choice_changes_only_for_a_clear_gap(cache: Path) -> None:
    """Each change of setting changes a seeded sampled text: a near tie keeps what was
    chosen; measurements that put the other setting clearly ahead change it."""
    record = record_of((1.0, 1.04))  # on, by 4 %
    assert record.verdict(FIRST_DEPTH) == "on"
    record.add_measurement(FIRST_DEPTH, timing(1.0, 0.97))
    record.add_measurement(FIRST_DEPTH, timing(1.0, 0.98))
    assert record.verdict(FIRST_DEPTH) == "on"  # off by 2 % in the median: noise
    record = record_of((1.0, 1.04))
    assert record.verdict(FIRST_DEPTH) == "on"
    record.add_measurement(FIRST_DEPTH, timing(1.0, 0.85))
    record.add_measurement(FIRST_DEPTH, timing(1.0, 0.8))
    assert record.verdict(FIRST_DEPTH) == "off"  # off by 15 % in the median of three
    assert FlashAttnRecord.load("test").chosen == "off"  # kept
    record.add_measurement(512, timing(1.0, 1.03))  # runs went deeper: a near tie there
    assert record.verdict(512) == "off"


def runs_in_a_row(record: FlashAttnRecord, off_over_on: list[float]) -> list[FlashAttnChoice]:
    """What each of as many runs as `off_over_on` has uses, each measuring where it must
    (the next of `off_over_on`: off's time over on's), on a machine so busy that every run
    spends half as much again as measured: after three runs with one setting, the
    measurements look stale and are taken afresh."""
    measures = iter(off_over_on)
    choices = []
    for _ in off_over_on:
        used = record.choose(lambda depth: timing(1.0, next(measures)))
        choices.append(FlashAttnChoice("auto", used, record.switched_from))
        seconds = record.measured_at(record.depth())[-1][used]
        record.add_run(record.depth(), used, 1.5 * (seconds["1"] + seconds["4"]) / 2, 2.5)
    return choices


def test_a_noisy_near_tie_holds_still(cache: Path) -> None:
    """-fa changes the logits' last bits, and with them greedy text: ten runs measuring a
    near tie afresh, with noise past NEAR_TIE now and then (never twice in a row, never in
    the median of three), all use what the first chose."""
    noise = [1.02, 0.93, 1.01, 0.97, 1.06, 0.99, 0.92, 1.03, 0.96, 1.07]
    record = FlashAttnRecord("test")
    assert runs_in_a_row(record, noise) == [FlashAttnChoice("auto", "on")] * 10
    assert record.measurements[-1]["off"]["1"] == pytest.approx(1.07 / 3)  # all measured


def test_a_clear_repeated_gap_switches_and_says_so(cache: Path) -> None:
    """Off clearly ahead, measured again and again: the third measurement makes the median
    of three, the last two each ahead: the run that switches says what it switched from."""
    choices = runs_in_a_row(FlashAttnRecord("test"), [1.02, 0.85, 0.83, 0.86, 0.84])
    assert [str(c) for c in choices] == ["auto -> on (measured)"] * 2 + [
        "auto -> off (measured; switched from on)"
    ] + ["auto -> off (measured)"] * 2
    stats = Stats(flash_attn=choices[2])
    assert stats.summary().endswith(", -fa auto -> off (measured; switched from on)")
    assert stats.to_dict()["flash_attn"] == {
        "asked": "auto",
        "used": "off",
        "switched_from": "on",
    }


def test_runs_that_spend_otherwise_than_measured_are_measured_again(cache: Path) -> None:
    """A call of 2.5 tokens was measured at 0.5 s with on: runs that spent 0.7 s a call
    say the measurements were not taken as the runs are."""
    record = record_of((1.0, 1.5))
    assert record.verdict(FIRST_DEPTH) == "on"
    for per_call in (0.52, 0.48, 0.5):
        record.add_run(FIRST_DEPTH, "on", per_call, 2.5)
    assert not record.runs_disagree(FIRST_DEPTH)
    for per_call in (0.7, 0.72, 0.69):
        record.add_run(FIRST_DEPTH, "on", per_call, 2.5)
    assert record.runs_disagree(FIRST_DEPTH)
    record.measure_again(FIRST_DEPTH)
    assert record.measured_at(FIRST_DEPTH) == [] and not record.runs_disagree(FIRST_DEPTH)
    assert record.chosen == "on"  # until measured anew


def test_the_depth_is_where_the_runs_went(cache: Path) -> None:
    record = record_of()
    assert record.depth() == FIRST_DEPTH  # before any run
    for depth in (900, 1100, 1000):
        record.add_run(depth, "on", 0.1, 2.0)
    assert record.depth() == 1024  # their median, to a power of two
    record.deepest = 300  # half a slot's share of a smaller context
    assert record.depth() == 256  # within it, to a power of two as the runs are


def test_with_a_small_context_runs_are_checked_where_measured(cache: Path) -> None:
    """-c 600: a measurement goes at most 300 deep; runs went deeper. Measurements and
    runs land on one depth, and the runs are checked against the measurements there."""
    record = FlashAttnRecord("test", deepest=300)
    for deepest in (450, 500, 600):
        record.add_run(deepest, "on", 0.5, 2.5)
    depth = record.depth()
    assert depth == 256 and [r["depth"] for r in record.runs] == [depth] * 3
    record.add_measurement(depth, timing(1.0, 1.5))  # a call of 2.5 tokens: 0.5 s with on
    assert record.verdict(depth) == "on"
    assert not record.runs_disagree(depth)
    for deepest in (450, 500, 600):
        record.add_run(deepest, "on", 1.0, 2.5)  # twice what was measured
    assert record.runs_disagree(depth)


def test_runs_are_checked_only_for_call_sizes_measured(cache: Path) -> None:
    """Calls of 1 and 4 tokens are measured; -k 8 and trees verify 9-17 tokens, where a
    line through those two says nothing (a cost curve bends; noise can tilt the line
    down): such runs are not taken for evidence that the measurements are stale."""
    record = record_of((1.0, 1.5))  # on: 1/3 s for 1 token, 2/3 s for 4
    assert record.verdict(FIRST_DEPTH) == "on"
    for per_call in (0.9, 0.92, 0.88):  # 9 tokens a call, under the line's 1.22 s
        record.add_run(FIRST_DEPTH, "on", per_call, 9.0)
    assert not record.runs_disagree(FIRST_DEPTH)
    tilted = FlashAttnRecord("tilted")  # 4 tokens measured cheaper than 1: noise
    tilted.add_measurement(FIRST_DEPTH, {"on": {1: 0.5, 4: 0.2}, "off": {1: 1.0, 4: 1.0}})
    assert tilted.verdict(FIRST_DEPTH) == "on"
    for per_call in (0.3, 0.31, 0.29):  # the line would predict -0.3 s at 9 tokens
        tilted.add_run(FIRST_DEPTH, "on", per_call, 9.0)
    assert not tilted.runs_disagree(FIRST_DEPTH)


DAMAGED = {
    "a measurement without its depth": {"measurements": [{"on": {"1": 1}, "off": {"1": 1}}]},
    "a measurement without a size": {
        "measurements": [{"depth": FIRST_DEPTH, "on": {"1": 1.0}, "off": {"1": 1.0, "4": 2.0}}]
    },
    "a negative time": {
        "measurements": [
            {"depth": FIRST_DEPTH, "on": {"1": -1.0, "4": 2.0}, "off": {"1": 1.0, "4": 2.0}}
        ]
    },
    "a run without its setting": {"runs": [{"depth": FIRST_DEPTH, "per_call": 1, "size": 2}]},
    "a run of no size": {
        "runs": [{"depth": FIRST_DEPTH, "used": "on", "per_call": 1.0, "size": None}]
    },
    "measurements not a list": {"measurements": 7},
    "a setting that is none": {"chosen": "maybe"},
}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_entry_is_measured_again(
    cache: Path, target_model: Path, monkeypatch: pytest.MonkeyPatch, damage: dict
) -> None:
    timed: list[int] = []

    def off_faster(self, model, n_ctx, threads, depth: int) -> Timings:
        timed.append(depth)
        return timing(2.0, 1.0)

    monkeypatch.setattr(Engine, "time_flash_attn", off_faster)
    with Engine(options(target_model)):
        pass
    (path,) = cache.glob("flash_attn/*.json")
    path.write_text(json.dumps({"chosen": "on"} | damage))
    with Engine(options(target_model)) as engine:
        assert engine.flash_attn == FlashAttnChoice("auto", "off")
    assert timed == [FIRST_DEPTH, FIRST_DEPTH]  # forgotten, and measured again
    assert len(json.loads(path.read_text())["measurements"]) == 1


def options(target: Path, draft: Path | None = None, **kwargs: object) -> EngineOptions:
    settings = {"n_ctx": 256, "threads": 1, "sampling": GREEDY} | kwargs
    return EngineOptions(target, draft, **settings)


def test_auto_uses_the_measured_faster_setting_and_caches_it(
    cache: Path,
    target_model: Path,
    draft_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    contexts_made: list[ContextParams],
) -> None:
    timed: list[str] = []

    def off_is_faster_but_for_the_draft(
        self: Engine, model: loading.Model, n_ctx: int, threads: int, depth: int
    ) -> dict[str, float]:
        """Each model has its own choice: a small draft's heads can turn it the other way
        (stories260K's head size 8 is faster off, deep in the cache, where Gemma 3 270M
        with slots is faster on: benchmarks/README.md)."""
        timed.append(model.path.name)
        return timing(1.0, 2.0) if model.path == draft_model else timing(2.0, 1.0)

    monkeypatch.setattr(Engine, "time_flash_attn", off_is_faster_but_for_the_draft)
    with Engine(options(target_model, draft_model)) as first:
        assert first.flash_attn == FlashAttnChoice("auto", "off")
    assert [p.flash_attn for p in contexts_made] == ["off", "on"]  # target and draft
    assert timed == [target_model.name, draft_model.name]  # each model its own
    for _ in range(3):  # one more measurement a run, up to MEASUREMENTS (3)
        with Engine(options(target_model)) as again:
            assert again.flash_attn.used == "off"
    assert timed.count(target_model.name) == 3
    with Engine(options(target_model, n_gpu_layers=0)) as other:
        assert other.flash_attn.used == "off"
    assert len(timed) == 5  # other settings: measured again
    with Engine(options(target_model, flash_attn="on")) as asked:  # given: not measured
        assert asked.flash_attn == FlashAttnChoice("on", "on")
    assert len(timed) == 5 and contexts_made[-1].flash_attn == "on"


def test_auto_measures_where_the_runs_are(
    cache: Path, target_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flash attention on is faster at the depth the runs reach, off deeper in the cache
    (where -fa auto measured before: 512 tokens, and chose off for a target whose short
    runs ran 7 % faster on). Runs record how deep they went; the next measurements are
    taken there."""
    depths: list[int] = []

    def on_faster_when_shallow(self, model, n_ctx, threads, depth: int) -> dict[str, float]:
        depths.append(depth)
        return timing(1.0, 1.2) if depth <= 256 else timing(1.2, 1.0)

    monkeypatch.setattr(Engine, "time_flash_attn", on_faster_when_shallow)
    with Engine(options(target_model, n_ctx=2048)) as engine:
        assert engine.flash_attn.used == "on"
        prompt = engine.tokenize("Once upon a time " * 60)  # a long prompt: runs go deep
        list(engine.pieces(prompt, 200, np.random.default_rng(0), Stats()))
    assert depths == [FIRST_DEPTH]
    used = []
    for _ in range(3):
        with Engine(options(target_model, n_ctx=2048)) as engine:
            used.append(engine.flash_attn)
    assert depths[1:] == [512, 512, 512]
    # what was chosen holds until three measurements there put off ahead, the last two each
    assert used == [FlashAttnChoice("auto", "on")] * 2 + [FlashAttnChoice("auto", "off", "on")]


def test_a_run_records_what_it_spent(cache: Path, target_model: Path) -> None:
    """At its end, a run keeps its verification-sized calls' seconds a call and its depth,
    beside the measurement, for the next runs' choice."""
    with Engine(options(target_model, flash_attn="auto")) as engine:
        used = engine.flash_attn.used
        prompt = engine.tokenize("Once upon a time")
        list(engine.pieces(prompt, 60, np.random.default_rng(0), Stats()))
    (entry,) = [json.loads(path.read_text()) for path in cache.glob("flash_attn/*.json")]
    (measurement,) = entry["measurements"]
    assert measurement["depth"] == FIRST_DEPTH
    assert all(measurement[used][size] > 0 for used in ("on", "off") for size in ("1", "4"))
    (run,) = entry["runs"]
    assert run["used"] == used and run["per_call"] > 0
    assert 1.0 <= run["size"] <= 5.0  # its verifications: a draft and the token before
    assert run["depth"] == 64  # its 65 tokens, to the nearest power of two


def faster_in(measured: Timings) -> str:
    """The setting a first measurement puts ahead (a tie: on)."""
    return "on" if sum(measured["off"].values()) >= sum(measured["on"].values()) else "off"


@pytest.fixture
def measured_for_real(monkeypatch: pytest.MonkeyPatch) -> dict[str, Timings]:
    """Each model's real measurement (by file name), as -fa auto takes it."""
    measured: dict[str, Timings] = {}
    time_flash_attn = Engine.time_flash_attn

    def kept(self: Engine, model: loading.Model, *args: int) -> Timings:
        measured[model.path.name] = time_flash_attn(self, model, *args)
        return measured[model.path.name]

    monkeypatch.setattr(Engine, "time_flash_attn", kept)
    return measured


def test_auto_measures_for_real_and_uses_its_choice(
    cache: Path,
    target_model: Path,
    draft_model: Path,
    contexts_made: list[ContextParams],
    measured_for_real: dict[str, Timings],
) -> None:
    with Engine(options(target_model, draft_model)) as measured:
        choice = measured.flash_attn
        stats = Stats()
        rng = np.random.default_rng(0)
        pieces = measured.pieces(measured.tokenize("Once"), 4, rng, stats)
        text = "".join(p.text for p in pieces)
    assert choice == FlashAttnChoice("auto", faster_in(measured_for_real[target_model.name]))
    # For each model, two short-lived contexts measured "on" and "off", then its own.
    target, draft = contexts_made[2], contexts_made[5]
    assert [p.flash_attn for p in contexts_made[:2]] == ["on", "off"]
    assert [p.flash_attn for p in contexts_made[3:5]] == ["on", "off"]
    assert target.flash_attn == choice.used
    assert draft.flash_attn == faster_in(measured_for_real[draft_model.name])
    entries = [json.loads(entry.read_text()) for entry in cache.glob("flash_attn/*.json")]
    assert [len(e["measurements"]) for e in entries] == [1, 1]  # the target's and the draft's
    assert text and stats.flash_attn == choice
    assert stats.summary().endswith(f", -fa auto -> {choice.used} (measured)")
    assert stats.to_dict()["flash_attn"] == {
        "asked": "auto",
        "used": choice.used,
        "switched_from": None,
    }


def test_run_reports_the_choice(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "Once", "-n", "4", *GREEDY_FLAGS)
    assert result.returncode == 0, result.stderr
    assert "-fa auto -> " in result.stderr and "(measured)" in result.stderr
    record = json.loads(
        specdec(
            "run", "-m", str(target_model), "-p", "Once", "-n", "4", "--json", "-fa", "on"
        ).stdout
    )
    assert record["flash_attn"] == {"asked": "on", "used": "on", "switched_from": None}


def test_auto_measures_in_the_servers_slots(
    cache: Path,
    target_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    contexts_made: list[ContextParams],
    measured_for_real: dict[str, Timings],
) -> None:
    """With slots, every token's attention spans every slot's cells (off computes them
    all, masked; on skips other slots'): -fa auto times the engine's slots, each as
    deep as the runs go (at most half its share of the context), every slot's batch in
    one decode call."""
    calls: list[int] = []  # tokens in each decode call while flash attention is timed
    shared_flush = SharedCall.flush

    def counted(self: SharedCall, name: str) -> int:
        n = shared_flush(self, name)
        calls.append(n)
        return n

    def timed(self: Engine, model: loading.Model, n_ctx: int, threads: int, depth: int) -> dict:
        with monkeypatch.context() as patch:
            patch.setattr(SharedCall, "flush", counted)
            return time_flash_attn(self, model, n_ctx, threads, depth)

    time_flash_attn = Engine.time_flash_attn
    monkeypatch.setattr(Engine, "time_flash_attn", timed)
    with Engine(options(target_model, parallel=2)) as engine:
        assert engine.flash_attn.used == faster_in(measured_for_real[target_model.name])
    on, off = contexts_made[:2]
    assert (on.flash_attn, off.flash_attn) == ("on", "off")
    assert on.n_seq_max == off.n_seq_max == 2
    # 256 cells, two slots: each slot half of its 128 deep (runs are deeper); a batch of
    # 1 and 4 a slot.
    assert sorted(set(calls)) == [2, 8, 64]
    with Engine(options(target_model)):  # one slot: another measurement, cached apart
        pass
    assert sorted(set(calls)) == [1, 2, 4, 8, 64, 128]
