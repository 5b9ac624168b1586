"""-fa auto: the engine measures flash attention on and off once, keeps the faster, uses it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli_run import GREEDY as GREEDY_FLAGS
from test_cli_run import specdec

from specdec_cli.decoding import loading
from specdec_cli.decoding.costmodel import faster_flash_attn
from specdec_cli.decoding.engine import Engine
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


@pytest.mark.parametrize(
    ("on", "off", "faster"), [(1.0, 2.0, "on"), (2.0, 1.0, "off"), (1.0, 1.0, "on")]
)
def test_faster_flash_attn(on: float, off: float, faster: str) -> None:
    assert faster_flash_attn({"on": on, "off": off}) == faster


def options(target: Path, draft: Path | None = None, **kwargs: object) -> EngineOptions:
    return EngineOptions(target, draft, n_ctx=256, threads=1, sampling=GREEDY, **kwargs)


def test_auto_uses_the_measured_faster_setting_and_caches_it(
    cache: Path,
    target_model: Path,
    draft_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    contexts_made: list[ContextParams],
) -> None:
    timed: list[str] = []

    def off_is_faster_but_for_the_draft(
        self: Engine, model: loading.Model, n_ctx: int, threads: int
    ) -> dict[str, float]:
        """Each model has its own choice: a small draft's heads can turn it the other way
        (stories260K's head size 8 is faster off, deep in the cache, where Gemma 3 270M
        with slots is faster on: benchmarks/README.md)."""
        timed.append(model.path.name)
        return {"on": 1.0, "off": 2.0} if model.path == draft_model else {"on": 2.0, "off": 1.0}

    monkeypatch.setattr(Engine, "time_flash_attn", off_is_faster_but_for_the_draft)
    with Engine(options(target_model, draft_model)) as first:
        assert first.flash_attn == FlashAttnChoice("auto", "off")
    assert [p.flash_attn for p in contexts_made] == ["off", "on"]  # target and draft
    with Engine(options(target_model)) as again:  # cached: not measured again
        assert again.flash_attn.used == "off"
    assert timed == [target_model.name, draft_model.name]  # each model its own
    with Engine(options(target_model, n_gpu_layers=0)) as other:
        assert other.flash_attn.used == "off"
    assert len(timed) == 3  # other settings: measured again
    with Engine(options(target_model, flash_attn="on")) as asked:  # given: not measured
        assert asked.flash_attn == FlashAttnChoice("on", "on")
    assert len(timed) == 3 and contexts_made[-1].flash_attn == "on"


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
    assert sorted(e["used"] for e in entries) == sorted([choice.used, draft.flash_attn])
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
    deep as its share of FLASH_ATTN_CELLS, every slot's batch in one decode call."""
    calls: list[int] = []  # tokens in each decode call while flash attention is timed
    shared_flush = llama._Shared.flush

    def counted(self: llama._Shared, name: str) -> int:
        n = shared_flush(self, name)
        calls.append(n)
        return n

    def timed(self: Engine, model: loading.Model, n_ctx: int, threads: int) -> dict:
        with monkeypatch.context() as patch:
            patch.setattr(llama._Shared, "flush", counted)
            return time_flash_attn(self, model, n_ctx, threads)

    time_flash_attn = Engine.time_flash_attn
    monkeypatch.setattr(Engine, "time_flash_attn", timed)
    with Engine(options(target_model, parallel=2)) as engine:
        assert engine.flash_attn.used in ("on", "off")
    on, off = contexts_made[:2]
    assert (on.flash_attn, off.flash_attn) == ("on", "off")
    assert on.n_seq_max == off.n_seq_max == 2
    # 256 cells, two slots: each slot half of its 128 deep; a batch of 1 and 4 a slot.
    assert sorted(set(calls)) == [2, 8, 64]
    with Engine(options(target_model)):  # one slot: another measurement, cached apart
        pass
    assert sorted(set(calls)) == [1, 2, 4, 8, 64, 128]
