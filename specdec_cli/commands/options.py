"""The options `run`, `bench` and `serve` share, built from their flags (flags.py) and the
config: what the command line gives, else what the config file gives, else the
dataclasses' defaults (EngineOptions, DraftOptions, SamplingParams, ...).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from specdec_cli.commands.flags import FlashAttn
from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import (
    DraftOptions,
    EngineOptions,
    GenerationOptions,
    parse_gpu_layers,
    parse_k,
    parse_tree,
)
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.machine import check_threads
from specdec_cli.llamacpp.rpc import parse_endpoints
from specdec_cli.messages import note
from specdec_cli.models.config import Config, ModelSpec, PairSpec, load_config
from specdec_cli.models.gguf_meta import read_gguf
from specdec_cli.models.heads import head_problem
from specdec_cli.models.resolve import (
    HEAD,
    LOOKUP,
    NO_DRAFT,
    OWN_MODELS,
    default_pair,
    locate_draft,
    locate_model,
    locate_projector,
)


def grammar_option(
    grammar: str | None,
    grammar_file: Path | None,
    json_schema: str | None,
    json_schema_file: Path | None,
) -> Grammar | None:
    """--grammar, --grammar-file, -j/--json-schema or --json-schema-file (at most one),
    parsed now: a bad one is one line before any model loads."""
    given = {
        "--grammar": grammar,
        "--grammar-file": grammar_file,
        "--json-schema": json_schema,
        "--json-schema-file": json_schema_file,
    }
    flags = [flag for flag, value in given.items() if value is not None]
    if not flags:
        return None
    if len(flags) > 1:
        raise UserError(f"give one of {', '.join(flags)}, not both")
    text = grammar if grammar is not None else json_schema
    path = grammar_file or json_schema_file
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{flags[0]}: cannot read {path}: {e.__class__.__name__}") from None
    assert text is not None
    if "schema" in flags[0]:
        return Grammar.json_schema(text)
    return Grammar.gbnf(text)


def engine_options(
    model: str | None,
    drafts: list[str],
    config_path: str | None,
    *,
    k: str | None,
    tree: str | None = None,
    ctx_size: int | None,
    batch_size: int | None,
    ubatch_size: int | None,
    threads: int | None,
    threads_draft: int | None,
    n_gpu_layers: str | None,
    n_gpu_layers_draft: str | None,
    device: str | None,
    device_draft: str | None,
    rpc: str | None,
    repack: bool | None,
    flash_attn: str | None,
    temp: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    coupled: bool | None,
    draft_max: int | None,
    draft_min: int | None,
    draft_p_min: float | None,
    ngram: bool | None,
    ngram_min: int | None,
    ngram_max: int | None,
    verbose: bool,
    mmproj: str | None = None,
    no_mmproj: bool = False,
    mmproj_draft: str | None = None,
    find_mmproj: bool = False,
) -> tuple[EngineOptions, dict[str, int]]:
    """Turn the shared options (and the config file's defaults) into EngineOptions: what
    the command line gives, else what the config gives, else the dataclasses' defaults.
    `find_mmproj`: with neither --mmproj nor --no-mmproj, the projector beside a Hub
    model (see projector_path).

    Without a model, the built-in default pair (downloaded on first use).
    Returns the options and the pair's remaining defaults (seed, n_predict)."""
    config = load_config(config_path)
    spec = config.resolve(model) if model else default_pair(config, note)
    pair = spec if isinstance(spec, PairSpec) else None
    target_spec = pair.target if pair else spec
    defaults = dict(pair.sampling) if pair else {}
    if not drafts and pair is not None:  # the pair's draft, as -d takes it (a model, ngram)
        drafts = [pair.draft.name or pair.draft.path]
    draft, lookup_named = split_drafts(drafts)
    ngram = lookup_setting(draft, lookup_named, ngram)
    head = head_setting(drafts, draft, lookup_named)
    drafting = DraftOptions(
        **only_given(
            k=first_given(k, pair.k if pair else None),
            draft_min=draft_min,
            draft_max=draft_max,
            p_min=draft_p_min,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
            tree=first_given(tree, pair.tree if pair else None),
        )
    )
    parse_k(drafting.k)
    parse_tree(drafting.tree)
    if drafting.draft_min > drafting.draft_max:
        raise UserError(
            f"--draft-min ({drafting.draft_min}) is above --draft-max ({drafting.draft_max})"
        )
    if drafting.ngram_min > drafting.ngram_max:
        raise UserError(
            f"--ngram-min ({drafting.ngram_min}) is above --ngram-max ({drafting.ngram_max})"
        )
    draft_spec = config.resolve(draft) if draft and draft.lower() != "none" else None
    sampling = SamplingParams(
        **only_given(
            temp=first_given(temp, defaults.get("temp")),
            top_k=first_given(top_k, defaults.get("top_k")),
            top_p=first_given(top_p, defaults.get("top_p")),
            min_p=first_given(min_p, defaults.get("min_p")),
            coupled=coupled,
        )
    )
    try:
        target = locate_model(target_spec.path, config)
        draft_path = locate_draft(draft, config) if draft else None
        find = target_spec.path if find_mmproj else None
        projector = projector_path(mmproj, no_mmproj, find, config)
        draft_projector = projector_path(mmproj_draft, False, None, config)
    except UserError as err:
        if model:
            raise
        raise UserError(f"{err}; or {OWN_MODELS}") from None
    options = EngineOptions(
        target=target,
        draft=draft_path,
        mmproj=projector,
        mmproj_draft=draft_projector,
        head=head,
        ngram=ngram,
        n_gpu_layers=_gpu_layers(n_gpu_layers, "-ngl", target_spec),
        n_gpu_layers_draft=_gpu_layers(n_gpu_layers_draft, "-ngld", draft_spec),
        device=device,
        device_draft=device_draft,
        rpc=parse_endpoints(rpc) if rpc is not None else (),
        repack=repack,
        verbose=verbose,
        sampling=sampling,
        drafting=drafting,
        **only_given(
            n_ctx=first_given(ctx_size, target_spec.n_ctx),
            n_batch=batch_size,
            n_ubatch=ubatch_size,
            threads=check_threads(first_given(threads, target_spec.threads), "-t"),
            threads_draft=check_threads(
                first_given(threads_draft, getattr(draft_spec, "threads", None)), "-td"
            ),
            flash_attn=FlashAttn(flash_attn).value if flash_attn else None,
        ),
    )
    return options, {key: int(defaults[key]) for key in ("seed", "n_predict") if key in defaults}


def projector_path(
    mmproj: str | None, no_mmproj: bool, model: str | None, config: Config
) -> Path | None:
    """--mmproj's file; none with --no-mmproj; else, where `model` is given, the
    projector beside it if it is a Hub reference (as llama-server's -hf finds one)."""
    if mmproj is not None and no_mmproj:
        raise UserError("--mmproj names a projector and --no-mmproj leaves it out; keep one")
    if mmproj is not None:
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise UserError(f"projector file not found: {mmproj}; check the path")
        return path
    if no_mmproj or model is None:
        return None
    return locate_projector(model, config)


def _gpu_layers(value: str | None, flag: str, spec: ModelSpec | PairSpec | None) -> int | None:
    """-ngl/-ngld as given, else the config's, else None (llama.cpp's default)."""
    if value is not None:
        return parse_gpu_layers(value, flag)
    return getattr(spec, "n_gpu_layers", None)


def split_drafts(drafts: list[str]) -> tuple[str | None, bool]:
    """-d values: (the draft model named, if any; whether n-gram lookup was asked for).
    The target's head ('mtp') is not a model: see head_setting."""
    models = [d for d in drafts if d.lower() not in (LOOKUP, HEAD)]
    lookup = any(d.lower() == LOOKUP for d in drafts)
    heads = len(drafts) - len(models) - lookup
    if len(models) + bool(heads) > 1:
        named = [*models, HEAD] if heads else models
        raise UserError(f"one draft model at a time (got {', '.join(named)}); keep one -d")
    return (models[0] if models else None), lookup


def head_setting(drafts: list[str], draft: str | None, lookup: bool) -> bool | None:
    """Whether the target's MTP head drafts (EngineOptions.head): True for -d mtp, False
    where -d names something else (a model, 'none', the lookup alone), else None."""
    if any(d.lower() == HEAD for d in drafts):
        return True
    return False if draft or lookup else None


def lookup_setting(draft: str | None, named: bool, flag: bool | None) -> bool | None:
    """Whether n-gram lookup runs, from -d (`named`: -d ngram) and --ngram/--no-ngram:
    True when asked for either way, False when turned off, None for the default
    (beside a draft model, see EngineOptions.ngram)."""
    if named and flag is False:
        raise UserError("-d ngram asks for n-gram lookup and --no-ngram turns it off; keep one")
    if (named or flag) and draft is not None and draft.lower() == NO_DRAFT:
        raise UserError("-d none runs the target alone; it cannot go with n-gram lookup (keep one)")
    return True if named else flag


def shared_options(command_args: dict[str, Any]) -> dict[str, Any]:
    """The options `run`, `bench` and `serve` all take, picked from a command's arguments
    (its locals()): the sampling filters, --verbose and the engine flags."""
    names = ("temp", "top_k", "top_p", "min_p", "coupled", "verbose")
    shared = {name: command_args[name] for name in names}
    return shared | command_args["engine_flags"]


def first_given(*values: Any) -> Any:
    """The first value that is not None (the command line, then the config), else None."""
    return next((v for v in values if v is not None), None)


def only_given(**values: Any) -> dict[str, Any]:
    """The values that were given: the dataclass's own defaults stand for the rest."""
    return {name: value for name, value in values.items() if value is not None}


def generation_options(
    n_predict: int | None, seed: int | None, pair_defaults: dict[str, int]
) -> GenerationOptions:
    """-n and --seed as given, else the pair's, else the dataclass's; a seed of -1 picks
    one (reported with the stats, so that the run can be repeated)."""
    generation = GenerationOptions(
        **only_given(
            n_predict=first_given(n_predict, pair_defaults.get("n_predict")),
            seed=first_given(seed, pair_defaults.get("seed")),
        )
    )
    if generation.n_predict == 0 or generation.n_predict < -1:
        raise UserError(
            f"--n-predict must be at least 1, or -1 for no limit (got {generation.n_predict})"
        )
    if generation.seed < 0:
        generation = replace(generation, seed=int(np.random.SeedSequence().entropy % 2**32))
    return generation


def drafts_itself(options: EngineOptions) -> bool:
    """Whether the target drafts with its own MTP head (see EngineOptions.head)."""
    if options.head is None:
        return head_problem(read_gguf(options.target)) is None
    return options.head


def ignored_options(options: EngineOptions, k: str | None, color: bool = False) -> list[str]:
    """Options that would do nothing as given: one warning line each."""
    out = []
    if k is not None and options.draft is None and not options.ngram and not drafts_itself(options):
        out.append(f"-k {k} does nothing without a drafter; add -d DRAFT or -d ngram")
    if color and not sys.stdout.isatty():
        out.append("--color colours text on a terminal only; stdout is not one")
    return out
