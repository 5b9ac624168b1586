"""The named-models config file: short names for models and target/draft pairs.

See models.example.toml at the repository root for every key, with comments.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.machine import user_dir
from specdec_cli.models.hub import is_hub_ref

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ENV_VAR = "SPECDEC_CONFIG"

# Allowed keys and their types. A float key also accepts a TOML integer (`temp = 0`).
_MODEL_KEYS: dict[str, type] = {"path": str, "n_gpu_layers": int, "n_ctx": int, "threads": int}
_PAIR_KEYS: dict[str, type] = {
    "target": str,
    "draft": str,
    "k": int | str,
    "tree": int | str,
    "about": str,
}
_SAMPLING_KEYS: dict[str, type] = {
    "temp": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "seed": int,
    "n_predict": int,
}


@dataclass(frozen=True)
class ModelSpec:
    """One model: where it is, plus the loading options the config set (None = CLI default)."""

    path: str  # a local path (absolute once it came from a config file) or a Hub reference
    name: str | None = None  # the [models] name it came from, if any
    n_gpu_layers: int | None = None
    n_ctx: int | None = None
    threads: int | None = None


@dataclass(frozen=True)
class PairSpec:
    """A target/draft pair with its draft length and sampling defaults."""

    name: str
    target: ModelSpec
    draft: ModelSpec
    k: str | None = None  # a number of tokens, or "auto", as -k takes it
    tree: str | None = None  # "off", "auto" or a number of tokens, as --tree takes it
    about: str | None = None  # what the pair is, in a few words (shown by --list-pairs)
    sampling: dict[str, int | float] = field(default_factory=dict)  # only the keys the file set


@dataclass(frozen=True)
class Config:
    """The parsed config file; empty when there is none."""

    path: Path | None = None
    models: Mapping[str, ModelSpec] = field(default_factory=dict)
    pairs: Mapping[str, PairSpec] = field(default_factory=dict)

    def resolve(self, ref: str) -> ModelSpec | PairSpec:
        """A pair name, a model name (this file's, else a built-in one), or else a path /
        Hub reference taken as it is."""
        for config in (self, builtin_config()):
            if ref in config.pairs:
                return config.pairs[ref]
            if ref in config.models:
                return config.models[ref]
        return ModelSpec(path=ref)

    def all_pairs(self) -> dict[str, PairSpec]:
        """Every pair a name can reach: the built-in ones, and this file's (which win)."""
        return {**builtin_config().pairs, **self.pairs}


BUILTIN_PATH = Path(__file__).with_name("builtin_models.toml")
DEFAULT_PAIR = "default"  # what `specdec run` uses without -m


@cache
def builtin_config() -> Config:
    """The models and pairs that ship with specdec (the default pair among them)."""
    return _parse(tomllib.loads(BUILTIN_PATH.read_text(encoding="utf-8")), BUILTIN_PATH)


def pair_lines(config: Config) -> list[str]:
    """What --list-pairs prints: each pair's name, what it is, its files."""
    lines = []
    for name, pair in config.all_pairs().items():
        where = "built-in" if pair is builtin_config().pairs.get(name) else str(config.path)
        about = f": {pair.about}" if pair.about else ""
        lines.append(f"{name} ({where}){about}")
        lines.append(f"  -m {pair.target.path}")
        flags = (f" -k {pair.k}" if pair.k else "") + (f" --tree {pair.tree}" if pair.tree else "")
        lines.append(f"  -d {pair.draft.path}{flags}")
    return lines


def default_config_path() -> Path:
    """The platform's per-user config location, chosen as the cache's is (machine.user_dir)."""
    return user_dir("config") / "models.toml"


def load_config(path: str | None) -> Config:
    """Read the config from `path`, else $SPECDEC_CONFIG, else the default location.

    Only the default location may be missing: a file the user named must exist.
    """
    if path:
        source = Path(path).expanduser()
        origin = ""
    elif os.environ.get(ENV_VAR):
        source = Path(os.environ[ENV_VAR]).expanduser()
        origin = f" (from ${ENV_VAR})"
    else:
        source = default_config_path()
        if not source.exists():
            return Config()
        origin = ""
    source = source.resolve()  # messages name it in full; relative model paths start from it
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"config file not found: {source}{origin}; check the path "
            "(an example is models.example.toml in the specdec repository)"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise UserError(f"cannot read config file {source}{origin}: {reason}") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: invalid TOML: {err}") from None
    return _parse(data, source)


def _parse(data: dict[str, Any], source: Path) -> Config:
    for key in data:
        if key not in ("models", "pairs"):
            _fail(source, key, "unknown table; expected [models.NAME] or [pairs.NAME]")
    model_tables = _tables(data, "models", source)
    pair_tables = _tables(data, "pairs", source)
    for name in model_tables.keys() & pair_tables.keys():
        _fail(source, f"pairs.{name}", "the same name is also used in [models]; rename one")

    models = {name: _model(name, table, source) for name, table in model_tables.items()}
    pairs = {
        name: _pair(name, table, models, pair_tables, source) for name, table in pair_tables.items()
    }
    return Config(path=source, models=models, pairs=pairs)


def _tables(data: dict[str, Any], section: str, source: Path) -> dict[str, dict[str, Any]]:
    """The [section.NAME] sub-tables, checking that each one is a table."""
    tables = data.get(section, {})
    if not isinstance(tables, dict):
        _fail(source, section, f"must be a table of [{section}.NAME] tables")
    for name, table in tables.items():
        if not isinstance(table, dict):
            _fail(source, f"{section}.{name}", f"must be a table ([{section}.{name}])")
    return tables


def _model(name: str, table: dict[str, Any], source: Path) -> ModelSpec:
    values = _check_keys(table, _MODEL_KEYS, f"models.{name}", source)
    if "path" not in values:
        _fail(source, f"models.{name}.path", "missing; give a GGUF file path or a Hub reference")
    values["path"] = _model_path(values["path"], source)
    return ModelSpec(name=name, **values)


def _pair(
    name: str,
    table: dict[str, Any],
    models: dict[str, ModelSpec],
    pair_tables: dict[str, Any],
    source: Path,
) -> PairSpec:
    where = f"pairs.{name}"
    values = _check_keys(table, _PAIR_KEYS | _SAMPLING_KEYS, where, source)
    roles = {}
    for role in ("target", "draft"):
        ref = values.pop(role, None)
        if ref is None:
            _fail(source, f"{where}.{role}", "missing; name a model, a path or a Hub reference")
        if ref in pair_tables:
            _fail(source, f"{where}.{role}", f"'{ref}' is a pair; name a model")
        roles[role] = models[ref] if ref in models else ModelSpec(path=_model_path(ref, source))
    about = values.pop("about", None)
    k_must, tree_must = (
        'a number of at least 1 or "auto"',
        '"off", "auto" or a number of at least 2',
    )
    k = _flag_value(values, "k", 1, ("auto",), k_must, where, source)
    tree = _flag_value(values, "tree", 2, ("off", "auto"), tree_must, where, source)
    return PairSpec(name=name, k=k, tree=tree, about=about, sampling=values, **roles)


def _flag_value(
    values: dict[str, object],
    key: str,
    least: int,
    words: tuple[str, ...],
    must: str,
    where: str,
    source: Path,
) -> str | None:
    """A pair's k or tree (taken out of `values`) as its flag takes it: one of `words`,
    or a TOML integer of at least `least`, as `must` says; None if the file left it out."""
    value = values.pop(key, None)
    if value is None or value in words:
        return value  # type: ignore[return-value]
    if not isinstance(value, int) or value < least:
        _fail(source, f"{where}.{key}", f"must be {must}, got {value!r}")
    return str(value)


def _check_keys(
    table: dict[str, Any], allowed: dict[str, type], where: str, source: Path
) -> dict[str, Any]:
    """Reject unknown keys and wrong types; return the values (ints widened for float keys)."""
    values = {}
    for key, value in table.items():
        if key not in allowed:
            _fail(source, f"{where}.{key}", f"unknown key; expected one of: {', '.join(allowed)}")
        expected = allowed[key]
        # bool is a subclass of int in Python, but `n_ctx = true` is a mistake.
        ok = not isinstance(value, bool) and (
            isinstance(value, (int, float)) if expected is float else isinstance(value, expected)
        )
        if not ok or (expected is str and not value):
            wanted = {str: "a non-empty string", int: "an integer", float: "a number"}.get(
                expected, "a number or a string"
            )
            _fail(source, f"{where}.{key}", f"must be {wanted}, got {value!r}")
        values[key] = float(value) if expected is float else value
    return values


def _model_path(value: str, source: Path) -> str:
    """Hub references stay as they are; file paths expand `~` and are relative to the config."""
    if is_hub_ref(value):
        return value
    return str(source.parent / Path(value).expanduser())


def _fail(source: Path, key: str, problem: str) -> NoReturn:
    raise UserError(f"{source}: {key}: {problem}")
