"""Measured costs kept on disk: a few measurements per models and settings, one a run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from specdec_cli.decoding.costmodel import Costs, load_costs, median_costs, save_costs
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.loading import cost_sizes
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import FlashAttnChoice, Stats
from specdec_cli.llamacpp import backend, costcache
from specdec_cli.llamacpp.model import Model

COSTS = Costs(0.004, 0.04, {1: 1.0, 2: 0.8, 3: 1.05}, 0.1)


def test_saved_costs_load_unchanged(cache: Path) -> None:
    assert load_costs("abc") == []
    save_costs("abc", [COSTS])
    assert load_costs("abc") == [COSTS]
    assert len(list(cache.rglob("*.json"))) == 1


def test_the_last_few_measurements_are_kept(cache: Path) -> None:
    measured = [Costs(0.001 * i, 0.04, {1: 1.0, 2: 0.8}, 0.1) for i in range(5)]
    save_costs("abc", measured)
    assert load_costs("abc") == measured[-costcache.MEASUREMENTS :]


def test_a_damaged_entry_is_measured_again(cache: Path) -> None:
    save_costs("abc", [COSTS])
    (entry,) = cache.rglob("*.json")
    entry.write_text('{"measurements": [{"target_seconds": "fast"}]}')
    assert load_costs("abc") == []
    entry.write_text('{"target_seconds": 0.004')
    assert load_costs("abc") == []


def test_an_unwritable_cache_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker / "cache"))  # under a file
    save_costs("abc", [COSTS])
    assert load_costs("abc") == []


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert costcache.cache_dir() == tmp_path / "specdec"


def test_key_names_files_and_settings(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    key = costcache.cache_key([model], {"threads": 2})
    assert key == costcache.cache_key([model], {"threads": 2})
    assert key != costcache.cache_key([model], {"threads": 4})
    os.utime(model, ns=(0, 10**9))  # the file changed: its mtime says so
    assert key != costcache.cache_key([model], {"threads": 2})


def test_key_names_the_llama_cpp_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Costs measured on a CPU build never serve a CUDA rebuild of llama.cpp."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cpu_key = costcache.cache_key([model], {"threads": 2})
    assert backend.build_identity()["backends"] == list(backend.backend_names())
    cuda = {"backends": ["CUDA", "CPU"], "system_info": "CUDA : ARCHS = 890 | CPU : AVX2 = 1"}
    monkeypatch.setattr(backend, "build_identity", lambda: cuda)
    assert costcache.cache_key([model], {"threads": 2}) != cpu_key


def test_other_entries_live_beside_the_costs(cache: Path) -> None:
    save_costs("abc", [COSTS])
    costcache.save_entry("flash_attn", "abc", {"used": "off"})
    assert costcache.load_entry("flash_attn", "abc") == {"used": "off"}
    assert load_costs("abc") == [COSTS]  # same key, another kind: no clash
    assert costcache.load_entry("probe", "abc") is None


def auto_engine(target: Path, draft: Path, threads: int) -> Engine:
    """-k auto, flash attention fixed: -fa auto's first runs may each choose otherwise
    (see flashattn.py), and costs are kept per setting."""
    return Engine(
        EngineOptions(
            target=target,
            draft=draft,
            n_ctx=256,
            threads=threads,
            flash_attn="off",
            sampling=GREEDY,
            drafting=DraftOptions(k="auto", draft_max=4, tree="off"),  # batches up to 5
        )
    )


def test_engines_measure_a_few_times_per_settings(
    cache: Path, target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first runs measure once each; later ones price with the median, measuring
    nothing."""
    for _ in range(costcache.MEASUREMENTS):
        with auto_engine(target_model, draft_model, threads=1) as engine:
            assert sorted(engine.costs().verify) == [1, 2, 3, 4, 5]

    def must_not_measure(*args: object, **kwargs: object) -> Costs:
        raise AssertionError("measured again")

    with monkeypatch.context() as patch:
        patch.setattr(Engine, "measure_costs", must_not_measure)
        with auto_engine(target_model, draft_model, threads=1) as again:
            kept = load_costs(next(cache.glob("costs/*.json")).stem)
            assert len(kept) == costcache.MEASUREMENTS
            assert again.costs() == median_costs(kept)
    with auto_engine(target_model, draft_model, threads=2) as other:  # other settings
        assert other.costs() != again.costs()
    assert len(list(cache.glob("costs/*.json"))) == 2


