"""The flags `run`, `bench` and `serve` share, declared once: each option's name (llama.cpp's
where it means the same), its help and its type, and the groups of them that a command
takes in one parameter (see flag_group).

Every option defaults to None, so that a config file can fill in what the command line
left out (see options.py); its help says the default the dataclasses give (see
`described`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import DEFAULT_MAX_CTX, DraftOptions, EngineOptions
from specdec_cli.llamacpp.model import builtin_chat_templates


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
