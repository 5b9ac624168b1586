"""Measured costs kept on disk, so that -k auto measures a few times per models and
settings, and never again.

Measuring the target's cost per batch size takes a few hundred target token-times
(about 340 for the benchmark pair: 1.5 s; at 150 ms a token, close to a minute). The
costs depend on the model files, the hardware and the settings that change how
llama.cpp runs them, so that is the key; anything else (another prompt, another -n)
reuses the measurements. One measurement can be off, and priced with alone it would
steer -k auto for good (benchmarks/README.md, 2026-11-28: a cost curve measured once):
so the first MEASUREMENTS runs each add one, and -k auto prices with their median. A
rejection-sampled generation prices with the first alone: its draft lengths decide which
random numbers its tokens use, so its seed reproduces its text only while its costs stay
the same (see AutoLength). The llama.cpp build is part of the key too: costs measured
on a CPU build never serve a CUDA rebuild. A cache that cannot be read or written is no
error: the costs are measured again.

Other one-time findings live beside the costs, under the same kind of key: the
flash attention setting measured faster, and whether this CPU survives llama.cpp's
repacked (AMX) kernels.

The entries are plain JSON, each kind read and written by its user: the costs by
decoding/costmodel.py (load_costs, save_costs), the flash attention setting by
decoding/flashattn.py, the repack verdict by probe.py.

Where: $SPECDEC_CACHE_DIR, else the OS's per-user cache directory (machine.user_dir).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llama_cpp import __version__ as LLAMA_CPP_PYTHON

from specdec_cli.llamacpp import backend, machine

FORMAT = 4  # bump when the meaning of a measurement changes (4: one-token passes timed steady)
# Measurements kept per key, each taken by another run (another process, another moment
# of the machine): their median outvotes one that is off.
MEASUREMENTS = 3


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
