"""Facts about the machine at hand that do not need llama.cpp: its CPU, and where the
operating system wants per-user files kept.

psutil and platformdirs know each OS's answers (Linux, macOS, Windows; x86 and ARM),
so nothing here reads /proc by hand except the CPU's feature flags, which only Linux
publishes and only matter where Linux runs on an AMX CPU.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Literal

import platformdirs
import psutil

from specdec_cli.errors import UserError

APP_NAME = "specdec"
GGML_MAX_N_THREADS = 512  # ggml.h: a compute graph's most threads


def physical_cores() -> int:
    """Physical cores this process may run on: llama.cpp's raw default (4 threads)
    oversubscribes small machines, and hyper-threads slow matrix work down, not up.

    An affinity mask counts logical CPUs; it is scaled to cores by the machine's
    hyper-threads per core (macOS has no affinity mask: all CPUs count)."""
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    return max(1, min(physical, usable_cpus() * physical // logical))


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask, else all of them."""
    try:
        return len(psutil.Process().cpu_affinity())
    except (AttributeError, psutil.Error, OSError):
        return psutil.cpu_count(logical=True) or 1


def check_threads(threads: int | None, flag: str) -> int | None:
    """A thread count as given (None or 0: the default), refused past the CPUs this
    process may run on: threads beyond them only wait for one another, and ggml aborts
    past GGML_MAX_N_THREADS."""
    most = min(usable_cpus(), GGML_MAX_N_THREADS)
    if threads is not None and threads > most:
        raise UserError(
            f"{flag} {threads}: this process may run on {most} CPUs, and threads beyond "
            f"them only wait for one another; use {flag} {most} or fewer"
        )
    return threads


def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ("" where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (x86 "flags", ARM "Features")."""
    return frozenset((_cpuinfo_field("flags") or _cpuinfo_field("Features")).split())


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def advertises_amx(flags: frozenset[str], system_info: str) -> bool:
    """Whether the CPU claims Intel AMX: by Linux's flags (amx_tile, amx_int8, ...) or,
    on other systems, by llama.cpp's build features (a native build has what the CPU
    advertises)."""
    return any(flag.startswith("amx") for flag in flags) or "AMX" in system_info


def user_dir(kind: Literal["cache", "config"]) -> Path:
    """specdec's per-user directory of this kind, where the OS expects it: on Linux
    $XDG_CACHE_HOME/specdec or ~/.cache/specdec ($XDG_CONFIG_HOME, ~/.config for the
    config), on macOS ~/Library/Caches/specdec and ~/Library/Application Support/specdec,
    on Windows %LOCALAPPDATA%\\specdec\\Cache and %LOCALAPPDATA%\\specdec."""
    if kind == "cache":
        return platformdirs.user_cache_path(APP_NAME, appauthor=False)
    return platformdirs.user_config_path(APP_NAME, appauthor=False)
