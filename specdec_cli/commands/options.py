"""The options `run`, `bench` and `serve` share, and the config merge: what the command
line gives, else what the config file gives, else the dataclasses' defaults.

Names follow llama.cpp's where they mean the same. Defaults live in the dataclasses
(EngineOptions, DraftOptions, SamplingParams, ...): an option defaults to None, so that
a config file can fill in what the command line left out, and its help says the
dataclass's value (see `described`).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import (
    DEFAULT_MAX_CTX,
    DraftOptions,
    EngineOptions,
    GenerationOptions,
    parse_gpu_layers,
    parse_k,
    parse_tree,
)
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import builtin_chat_templates
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


def described(text: str, default: object) -> str:
    """An option's help, ending with its default, said once."""
    return f"{text}  [default: {default}]"


MODEL_HELP = (
    "Target model: a .gguf file, a name from the config (a [models] or [pairs] entry), "
    "or a Hugging Face ref (hf://OWNER/REPO/FILE.gguf, OWNER/REPO:Q4_K_M)."
)
ModelOpt = Annotated[
    str,
    typer.Option("-m", "--model", metavar="MODEL", help=MODEL_HELP, show_default=False),
]
DRAFT_HELP = (
    "Draft model (same forms as -m), 'mtp' for the target's own MTP head, 'ngram' for "
    "prompt lookup alone, or 'none' for target-only decoding. A draft model or head comes "
    "with lookup first (see --ngram). Without -d, a target with an MTP head drafts with it."
)
DraftsOpt = Annotated[
    list[str] | None,
    typer.Option("-d", "-md", "--draft", metavar="DRAFT", help=described(DRAFT_HELP, "none")),
]
CtxOpt = Annotated[
    int | None,
    typer.Option(
        "-c",
        "--ctx-size",
        min=0,
        metavar="N",
        help=described(
            f"Context size in tokens, every slot's together (0: per slot, the model's own, "
            f"at most {DEFAULT_MAX_CTX}).",
            EngineOptions.n_ctx,
        ),
    ),
]
BatchOpt = Annotated[
    int | None,
    typer.Option(
        "-b",
        "--batch-size",
        min=1,
        metavar="N",
        help=described(
            "Most tokens one decode call takes; a round's draft is verified in one "
            "call, so drafts stop at this minus 1.",
            EngineOptions.n_batch,
        ),
    ),
]
UBatchOpt = Annotated[
    int | None,
    typer.Option(
        "-ub",
        "--ubatch-size",
        min=1,
        metavar="N",
        help=described("Most tokens one compute graph takes.", EngineOptions.n_ubatch),
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "-t",
        "--threads",
        min=0,
        metavar="N",
        help=described("CPU threads for the target (0: physical cores).", EngineOptions.threads),
    ),
]
ThreadsDraftOpt = Annotated[
    int | None,
    typer.Option(
        "-td",
        "--threads-draft",
        min=0,
        metavar="N",
        help=described("CPU threads for the draft.", "as -t"),
    ),
]
NglOpt = Annotated[
    str | None,
    typer.Option(
        "-ngl",
        "--n-gpu-layers",
        metavar="N",
        help=described(
            "Target layers to offload to the GPU: a number (0: CPU only), or 'auto'/'all'.",
            "all the build can offload",
        ),
    ),
]
NgldOpt = Annotated[
    str | None,
    typer.Option(
        "-ngld",
        "--n-gpu-layers-draft",
        metavar="N",
        help=described("Draft layers to offload to the GPU, as -ngl.", "all"),
    ),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "-dev",
        "--device",
        metavar="DEVICES",
        help=described(
            "Device(s) for the target, comma-separated ('none': no offload; see --list-devices).",
            "every GPU",
        ),
    ),
]
DeviceDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-devd",
        "--device-draft",
        metavar="DEVICES",
        help=described("Device(s) for the draft model, as -dev.", "as -dev"),
    ),
]
RpcOpt = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        metavar="SERVERS",
        help=described(
            "RPC workers for the target's layers, HOST:PORT[,HOST:PORT...] (`specdec worker` "
            "on each); the draft stays on this machine unless -devd names one.",
            "none",
        ),
    ),
]
RepackOpt = Annotated[
    bool | None,
    typer.Option(
        "--repack/--no-repack",
        " /-nr",  # llama.cpp's short name for --no-repack (click needs the space)
        help=described(
            "Repack weights for the CPU's fastest kernels.",
            "on, unless a test run shows that they crash on this CPU",
        ),
    ),
]
NgramOpt = Annotated[
    bool | None,
    typer.Option(
        "--ngram/--no-ngram",
        help=described(
            "N-gram lookup before the draft model: it drafts where the text repeats "
            "itself and its guesses have lately beaten the model's.",
            "on with a draft model",
        ),
    ),
]


