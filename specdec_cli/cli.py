"""The command line: parse, call, print. The work happens in the modules it calls."""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from specdec_cli import __version__, interrupt
from specdec_cli.api import ServeOptions
from specdec_cli.bench import BUILTIN_PROMPTS, BenchOptions, run_bench, variants
from specdec_cli.chat import ChatOptions, chat_options, template_override
from specdec_cli.config import ModelSpec, PairSpec, load_config, pair_lines
from specdec_cli.display import (
    DRAFTED_COLOR,
    TARGET_COLOR,
    bench_progress,
    load_pyplot,
    make_display,
    note,
    print_bench,
    warn,
    write_plot,
)
from specdec_cli.engine import (
    DEFAULT_MAX_CTX,
    DraftOptions,
    Engine,
    EngineOptions,
    GenerationOptions,
    Piece,
    parse_gpu_layers,
    parse_k,
)
from specdec_cli.errors import UserError
from specdec_cli.llama import builtin_chat_templates
from specdec_cli.models import NO_DRAFT, OWN_MODELS, default_pair, locate_draft, locate_model
from specdec_cli.prompts import read_prompt, read_prompts
from specdec_cli.sampling import SamplingParams
from specdec_cli.stats import Stats

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Lossless speculative decoding for llama.cpp GGUF models.",
)


def _print_version(value: bool) -> None:
    if value:
        from llama_cpp import __version__ as binding

        from specdec_cli.backend import backend_names

        backends = ", ".join(backend_names())
        print(f"specdec {__version__} (llama-cpp-python {binding}; llama.cpp backends: {backends})")
        raise typer.Exit()


def _list_devices(value: bool) -> None:
    if value:
        from specdec_cli.backend import device_list_text, gpu_devices

        print(device_list_text(gpu_devices()))
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Show versions and the backends llama.cpp was built with.",
        ),
    ] = False,
    list_devices: Annotated[
        bool,
        typer.Option(
            "--list-devices",
            callback=_list_devices,
            is_eager=True,
            help="List the devices -dev/-devd can name (GPUs), as llama.cpp does.",
        ),
    ] = False,
) -> None:
    """Lossless speculative decoding for llama.cpp GGUF models."""


