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
from specdec_cli.decoding.flashattn import FIRST_DEPTH, FlashAttnRecord
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.llamacpp import llama
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
    assert record.depth(10_000) == FIRST_DEPTH  # before any run
    for depth in (900, 1100, 1000):
        record.add_run(depth, "on", 0.1, 2.0)
    assert record.depth(10_000) == 1024  # their median, to a power of two
    assert record.depth(300) == 300  # within the context


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
    for _ in range(2):
        with Engine(options(target_model, n_ctx=2048)) as engine:
            used = engine.flash_attn.used
    assert depths[1:] == [512, 512] and used == "off"


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


def test_auto_measures_for_real_and_uses_its_choice(
    cache: Path, target_model: Path, draft_model: Path, contexts_made: list[ContextParams]
) -> None:
    with Engine(options(target_model, draft_model)) as measured:
        choice = measured.flash_attn
        stats = Stats()
        rng = np.random.default_rng(0)
        pieces = measured.pieces(measured.tokenize("Once"), 4, rng, stats)
        text = "".join(p.text for p in pieces)
    assert choice.asked == "auto" and choice.used in ("on", "off")
    # For each model, two short-lived contexts measured "on" and "off", then its own.
    target, draft = contexts_made[2], contexts_made[5]
    assert [p.flash_attn for p in contexts_made[:2]] == ["on", "off"]
    assert [p.flash_attn for p in contexts_made[3:5]] == ["on", "off"]
    assert target.flash_attn == choice.used and draft.flash_attn in ("on", "off")
    entries = [json.loads(entry.read_text()) for entry in cache.glob("flash_attn/*.json")]
    assert [len(e["measurements"]) for e in entries] == [1, 1]  # the target's and the draft's
    assert text and stats.flash_attn == choice
    assert stats.summary().endswith(f", -fa auto -> {choice.used} (measured)")
    assert stats.to_dict()["flash_attn"] == {"asked": "auto", "used": choice.used}


def test_run_reports_the_choice(target_model: Path) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "Once", "-n", "4", *GREEDY_FLAGS)
    assert result.returncode == 0, result.stderr
    assert "-fa auto -> " in result.stderr and "(measured)" in result.stderr
    record = json.loads(
        specdec(
            "run", "-m", str(target_model), "-p", "Once", "-n", "4", "--json", "-fa", "on"
        ).stdout
    )
    assert record["flash_attn"] == {"asked": "on", "used": "on"}


def test_auto_measures_in_the_servers_slots(
    cache: Path,
    target_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    contexts_made: list[ContextParams],
) -> None:
    """With slots, every token's attention spans every slot's cells (off computes them
    all, masked; on skips other slots'): -fa auto times the engine's slots, each as
    deep as the runs go (at most half its share of the context), every slot's batch in
    one decode call."""
    calls: list[int] = []  # tokens in each decode call while flash attention is timed
    shared_flush = llama._Shared.flush

    def counted(self: llama._Shared, name: str) -> int:
        n = shared_flush(self, name)
        calls.append(n)
        return n

    def timed(self: Engine, model: loading.Model, n_ctx: int, threads: int, depth: int) -> dict:
        with monkeypatch.context() as patch:
            patch.setattr(llama._Shared, "flush", counted)
            return time_flash_attn(self, model, n_ctx, threads, depth)

    time_flash_attn = Engine.time_flash_attn
    monkeypatch.setattr(Engine, "time_flash_attn", timed)
    with Engine(options(target_model, parallel=2)) as engine:
        assert engine.flash_attn.used in ("on", "off")
    on, off = contexts_made[:2]
    assert (on.flash_attn, off.flash_attn) == ("on", "off")
    assert on.n_seq_max == off.n_seq_max == 2
    # 256 cells, two slots: each slot half of its 128 deep (runs are deeper); a batch of
    # 1 and 4 a slot.
    assert sorted(set(calls)) == [2, 8, 64]
    with Engine(options(target_model)):  # one slot: another measurement, cached apart
        pass
    assert sorted(set(calls)) == [1, 2, 4, 8, 64, 128]
