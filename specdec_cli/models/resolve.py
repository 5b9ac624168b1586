"""Turn what the user typed for a model into a local GGUF file.

A model reference is, in this order: a name from the config file's [models], an existing local
path, a Hugging Face reference (see hub.py), or else a missing file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from huggingface_hub import is_offline_mode

from specdec_cli.errors import UserError
from specdec_cli.models.config import DEFAULT_PAIR, Config, PairSpec, load_config
from specdec_cli.models.gguf_meta import check_gguf
from specdec_cli.models.hub import fetch_gguf, is_cached, is_hub_ref

NO_DRAFT = "none"  # `-d none`: run the target alone, as a baseline
HEAD = "mtp"  # `-d mtp`: the target's own MTP head drafts (models/heads.py)
OWN_MODELS = "pass your own models: -m TARGET.gguf [-d DRAFT.gguf]"


def locate_model(ref: str, config: Config | None = None) -> Path:
    """The local GGUF file for ref, downloading it first if it is a Hub reference.

    Without a config, the user's config file is read (--config's default location), so
    model names work everywhere. The file's header is checked before it is returned.
    """
    if config is None:
        config = load_config(None)
    spec = config.resolve(ref)
    if isinstance(spec, PairSpec):
        raise UserError(
            f"'{ref}' is a target/draft pair in {config.path}, not a single model; "
            f"name one of its models ({spec.target.path} or {spec.draft.path})"
        )
    path = Path(spec.path).expanduser()
    # An existing file wins over a Hub-shaped name like models/tinystories.
    if not path.exists() and is_hub_ref(spec.path):
        path = fetch_gguf(spec.path)
    elif not path.exists():
        raise UserError(
            f"model file not found: {spec.path}; check the path, or name a model from "
            f"{config.path or 'your config file'} or a Hub repo (OWNER/REPO:QUANT)"
        )
    check_gguf(path)
    return path


def locate_draft(ref: str, config: Config | None = None) -> Path | None:
    """Like locate_model, but `none` (any case) means no draft model and gives None."""
    if ref.lower() == NO_DRAFT:
        return None
    return locate_model(ref, config)


def default_pair(config: Config, notify: Callable[[str], None]) -> PairSpec:
    """The pair `specdec run` uses without -m. Before a first download, say what comes
    and how big; offline without it, say what to download, or how to do without."""
    pair = config.resolve(DEFAULT_PAIR)
    assert isinstance(pair, PairSpec), "the built-in config defines the default pair"
    missing = [spec.path for spec in (pair.target, pair.draft) if not is_cached(spec.path)]
    if missing and is_offline_mode():
        raise UserError(
            f"no -m given, and the default pair ({pair.about}) is not in the Hugging Face "
            f"cache while HF_HUB_OFFLINE is set: download {' and '.join(missing)} once "
            f"online, or {OWN_MODELS}"
        )
    if missing:
        notify(
            f"no -m given: downloading the default pair, {pair.about}, from the Hugging Face "
            "Hub, once (see `specdec run --list-pairs`; -m TARGET [-d DRAFT] to use others)"
        )
    return pair