# Options shared by `run` and `bench`. Names follow llama.cpp's where they mean the same.
# Defaults live in the dataclasses (EngineOptions, DraftOptions, SamplingParams, ...): an
# option defaults to None, so that a config file can fill in what the command line left
# out, and its help says the dataclass's value (see `described`).


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
    "Draft model (same forms as -m), 'ngram' for prompt lookup, or 'none' for "
    "target-only decoding. Both a model and 'ngram' (-d MODEL -d ngram): lookup "
    "first, the model where the text offers nothing to copy."
)
CtxOpt = Annotated[
    int | None,
    typer.Option(
        "-c",
        "--ctx-size",
        min=0,
        metavar="N",
        help=described(
            f"Context size in tokens (0: the model's own, at most {DEFAULT_MAX_CTX}).",
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
        help=described("With -d ngram: the shortest n-gram to look up.", DraftOptions.ngram_min),
    ),
]
NgramMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram-max",
        min=1,
        metavar="N",
        help=described(
            "With -d ngram: the longest n-gram to look up (tried first).", DraftOptions.ngram_max
        ),
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
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log.")]


def engine_options(
    model: str | None,
    drafts: list[str],
    config_path: str | None,
    *,
    k: str | None,
    ctx_size: int | None,
    batch_size: int | None,
    ubatch_size: int | None,
    threads: int | None,
    threads_draft: int | None,
    n_gpu_layers: str | None,
    n_gpu_layers_draft: str | None,
    device: str | None,
    device_draft: str | None,
    repack: bool | None,
    flash_attn: str | None,
    temp: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    draft_max: int | None,
    draft_min: int | None,
    draft_p_min: float | None,
    ngram_min: int | None,
    ngram_max: int | None,
    verbose: bool,
) -> tuple[EngineOptions, dict[str, int]]:
    """Turn the shared options (and the config file's defaults) into EngineOptions: what
    the command line gives, else what the config gives, else the dataclasses' defaults.

    Without a model, the built-in default pair (downloaded on first use).
    Returns the options and the pair's remaining defaults (seed, n_predict)."""
    config = load_config(config_path)
    spec = config.resolve(model) if model else default_pair(config, note)
    pair = spec if isinstance(spec, PairSpec) else None
    target_spec = pair.target if pair else spec
    defaults = dict(pair.sampling) if pair else {}
    draft, ngram = split_drafts(drafts)
    if not drafts and pair is not None:
        draft = pair.draft.name or pair.draft.path
    drafting = DraftOptions(
        **_given(
            k=_pick(k, pair.k if pair else None),
            draft_min=draft_min,
            draft_max=draft_max,
            p_min=draft_p_min,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
        )
    )
    parse_k(drafting.k)
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
        **_given(
            temp=_pick(temp, defaults.get("temp")),
            top_k=_pick(top_k, defaults.get("top_k")),
            top_p=_pick(top_p, defaults.get("top_p")),
            min_p=_pick(min_p, defaults.get("min_p")),
        )
    )
    try:
        target = locate_model(target_spec.path, config)
        draft_path = locate_draft(draft, config) if draft else None
    except UserError as err:
        if model:
            raise
        raise UserError(f"{err}; or {OWN_MODELS}") from None
    options = EngineOptions(
        target=target,
        draft=draft_path,
        ngram=ngram,
        n_gpu_layers=_gpu_layers(n_gpu_layers, "-ngl", target_spec),
        n_gpu_layers_draft=_gpu_layers(n_gpu_layers_draft, "-ngld", draft_spec),
        device=device,
        device_draft=device_draft,
        repack=repack,
        verbose=verbose,
        sampling=sampling,
        drafting=drafting,
        **_given(
            n_ctx=_pick(ctx_size, target_spec.n_ctx),
            n_batch=batch_size,
            n_ubatch=ubatch_size,
            threads=_pick(threads, target_spec.threads),
            threads_draft=_pick(threads_draft, getattr(draft_spec, "threads", None)),
            flash_attn=FlashAttn(flash_attn).value if flash_attn else None,
        ),
    )
    return options, {key: int(defaults[key]) for key in ("seed", "n_predict") if key in defaults}


def _gpu_layers(value: str | None, flag: str, spec: ModelSpec | PairSpec | None) -> int | None:
    """-ngl/-ngld as given, else the config's, else None (llama.cpp's default)."""
    if value is not None:
        return parse_gpu_layers(value, flag)
    return getattr(spec, "n_gpu_layers", None)


def split_drafts(drafts: list[str]) -> tuple[str | None, bool]:
    """-d values: (the draft model named, if any; whether n-gram lookup was asked for)."""
    models = [d for d in drafts if d.lower() != "ngram"]
    if len(models) > 1:
        raise UserError(f"one draft model at a time (got {', '.join(models)}); keep one -d")
    if models and models[0].lower() == NO_DRAFT and len(drafts) > 1:
        raise UserError("-d none runs the target alone; it cannot go with -d ngram (keep one)")
    return (models[0] if models else None), len(models) < len(drafts)


SHARED_OPTIONS = (
    "ctx_size", "batch_size", "ubatch_size", "threads", "threads_draft", "n_gpu_layers",
    "n_gpu_layers_draft",
    "device", "device_draft", "repack", "flash_attn", "temp", "top_k", "top_p", "min_p",
    "draft_max", "draft_min", "draft_p_min", "ngram_min", "ngram_max", "verbose",
)  # fmt: skip


def shared_options(command_args: dict[str, object]) -> dict[str, object]:
    """The options `run` and `bench` both take, picked from a command's arguments."""
    return {name: command_args[name] for name in SHARED_OPTIONS}


def _pick(*values: Any) -> Any:
    """The first value that is not None (the command line, then the config), else None."""
    return next((v for v in values if v is not None), None)


def _given(**values: Any) -> dict[str, Any]:
    """The values that were given: the dataclass's own defaults stand for the rest."""
    return {name: value for name, value in values.items() if value is not None}


