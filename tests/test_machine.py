"""Facts about the machine: physical cores on any OS, AMX, and where per-user files live."""

from __future__ import annotations

from pathlib import Path

import platformdirs
import psutil
import pytest
from platformdirs.macos import MacOS

from specdec_cli.llamacpp import costcache, machine
from specdec_cli.models.config import default_config_path


class FakeProcess:
    def __init__(self, allowed: list[int] | None) -> None:
        self.allowed = allowed

    def cpu_affinity(self) -> list[int]:
        if self.allowed is None:  # macOS: psutil has no affinity there
            raise AttributeError("cpu_affinity")
        return self.allowed


def fake_cpus(
    monkeypatch: pytest.MonkeyPatch, logical: int, physical: int | None, allowed: int | None
) -> None:
    counts = {True: logical, False: physical}
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: counts[logical])
    affinity = None if allowed is None else list(range(allowed))
    monkeypatch.setattr(psutil, "Process", lambda: FakeProcess(affinity))


@pytest.mark.parametrize(
    ("logical", "physical", "allowed", "cores"),
    [
        (16, 8, 16, 8),  # hyper-threads do not count
        (16, 8, 4, 2),  # an affinity mask of 4 logical CPUs: 2 cores' worth
        (16, 8, 1, 1),  # never 0
        (8, 8, None, 8),  # macOS: no affinity mask, all cores
        (4, None, 4, 4),  # psutil cannot tell physical cores: logical ones
    ],
)
def test_physical_cores(
    monkeypatch: pytest.MonkeyPatch,
    logical: int,
    physical: int | None,
    allowed: int | None,
    cores: int,
) -> None:
    fake_cpus(monkeypatch, logical, physical, allowed)
    assert machine.physical_cores() == cores


def test_physical_cores_on_this_machine() -> None:
    assert 1 <= machine.physical_cores() <= (psutil.cpu_count(logical=True) or 1)


@pytest.mark.parametrize(
    ("flags", "system_info", "amx"),
    [
        ({"avx2", "amx_tile", "amx_int8"}, "CPU : AVX2 = 1 |", True),  # Linux's flags
        ({"avx2"}, "CPU : AVX2 = 1 | AMX_INT8 = 1 |", True),  # a native build's features
        (set(), "CPU : AVX512 = 1 | AVX512_VNNI = 1 |", False),
    ],
)
def test_advertises_amx(flags: set[str], system_info: str, amx: bool) -> None:
    assert machine.advertises_amx(frozenset(flags), system_info) is amx


def test_cache_and_config_follow_xdg_on_linux(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if not isinstance(platformdirs.PlatformDirs(), platformdirs.unix.Unix):
        pytest.skip("XDG directories are a Unix convention")
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert costcache.cache_dir() == tmp_path / "cache" / "specdec"
    assert default_config_path() == tmp_path / "config" / "specdec" / "models.toml"


def test_cache_and_config_chosen_alike_on_macos(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both where macOS wants them (platformdirs' answer), not ~/.cache and typer's dir."""
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(platformdirs, "PlatformDirs", MacOS)
    library = tmp_path / "Library"
    assert costcache.cache_dir() == library / "Caches" / "specdec"
    assert default_config_path() == library / "Application Support" / "specdec" / "models.toml"


def test_cache_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "mine"))
    assert costcache.cache_dir() == tmp_path / "mine"
