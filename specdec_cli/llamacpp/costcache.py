"""Measured costs kept on disk, so that -k auto measures once per models and settings.

Measuring the target's cost per batch size takes a few hundred target token-times
(about 340 for the benchmark pair: 1.5 s; at 150 ms a token, close to a minute). The
costs depend on the model files, the hardware and the settings that change how
llama.cpp runs them, so that is the key; anything else (another prompt, another -n)
reuses the measurement. The llama.cpp build is part of the key too: costs measured
on a CPU build never serve a CUDA rebuild. A cache that cannot be read or written is
no error: the costs are measured again.

Other one-time findings live beside the costs, under the same kind of key: the
flash attention setting measured faster, and whether this CPU survives llama.cpp's
repacked (AMX) kernels.

Where: $SPECDEC_CACHE_DIR, else the OS's per-user cache directory (machine.user_dir).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llama_cpp import __version__ as LLAMA_CPP_PYTHON

from specdec_cli.decoding.costmodel import Costs
from specdec_cli.llamacpp import backend, machine

FORMAT = 2  # bump when the meaning of a measurement changes


def cache_dir() -> Path:
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"])
    return machine.user_dir("cache")


def _file_identity(path: Path) -> list[object]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def cache_key(models: Iterable[Path], settings: dict[str, object]) -> str:
    """A name for the costs of these model files under these settings."""
    identity = {
        "format": FORMAT,
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "llama_cpp_build": backend.build_identity(),
        "models": [_file_identity(p) for p in models],
        "settings": settings,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.json"


def load_entry(kind: str, key: str) -> dict[str, Any] | None:
    """A JSON object saved under `kind` ("costs", "flash_attn", ...), or None."""
    try:
        data = json.loads(_path(kind, key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_entry(kind: str, key: str, data: dict[str, Any]) -> None:
    path = _path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(path)  # atomic: a concurrent reader sees all or nothing
    except OSError:
        pass


def load(key: str) -> Costs | None:
    data = load_entry("costs", key)
    if data is None:
        return None
    try:
        verify = {int(n): float(v) for n, v in data.pop("verify").items()}
        return Costs(**{name: float(v) for name, v in data.items()}, verify=verify)
    except (ValueError, KeyError, TypeError, AttributeError):  # an entry of an old format
        return None


def save(key: str, costs: Costs) -> None:
    save_entry("costs", key, dataclasses.asdict(costs))
