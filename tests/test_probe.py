"""Never die on a CPU quirk: the repack probe, its cached verdict, and what the engine does.

No machine here needs to advertise AMX: the CPU's flags and the probe's fate are injected.
The probe itself runs for real once: it passes on a CPU without AMX, and on some AMX
CPUs it dies as it is meant to find out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdec_cli.decoding import loading
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.llamacpp import backend, machine, probe
from specdec_cli.llamacpp.probe import Verdict, choose_repack, run_probe
from specdec_cli.models.gguf_meta import read_gguf

AMX_FLAGS = frozenset({"avx512f", "amx_tile", "amx_int8", "amx_bf16"})
DIED = Verdict(False, "died with SIGILL")
SEGV = Verdict(False, "died with SIGSEGV")  # how the same crash ends on other CPUs


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[Verdict]:
    """Make the CPU advertise AMX; each probe run pops its verdict from the list."""
    verdicts: list[Verdict] = []
    monkeypatch.setattr(machine, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(probe, "run_probe", lambda: verdicts.pop(0))
    return verdicts


def test_the_probe_model_is_a_small_q8_0_llama(tmp_path: Path) -> None:
    model = read_gguf(probe.write_probe_model(tmp_path / "probe.gguf"))
    assert model.architecture == "llama" and model.quantization == "Q8_0"
    assert model.n_layers == 1


def test_the_probe_runs_here() -> None:
    """The real child process: it loads the probe model with extra buffer types and
    decodes a batch. Without AMX it survives; with AMX, the crash it guards against is
    the one other outcome: SIGILL on some CPUs, SIGSEGV on others (an Intel Xeon with
    AVX-512 and AMX, 2026-12-05)."""
    verdict = run_probe()
    if machine.advertises_amx(machine.cpu_flags(), backend.system_info()):
        assert verdict in (Verdict(True, "passed"), DIED, SEGV)
    else:
        assert verdict == Verdict(True, "passed")


def test_a_probe_killed_by_a_signal_is_named() -> None:
    if sys.platform == "win32":
        pytest.skip("POSIX signals")
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    assert run_probe([sys.executable, "-c", suicide]) == DIED
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    assert run_probe(failing) == Verdict(False, "exited with code 3")


def test_asked_repack_is_obeyed_without_a_probe(probes: list[Verdict]) -> None:
    assert choose_repack(True) == (True, None)
    assert choose_repack(False) == (False, None)  # probes is empty: a probe would fail


def test_no_amx_no_probe(monkeypatch: pytest.MonkeyPatch, probes: list[Verdict]) -> None:
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(backend, "system_info", lambda: "CPU : AVX2 = 1 |")
    assert choose_repack(None) == (True, None)


def test_amx_that_survives_keeps_repacking(cache: Path, probes: list[Verdict]) -> None:
    probes.append(Verdict(True, "passed"))
    assert choose_repack(None) == (True, None)


def test_amx_that_crashes_turns_repacking_off_and_says_so(
    cache: Path, probes: list[Verdict]
) -> None:
    probes.append(DIED)
    repack, message = choose_repack(None)
    assert repack is False
    assert message is not None and "\n" not in message
    assert "--no-repack" in message and "died with SIGILL" in message
    assert choose_repack(None) == (False, None)  # said once: from the cache, quietly


@pytest.mark.parametrize(("verdict", "flags"), [(DIED, ["--no-repack"]), (Verdict(True, ""), [])])
def test_llama_cpps_tools_get_the_repacking_specdec_chose(
    cache: Path, probes: list[Verdict], verdict: Verdict, flags: list[str]
) -> None:
    """The benchmarks run llama.cpp's own tools beside specdec: where the repacked
    kernels crash, those would die at their first batch without --no-repack."""
    probes.append(verdict)
    assert probe.llama_cpp_flags() == flags


def test_the_verdict_is_cached_per_cpu_and_build(
    cache: Path, probes: list[Verdict], monkeypatch: pytest.MonkeyPatch
) -> None:
    probes.append(DIED)
    assert choose_repack(None)[0] is False
    assert choose_repack(None)[0] is False  # no verdict left: this one came from the cache
    assert len(list(cache.glob("probe/*.json"))) == 1
    monkeypatch.setattr(machine, "cpu_name", lambda: "another CPU")
    probes.append(Verdict(True, "passed"))
    assert choose_repack(None) == (True, None)  # another CPU: probed again


def test_engine_loads_without_repack_where_the_probe_died(
    cache: Path, probes: list[Verdict], target_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded: list[loading.ModelParams] = []

    class RecordingModel(loading.Model):
        def __init__(self, path: Path, params: loading.ModelParams) -> None:
            loaded.append(params)
            super().__init__(path, params)

    monkeypatch.setattr(loading, "Model", RecordingModel)
    probes.append(DIED)
    options = EngineOptions(target_model, n_ctx=64, threads=1, sampling=GREEDY, flash_attn="off")
    with Engine(options) as quirky:
        assert quirky.repack is False
        (said,) = [w for w in quirky.warnings if "--no-repack" in w]
        assert "died with SIGILL" in said
    with Engine(EngineOptions(target_model, n_ctx=64, threads=1, repack=True)) as forced:
        assert forced.warnings == []
    assert [p.use_extra_bufts for p in loaded] == [False, True]
    assert probes == []  # the one probe ran once: the warning's verdict came from the cache