@app.command()
def run(
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            metavar="MODEL",
            help=described(MODEL_HELP, "the built-in pair 'default' (see --list-pairs)"),
        ),
    ] = None,
    draft: Annotated[
        list[str] | None,
        typer.Option("-d", "-md", "--draft", metavar="DRAFT", help=described(DRAFT_HELP, "none")),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option(
            "-k",
            "--draft-length",
            metavar="N|auto",
            help=described(
                "Tokens to draft per round, or 'auto' to choose each round from the running "
                "acceptance and measured costs.",
                DraftOptions.k,
            ),
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option(
            "-p",
            "--prompt",
            metavar="TEXT",
            help="The prompt; '-' reads stdin (as does piping text in with no -p).",
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("-f", "--file", metavar="FILE", help="Read the prompt from this file."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            metavar="FILE",
            help="One prompt per line: one independent generation each, JSON Lines out. "
            "Each record's index is its line number and its seed reruns it alone "
            "(-p LINE --seed SEED).",
        ),
    ] = None,
    n_predict: Annotated[
        int | None,
        typer.Option(
            "-n",
            "--n-predict",
            metavar="N",
            help=described(
                "Tokens to generate at most; -1: until the model stops or the context is full.",
                GenerationOptions.n_predict,
            ),
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop",
            metavar="TEXT",
            help="Stop when this text appears (not printed); repeatable.",
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Wrap the prompt in the target's chat template as a user message, BOS "
            "added as llama-completion adds it. llama.cpp formats the chat: it knows a "
            "fixed set of formats and recognises a template by its markers; it does not "
            "run Jinja.",
        ),
    ] = False,
    system: Annotated[
        str | None,
        typer.Option("--system", metavar="TEXT", help="A system message (implies --chat)."),
    ] = None,
    messages: Annotated[
        str | None,
        typer.Option(
            "--messages",
            metavar="FILE",
            help='A conversation: a JSON file holding a list of {"role", "content"} objects '
            "(roles system, user, assistant, tool); '-' reads stdin. Implies --chat. A prompt "
            "(-p, -f, or each --prompts line) is added as the last user turn; --system is "
            "added first (refused if the file has a system message). If the conversation "
            "ends with an assistant message, the reply continues it.",
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            metavar="NAME|FILE",
            help="The chat format, instead of the model's own (implies --chat): a llama.cpp "
            f"built-in name ({', '.join(builtin_chat_templates())}), or a Jinja template "
            "file, which llama.cpp only recognises as one of those formats (else refused).",
        ),
    ] = None,
    temp: temp_option(SamplingParams.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="N",
            help=described(
                "Random seed; -1 picks one (and reports it).",
                GenerationOptions.seed,
            ),
        ),
    ] = None,
    ctx_size: CtxOpt = None,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    threads_draft: ThreadsDraftOpt = None,
    n_gpu_layers: NglOpt = None,
    n_gpu_layers_draft: NgldOpt = None,
    device: DeviceOpt = None,
    device_draft: DeviceDraftOpt = None,
    repack: RepackOpt = None,
    flash_attn: FlashOpt = None,
    draft_max: DraftMaxOpt = None,
    draft_min: DraftMinOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object at the end (text and stats) instead of streaming text.",
        ),
    ] = False,
    json_tokens: Annotated[
        bool,
        typer.Option(
            "--json-tokens",
            help="With --json (implied) or --prompts: also each token, its text and who "
            "chose it (the target, or the drafter whose guess it accepted).",
        ),
    ] = False,
    color: Annotated[
        bool,
        typer.Option(
            "--color",
            help=f"On a terminal, show accepted draft tokens in {DRAFTED_COLOR} and the "
            f"target's own in {TARGET_COLOR}.",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No stats.")] = False,
    list_pairs: Annotated[
        bool,
        typer.Option(
            "--list-pairs", help="List the named pairs (built-in and the config's) and exit."
        ),
    ] = False,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text, speculatively: the draft proposes, the target verifies.

    The output is what the target alone would produce (token for token with --temp 0,
    the same distribution when sampling), only faster when the draft guesses well.

    \b
    Examples:
      specdec run -m target.gguf -d draft.gguf -k 5 -p "Once upon a time" -n 256
      echo "Write a haiku" | specdec run -m target.gguf -d draft.gguf --chat --json
      specdec run -m target.gguf -d ngram -f rewrite-this-code.txt --temp 0
    """
    if list_pairs:
        print("\n".join(pair_lines(load_config(config))))
        return
    if prompts is not None and (prompt is not None or file is not None):
        raise UserError("--prompts runs its own prompts; drop -p / -f")
    # The input first: a typo there must not wait for models to load (or download).
    chat_opts = chat_options(chat, system, messages, chat_template, prompt)
    texts = read_prompts(prompts) if prompts else {0: read_prompt(prompt, file, messages)}
    options, defaults = engine_options(model, draft or [], config, k=k, **shared_options(locals()))
    generation = GenerationOptions(
        **_given(
            n_predict=_pick(n_predict, defaults.get("n_predict")),
            seed=_pick(seed, defaults.get("seed")),
        )
    )
    if generation.n_predict == 0 or generation.n_predict < -1:
        raise UserError(
            f"--n-predict must be at least 1, or -1 for no limit (got {generation.n_predict})"
        )
    if generation.seed < 0:
        generation = replace(generation, seed=int(np.random.SeedSequence().entropy % 2**32))
    as_json = as_json or (json_tokens and not prompts)
    for message in ignored_options(options, k, color and not as_json):
        warn(message)
    # Say why the first -k auto run pauses (a person, or a log, would wonder).
    with Engine(options, notify=None if quiet else note) as engine, ends_quietly_on_closed_pipe():
        for message in engine.warnings:
            warn(message)
        if prompts:
            _run_many(engine, texts, generation, tuple(stop or ()), chat_opts, json_tokens)
        else:
            output = Output(as_json, json_tokens, color, quiet)
            _run_one(engine, texts[0], generation, tuple(stop or ()), chat_opts, output)


def ignored_options(options: EngineOptions, k: str | None, color: bool = False) -> list[str]:
    """Options that would do nothing as given: one warning line each."""
    out = []
    if k is not None and options.draft is None and not options.ngram:
        out.append(f"-k {k} does nothing without a drafter; add -d DRAFT or -d ngram")
    if color and not sys.stdout.isatty():
        out.append("--color colours text on a terminal only; stdout is not one")
    return out


@dataclass(frozen=True)
class Output:
    """How `run` shows one generation."""

    as_json: bool = False
    json_tokens: bool = False
    color: bool = False
    quiet: bool = False


@contextmanager
def ends_quietly_on_closed_pipe() -> Iterator[None]:
    """`specdec run ... | head`: when the reader goes away, stop without a word, exit 0."""
    try:
        yield
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None


def fit_context(texts: dict[str, str], n_predict: int, ks: list[str], draft_max: int) -> int:
    """Just enough context for the benchmark: a larger KV cache slows every decode down."""
    longest_k = max([draft_max, *(int(k) for k in ks if k.isdigit())])
    longest_prompt = max(len(t.encode()) for t in texts.values()) + 2  # tokens <= bytes + BOS
    return -(-(longest_prompt + n_predict + longest_k + 2) // 256) * 256


def _run_one(
    engine: Engine,
    text: str | None,
    generation: GenerationOptions,
    stop: tuple[str, ...],
    chat: ChatOptions | None,
    output: Output,
) -> None:
    tokens = engine.tokenize(text, chat)
    stats = Stats(seed=None if engine.options.sampling.greedy else generation.seed)
    display = make_display(stats, output.as_json, output.quiet, output.color)
    pieces: list[Piece] = []
    rng = np.random.default_rng(generation.seed)
    try:
        with interrupt.generating():
            for piece in engine.pieces(tokens, generation.n_predict, rng, stats, stop):
                pieces.append(piece)
                if piece.text:
                    display.text(piece.text, drafted=piece.drafted)
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    display.finish()
    if output.as_json:
        record = {"text": "".join(p.text for p in pieces), "seed": generation.seed}
        record |= stats.to_dict()
        if output.json_tokens:
            record["token_list"] = token_records(engine, pieces)
        print(json.dumps(record))
    if stats.stop_reason == "interrupted":
        raise typer.Exit(interrupt.EXIT_CODE)


def token_records(engine: Engine, pieces: list[Piece]) -> list[dict[str, object]]:
    """--json-tokens: each token's id, its own text, and who chose it."""
    return [
        {"id": p.token, "text": engine.model.piece(p.token).decode(errors="replace"), "by": p.by}
        for p in pieces
        if p.token is not None
    ]


def line_seed(seed: int, line: int) -> int:
    """The seed of a --prompts line: its own random stream, derived from --seed and the
    line number (so that lines added elsewhere do not change it), and the --seed that
    reruns that line alone with -p."""
    return int(np.random.SeedSequence([seed, line]).generate_state(1)[0])


def _run_many(
    engine: Engine,
    texts: dict[int, str],
    generation: GenerationOptions,
    stop: tuple[str, ...],
    chat: ChatOptions | None,
    json_tokens: bool,
) -> None:
    """One JSON line per prompt, each with a seed of its own derived from --seed."""
    for line, text in texts.items():
        stats = Stats()
        tokens = engine.tokenize(text, chat)
        seed = line_seed(generation.seed, line)
        rng = np.random.default_rng(seed)
        try:
            with interrupt.generating():
                pieces = list(engine.pieces(tokens, generation.n_predict, rng, stats, stop))
        except KeyboardInterrupt:
            raise typer.Exit(interrupt.EXIT_CODE) from None
        out = "".join(p.text for p in pieces)
        record = {"index": line, "prompt": text, "text": out, "seed": seed, **stats.to_dict()}
        if json_tokens:
            record["token_list"] = token_records(engine, pieces)
        print(json.dumps(record), flush=True)


@app.command()
def bench(
    model: ModelOpt,
    draft: Annotated[
        list[str] | None,
        typer.Option(
            "-d",
            "-md",
            "--draft",
            metavar="DRAFT",
            help="Drafter(s) to measure: a draft model (same forms as -m) and/or 'ngram'. "
            "Repeatable; with both, their combination (lookup first) is measured too.",
        ),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option(
            "-k",
            "--draft-length",
            metavar="LIST",
            help=described("Draft lengths to try, e.g. 1,2,4,8,auto.", BenchOptions.ks),
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            metavar="FILE",
            help=described(
                "One prompt per line.",
                "a built-in set of story, code, list, factual and copy prompts",
            ),
        ),
    ] = None,
    n_predict: Annotated[
        int | None,
        typer.Option(
            "-n",
            "--n-predict",
            min=1,
            metavar="N",
            help=described("Tokens per generation.", BenchOptions.n_predict),
        ),
    ] = None,
    repeat: Annotated[
        int | None,
        typer.Option(
            "--repeat",
            min=1,
            metavar="N",
            help=described("Repeats of the whole set.", BenchOptions.repeat),
        ),
    ] = None,
    temp: temp_option(BenchOptions.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="N",
            help=described("Random seed (sampling only).", BenchOptions.seed),
        ),
    ] = None,
    ctx_size: CtxOpt = None,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    threads_draft: ThreadsDraftOpt = None,
    n_gpu_layers: NglOpt = None,
    n_gpu_layers_draft: NgldOpt = None,
    device: DeviceOpt = None,
    device_draft: DeviceDraftOpt = None,
    repack: RepackOpt = None,
    flash_attn: FlashOpt = None,
    draft_max: DraftMaxOpt = None,
    draft_min: DraftMinOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", metavar="FILE", help="Write every figure to this JSON file."),
    ] = None,
    plot_path: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write a PNG of tokens/s and acceptance against k (needs matplotlib).",
        ),
    ] = None,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure speedup, acceptance and cost: target-only vs every drafter and k, side by side.

    Loads the models once, runs all variants interleaved on the same prompts (warm-up
    excluded), measures the draft's cost and the target's cost of verifying n tokens,
    and reports the speedup a perfect implementation would reach with the measured
    acceptance, so you see why speculation pays or does not.

    \b
    Example:
      specdec bench -m target.gguf -d draft.gguf -d ngram -k 1,2,4,8,auto --json out.json
    """
    # Fail now, not after minutes of measuring.
    for path, flag in ((json_path, "--json"), (plot_path, "--plot")):
        if path:
            check_writable(path, flag)
    if plot_path:
        load_pyplot()
    drafts = draft or []
    if not drafts:
        raise UserError("nothing to compare: pass a draft model and/or 'ngram' with -d")
    model_draft, ngram = split_drafts(drafts)
    # Each drafter alone, and both together (lookup first) when both are named.
    kinds = [kind for kind, asked in (("model", model_draft), ("ngram", ngram)) if asked]
    if len(kinds) == 2:
        kinds.append("model+ngram")
    plan = BenchOptions(**_given(ks=k, n_predict=n_predict, repeat=repeat, seed=seed))
    ks = [x.strip() for x in plan.ks.split(",") if x.strip()]
    variant_list = variants(kinds, ks)
    texts = (
        {f"line {n}": t for n, t in read_prompts(prompts).items()} if prompts else BUILTIN_PROMPTS
    )
    flags = shared_options(locals())
    flags["temp"] = _pick(temp, BenchOptions.temp)
    options, _ = engine_options(model, drafts, config, k="1", **flags)
    if ctx_size is None:
        n_ctx = fit_context(texts, plan.n_predict, ks, options.drafting.draft_max)
        options = replace(options, n_ctx=n_ctx)
    with Engine(options, notify=note) as engine, ends_quietly_on_closed_pipe():
        for message in engine.warnings:
            warn(message)
        total = len(variant_list) * len(texts) * plan.repeat
        with bench_progress(total) as advance:
            report = run_bench(engine, variant_list, texts, plan, advance)
    print_bench(report)
    if json_path:
        try:
            json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as err:
            raise UserError(f"cannot write {json_path}: {err.strerror or err}") from None
    if plot_path:
        write_plot(report, str(plot_path))


@app.command()
def serve(
    model: ModelOpt,
    draft: Annotated[
        list[str] | None,
        typer.Option("-d", "-md", "--draft", metavar="DRAFT", help=described(DRAFT_HELP, "none")),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option(
            "-k",
            "--draft-length",
            metavar="N|auto",
            help=described(
                'Draft length for requests that do not set "speculative": {"k": N}.',
                DraftOptions.k,
            ),
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            metavar="HOST",
            help=described(
                "Address to listen on (0.0.0.0: every interface; mind --api-key).",
                ServeOptions.host,
            ),
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port", min=0, max=65535, metavar="N", help=described("Port.", ServeOptions.port)
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            metavar="KEY",
            help="Require 'Authorization: Bearer KEY' on every endpoint but /health and the "
            "page at /.",
        ),
    ] = None,
    alias: Annotated[
        str | None,
        typer.Option(
            "-a",
            "--alias",
            metavar="NAME",
            help=described("The model's name in the API.", "the target's file name"),
        ),
    ] = None,
    cors: Annotated[
        str | None,
        typer.Option(
            "--cors",
            metavar="ORIGIN",
            help=described("Let web pages from ORIGIN call the API.", "no CORS"),
        ),
    ] = None,
    queue: Annotated[
        int | None,
        typer.Option(
            "--queue",
            min=0,
            metavar="N",
            help=described(
                "Requests that may wait behind the one being generated; more get 503 "
                "with Retry-After.",
                ServeOptions.queue,
            ),
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            metavar="NAME|FILE",
            help="The chat format for /v1/chat/completions instead of the model's own: a "
            f"llama.cpp built-in name ({', '.join(builtin_chat_templates())}) or a template "
            "file llama.cpp recognises.",
        ),
    ] = None,
    temp: temp_option(SamplingParams.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    ctx_size: CtxOpt = None,
    batch_size: BatchOpt = None,
    ubatch_size: UBatchOpt = None,
    threads: ThreadsOpt = None,
    threads_draft: ThreadsDraftOpt = None,
    n_gpu_layers: NglOpt = None,
    n_gpu_layers_draft: NgldOpt = None,
    device: DeviceOpt = None,
    device_draft: DeviceDraftOpt = None,
    repack: RepackOpt = None,
    flash_attn: FlashOpt = None,
    draft_max: DraftMaxOpt = None,
    draft_min: DraftMinOpt = None,
    draft_p_min: DraftPMinOpt = None,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API, speculatively.

    POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models,
    /health, /metrics (Prometheus), and a chat page at /. Sampling flags are the
    defaults for requests that do not set their own. Stops on Ctrl-C or SIGTERM.

    \b
    Example:
      specdec serve -m target.gguf -d draft.gguf --port 8080 --api-key secret
    """
    try:
        from specdec_cli.server import serve as run_server
    except ImportError as err:
        raise UserError(
            f"specdec serve needs the server extra ({err.name} is missing): "
            "pip install 'specdec-cli[server]'"
        ) from None
    options, _ = engine_options(model, draft or [], config, k=k, **shared_options(locals()))
    for message in ignored_options(options, k):
        warn(message)
    given = _given(
        host=host,
        port=port,
        api_key=api_key,
        alias=alias,
        cors=cors,
        queue=queue,
        chat_template=template_override(chat_template) if chat_template else None,
    )
    run_server(options, ServeOptions(**given))


