"""Measured costs kept on disk, so that -k auto measures once per models and settings.

Measuring the target's cost per batch size takes a few hundred target token-times
(about 340 for the benchmark pair: 1.5 s; at 150 ms a token, close to a minute). The
costs depend on the model files, the hardware and the settings that change how
llama.cpp runs them, so that is the key; anything else (another prompt, another -n)
reuses the measurement. A cache that cannot be read or written is no error: the
costs are measured again.

Where: $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from llama_cpp import __version__ as LLAMA_CPP_PYTHON

from specdec_cli.costmodel import Costs

FORMAT = 1  # bump when the meaning of a measurement changes


def cache_dir() -> Path:
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdec"


def _file_identity(path: Path) -> list[object]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def cache_key(models: Iterable[Path], settings: dict[str, object]) -> str:
    """A name for the costs of these model files under these settings."""
    identity = {
        "format": FORMAT,
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "models": [_file_identity(p) for p in models],
        "settings": settings,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_dir() / "costs" / f"{key}.json"


def load(key: str) -> Costs | None:
    try:
        data = json.loads(_path(key).read_text())
        verify = {int(n): float(v) for n, v in data.pop("verify").items()}
        return Costs(**{name: float(v) for name, v in data.items()}, verify=verify)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(key: str, costs: Costs) -> None:
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(dataclasses.asdict(costs), indent=1))
        temporary.replace(path)  # atomic: a concurrent reader sees all or nothing
    except OSError:
        pass