class FlashAttn(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


FlashOpt = Annotated[
    FlashAttn | None,
    typer.Option(
        "-fa",
        "--flash-attn",
        metavar="on|off|auto",
        help=described(
            "Flash attention; auto: whichever measures faster on this machine "
            "(once per model and settings).",
            EngineOptions.flash_attn,
        ),
    ),
]


def temp_option(default: float) -> Any:
    """--temp, whose default differs: sampling for `run`, greedy for `bench`."""
    return Annotated[
        float | None,
        typer.Option(
            "--temp",
            min=0.0,
            metavar="T",
            help=described("Temperature; 0 is greedy.", default),
        ),
    ]


def draft_length_option(help: str) -> Any:
    """-k as run and serve take it (bench takes a list)."""
    return Annotated[
        str | None,
        typer.Option(
            "-k", "--draft-length", metavar="N|auto", help=described(help, DraftOptions.k)
        ),
    ]


TopKOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        min=0,
        metavar="N",
        help=described("Keep the k most likely tokens; 0 is off.", SamplingParams.top_k),
    ),
]
TopPOpt = Annotated[
    float | None,
    typer.Option(
        "--top-p",
        min=0.0,
        max=1.0,
        metavar="P",
        help=described(
            "Keep the smallest set with this much mass; 1 is off.", SamplingParams.top_p
        ),
    ),
]
MinPOpt = Annotated[
    float | None,
    typer.Option(
        "--min-p",
        min=0.0,
        max=1.0,
        metavar="P",
        help=described(
            "Drop tokens below min-p x the top probability; 0 is off.", SamplingParams.min_p
        ),
    ),
]
CoupledOpt = Annotated[
    bool | None,
    typer.Option(
        "--coupled/--no-coupled",
        help=(
            "Sample with noise keyed by the seed and the position, which the draft shares:"
            " a seed then gives the same text whatever is drafted (-d, -k, trees, other"
            " requests). Default: off, but on for serve with --parallel above 1."
        ),
        show_default=False,
    ),
]
GrammarOpt = Annotated[
    str | None,
    typer.Option(
        "--grammar",
        metavar="TEXT",
        help="Constrain the output to this grammar: llama.cpp's GBNF (or Lark). Exact: the "
        "target's distribution is the masked one, drafts or not.",
    ),
]
GrammarFileOpt = Annotated[
    Path | None,
    typer.Option("--grammar-file", metavar="FILE", help="--grammar, read from this file."),
]
JsonSchemaOpt = Annotated[
    str | None,
    typer.Option(
        "-j",
        "--json-schema",
        metavar="SCHEMA",
        help="Constrain the output to JSON that this JSON schema describes; '{}' is any JSON.",
    ),
]
JsonSchemaFileOpt = Annotated[
    Path | None,
    typer.Option("--json-schema-file", metavar="FILE", help="--json-schema, read from this file."),
]


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


DraftMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-max",
        min=1,
        metavar="N",
        help=described("With -k auto: the longest draft.", DraftOptions.draft_max),
    ),
]
DraftMinOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-min",
        min=0,
        metavar="N",
        help=described("With -k auto: the shortest draft.", DraftOptions.draft_min),
    ),
]
DraftPMinOpt = Annotated[
    float | None,
    typer.Option(
        "--draft-p-min",
        min=0.0,
        max=1.0,
        metavar="P",
        help=described(
            "Stop drafting when the draft's top probability falls below this.", DraftOptions.p_min
        ),
    ),
]
NgramMinOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram-min",
        min=1,
        metavar="N",
        help=described(
            "N-gram lookup: the shortest n-gram to look up (beside a draft model, 3 at least).",
            DraftOptions.ngram_min,
        ),
    ),
]
NgramMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram-max",
        min=1,
        metavar="N",
        help=described(
            "N-gram lookup: the longest n-gram to look up (tried first).", DraftOptions.ngram_max
        ),
    ),
]
TreeOpt = Annotated[
    str | None,
    typer.Option(
        "--tree",
        metavar="off|auto|N",
        help=described(
            "Draft a tree of up to N tokens a round (alternatives beside the chain, all "
            "verified in one target pass); 'auto' adds those the measured costs say pay.",
            DraftOptions.tree,
        ),
    ),
]


class ReasoningFormat(str, Enum):
    """--reasoning-format's choices (llama-server's names)."""

    auto = "auto"
    deepseek = "deepseek"
    none = "none"


ChatTemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        metavar="NAME|FILE",
        help="The chat format instead of the model's own (for run, implies --chat): a "
        f"llama.cpp built-in name ({', '.join(builtin_chat_templates())}), or a Jinja "
        "template file (with --no-jinja, only one llama.cpp recognises as a built-in).",
    ),
]
ChatTemplateFileOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-template-file",
        metavar="FILE",
        help="A Jinja chat template to use instead of the model's own (llama-server's flag).",
    ),
]
JinjaOpt = Annotated[
    bool,
    typer.Option(
        "--jinja/--no-jinja",
        help="Run the chat template as Jinja, in a sandbox, as transformers and llama-server "
        "do; --no-jinja: llama.cpp's built-in formats, recognised by markers.",
    ),
]
ChatTemplateKwargsOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-template-kwargs",
        metavar="JSON",
        help="Extra variables for the Jinja template, e.g. '{\"enable_thinking\": false}'.",
    ),
]
VerbosePromptOpt = Annotated[
    bool,
    typer.Option(
        "--verbose-prompt",
        help="Print the prompt as the model receives it (chat template applied) and its "
        "token count to stderr.",
    ),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help=described(
            "Config file of named models and pairs.",
            "$SPECDEC_CONFIG, then models.toml in the user config dir",
        ),
    ),
]
MmprojOpt = Annotated[
    str | None,
    typer.Option(
        "-mm",
        "--mmproj",
        metavar="FILE",
        help="The target's multimodal projector (its mmproj-*.gguf file), for images and "
        "audio. With a Hub reference for -m, the one beside the model is found.",
        show_default=False,
    ),
]
NoMmprojOpt = Annotated[
    bool, typer.Option("--no-mmproj", help="No projector, even where the Hub repo has one.")
]
MmprojDraftOpt = Annotated[
    str | None,
    typer.Option(
        "--mmproj-draft",
        metavar="FILE",
        help="The draft model's own projector: the draft then reads the images and audio "
        "too (else the text alone). Each draft round after an image guesses better; the "
        "draft encodes each image once more.",
        show_default=False,
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]

# How the models load and run, and how the drafters draft: the same options, in this order
# (their order in --help), for every command that loads models.
ENGINE_FLAGS = {
    "ctx_size": CtxOpt,
    "batch_size": BatchOpt,
    "ubatch_size": UBatchOpt,
    "threads": ThreadsOpt,
    "threads_draft": ThreadsDraftOpt,
    "n_gpu_layers": NglOpt,
    "n_gpu_layers_draft": NgldOpt,
    "device": DeviceOpt,
    "device_draft": DeviceDraftOpt,
    "rpc": RpcOpt,
    "repack": RepackOpt,
    "flash_attn": FlashOpt,
    "draft_max": DraftMaxOpt,
    "draft_min": DraftMinOpt,
    "draft_p_min": DraftPMinOpt,
    "ngram": NgramOpt,
    "ngram_min": NgramMinOpt,
    "ngram_max": NgramMaxOpt,
}
FlagValues = dict[str, Any]  # a flag group's names and the values given
EngineFlags = FlagValues  # ENGINE_FLAGS' (None: not given)


def flag_group(
    parameter: str, flags: dict[str, Any], defaults: dict[str, Any] | None = None
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A decorator that gives a command the `flags` options where its parameter
    `parameter` stands, and hands their values to it in that one parameter (a dict).

    typer reads a command's options from its signature: this writes them into the
    signature it sees, so that they are declared once for every command. `defaults`:
    the flags' defaults where not None."""
    defaults = defaults or {}

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        parameters = []
        for p in signature.parameters.values():
            if p.name != parameter:
                parameters.append(p)
                continue
            parameters += [
                inspect.Parameter(name, p.kind, default=defaults.get(name), annotation=option)
                for name, option in flags.items()
            ]

        @functools.wraps(command)
        def with_flags(**args: Any) -> None:
            values = {name: args.pop(name) for name in flags}
            command(**args, **{parameter: values})

        with_flags.__signature__ = signature.replace(parameters=parameters)
        return with_flags

    return decorate


# -c, -b, -t, -ngl, -fa, ...: for every command that loads models
takes_engine_flags = flag_group("engine_flags", ENGINE_FLAGS)
# The chat template: for every command that formats chats (run, serve; bench for questions)
CHAT_FLAGS = {
    "chat_template": ChatTemplateOpt,
    "chat_template_file": ChatTemplateFileOpt,
    "jinja": JinjaOpt,
    "chat_template_kwargs": ChatTemplateKwargsOpt,
}
takes_chat_flags = flag_group("chat_flags", CHAT_FLAGS, {"jinja": True})
# The projector: for every command that takes images or audio (run, serve)
PROJECTOR_FLAGS = {"mmproj": MmprojOpt, "no_mmproj": NoMmprojOpt, "mmproj_draft": MmprojDraftOpt}
takes_projector_flags = flag_group("projector_flags", PROJECTOR_FLAGS, {"no_mmproj": False})


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
            threads=first_given(threads, target_spec.threads),
            threads_draft=first_given(threads_draft, getattr(draft_spec, "threads", None)),
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