def test_a_measurement_that_is_off_is_outvoted(
    cache: Path, target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run's measurement prices 4 tokens far above the others': -k auto prices
    with the median, from the third run on."""
    right = Costs(0.004, 0.04, {1: 1.0, 2: 0.8, 3: 1.05, 4: 1.1, 5: 1.4}, 0.1)
    off = Costs(0.004, 0.04, {1: 1.0, 2: 0.8, 3: 1.05, 4: 1.4, 5: 1.4}, 0.1)
    takes = iter([off, right, right])
    monkeypatch.setattr(Engine, "measure_costs", lambda self, *args, **kwargs: next(takes))
    priced = []
    for _ in range(costcache.MEASUREMENTS + 1):
        with auto_engine(target_model, draft_model, threads=1) as engine:
            priced.append(engine.costs().verify[4])
    assert priced[0] == 1.4  # alone, it is what -k auto prices with
    assert priced[2:] == [1.1, 1.1]  # outvoted, and nothing measured any more


def test_a_seeded_sampled_text_stays_while_the_first_runs_measure(
    cache: Path, target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first runs' measurements move the median that greedy rounds price with. A
    rejection-sampled generation's draft lengths decide which random numbers its tokens
    use, so it prices with the first measurement in every run: its seed gives one text,
    drafted the same way, in all of them."""
    steep = Costs(0.004, 0.04, {1: 1.0, 2: 1.9, 3: 2.9, 4: 3.9, 5: 4.9}, 0.1)
    flat = Costs(0.004, 0.04, {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 0.1)
    takes = iter([steep, flat, flat])
    monkeypatch.setattr(Engine, "measure_costs", lambda self, *args, **kwargs: next(takes))
    runs, medians = [], []
    for _ in range(costcache.MEASUREMENTS):
        with auto_engine(target_model, draft_model, threads=1) as engine:
            stats = Stats()
            prompt = engine.tokenize("Once upon a time")
            rng = np.random.default_rng(5)
            pieces = engine.pieces(prompt, 24, rng, stats, sampling=SamplingParams(temp=1.0))
            runs.append(([piece.token for piece in pieces], stats.draft_lengths))
            medians.append(engine.costs().verify[5])
    assert medians == [4.9, 2.95, 1.0]  # greedy rounds would price each run otherwise
    assert runs[1:] == runs[:1] * 2


def test_the_drafts_flash_attention_keys_the_costs(
    cache: Path, target_model: Path, draft_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's flash attention is a choice of its own (see test_flash_attn), and the
    draft's decodes cost what it makes them cost: costs measured with the other setting
    are not its costs."""
    draft_uses = ["on"]

    def choose(self: Engine, model: Model, *args: object) -> FlashAttnChoice:
        return FlashAttnChoice("auto", "off" if model.path == target_model else draft_uses[0])

    monkeypatch.setattr(Engine, "_choose_flash_attn", choose)
    with auto_engine(target_model, draft_model, threads=1) as first:
        first.costs()
    draft_uses[0] = "off"
    with auto_engine(target_model, draft_model, threads=1) as second:
        second.costs()
    assert len(list(cache.glob("costs/*.json"))) == 2


def test_costs_are_measured_at_doubling_sizes_and_the_widest_round() -> None:
    """Every size up to 5, then sizes that double, and the widest round; a doubling size
    just below the widest is left out: it costs nearly the same, and the largest batches
    are most of the measurement's time."""
    assert cost_sizes(17) == {1, 2, 3, 4, 5, 9, 17}  # one slot's chain, up to 16 drafted
    assert cost_sizes(132) == {1, 2, 3, 4, 5, 9, 17, 33, 65, 132}  # four slots' trees of 32
    assert cost_sizes(3) == {1, 2, 3}