def check_writable(path: Path, flag: str) -> None:
    """Refuse, before any work, a path that a file cannot be written to."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: there is no directory {path.parent}; create it first")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable here; choose another path")


# --- model commands (info, check) ---

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


@app.command()
def info(
    model: Annotated[
        str | None,
        typer.Argument(
            help="A .gguf file, a name from the config, or a Hugging Face ref (OWNER/REPO:Q4_K_M)."
        ),
    ] = None,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Show what a GGUF model is: architecture, size, vocabulary, quantisation.
    Without a model: the llama.cpp build (its backends, GPU offload, devices) and this
    machine (cores, where the cache and the config live).

    Reads the file's header, and its vocabulary through llama.cpp (no weights), so it is
    quick even for large models.

    Example: specdec info models/qwen2.5-7b-instruct-q4_k_m.gguf --json
    """
    from specdec_cli import modelinfo

    if model is None:
        modelinfo.print_build(modelinfo.describe_build(), as_json=as_json)
        return
    facts = modelinfo.describe(modelinfo.load_model(model, config, need_vocab=False))
    modelinfo.print_info(facts, as_json=as_json)


@app.command()
def check(
    model: Annotated[
        str,
        typer.Option(
            "-m", "--model", help="The target model to speed up (same forms as `specdec info`)."
        ),
    ],
    draft: Annotated[
        str,
        typer.Option(
            "-d", "-md", "--draft", help="The draft model that would propose tokens for it."
        ),
    ],
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Check that a draft model can serve a target: same vocabulary and special tokens.

    Prints every reason they cannot. Exit code 0 if they can be paired, 1 if not.

    Example: specdec check -m qwen2.5-7b-q4_k_m.gguf -d qwen2.5-0.5b-q8_0.gguf
    """
    from specdec_cli import modelinfo
    from specdec_cli.compat import check_pair

    target_model = modelinfo.load_model(model, config)
    draft_model = modelinfo.load_model(draft, config)
    report = check_pair(target_model, draft_model)
    modelinfo.print_check(target_model, draft_model, report, as_json=as_json)
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    """Console entry point: turn expected failures into one line and an exit code."""
    try:
        result = app(standalone_mode=False, prog_name="specdec")
    except UserError as err:
        _fail(str(err), err.exit_code)
    except typer.TyperException as err:  # bad flags: click's usage errors, as typer raises them
        _fail_usage(err)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(interrupt.EXIT_CODE)
    # With standalone_mode=False, click returns typer.Exit's code instead of exiting.
    sys.exit(result if isinstance(result, int) else 0)


def _fail_usage(err: typer.TyperException) -> None:
    # typer raises its own copy of click's exceptions: told apart by name, not by class.
    if type(err).__name__ == "NoArgsIsHelpError":  # bare `specdec`: the help, as click does
        print(err.format_message(), file=sys.stderr)
        sys.exit(err.exit_code)
    if type(err).__name__ == "NoSuchOption":
        # click suggests any option a little alike (--bogus: "--verbose"); keep close ones.
        err.possibilities = difflib.get_close_matches(
            err.option_name, err.possibilities or [], cutoff=0.8
        )
    ctx = getattr(err, "ctx", None)
    hint = f" (see: {ctx.command_path} --help)" if ctx else ""
    _fail(f"{err.format_message()}{hint}", err.exit_code)


def _fail(message: str, code: int) -> None:
    print(f"specdec: error: {message}", file=sys.stderr)
    sys.exit(code)
