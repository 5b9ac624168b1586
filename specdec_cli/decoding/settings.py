"""The user's choices for an engine, as values: which models, how to load them, what
drafts and how much. Defaults live here, in the dataclasses, and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec_cli.decoding.grammar import Grammar
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import ModelParams

DEFAULT_MAX_CTX = 4096
# The most draft tokens --tree auto verifies in one round.
AUTO_TREE_NODES = 32


@dataclass(frozen=True)
class DraftOptions:
    """What drafts, and how much. `k` is a number of tokens or "auto"."""

    k: str = "auto"
    draft_min: int = 0
    draft_max: int = 16
    p_min: float = 0.0
    # 1-gram matches: on Spec-Bench's prompts the lookup's guess after one was right a fifth
    # to a quarter of the time (after 3-4 tokens, three times in four): never worth
    # verifying where verification is dear (benchmarks/README.md, "On real prompts").
    ngram_min: int = 2
    ngram_max: int = 4
    ngram_memory: int = 0  # tokens of earlier generations' texts the lookup may find (serve)
    tree: str = "auto"  # "off" (chains), "auto", or at most N tokens a round (see treeshape)


@dataclass(frozen=True)
class GenerationOptions:
    """How much `specdec run` generates, and from which random seed."""

    n_predict: int = 256  # -1: no limit (until the model stops or the context is full)
    seed: int = -1  # -1: pick one, and report it


@dataclass(frozen=True)
class EngineOptions:
    target: Path
    draft: Path | None = None  # a draft model file
    # The target's own MTP head drafts (-d mtp). None: where the target has one and no
    # draft model is given (see compat.head_problem); False: never.
    head: bool | None = None
    # N-gram lookup: alone, or tried before the draft model. None: before a draft model
    # (it drafts only where its guesses have lately beaten the model's).
    ngram: bool | None = None
    # Every slot's together (llama-server's -c); 0: per slot, the model's training
    # context, capped at DEFAULT_MAX_CTX.
    n_ctx: int = 0
    threads: int = 0  # 0: the machine's physical cores
    threads_draft: int = 0  # 0: same as threads
    n_gpu_layers: int | None = None  # None: llama.cpp's default, every layer the build can
    n_gpu_layers_draft: int | None = None
    device: str | None = None  # -dev: "CUDA0", "CUDA0,CUDA1" or "none"; None: every GPU
    device_draft: str | None = None  # -devd; None: as -dev (this machine's, with --rpc)
    rpc: tuple[str, ...] = ()  # --rpc: the workers' HOST:PORT; their devices join -dev's
    repack: bool | None = None  # --repack/--no-repack; None: on, unless the CPU crashes
    parallel: int = 1  # -np: generations decoded at once (serve), each in a slot of its own
    n_batch: int = 2048  # llama.cpp's -b: tokens one decode call takes
    n_ubatch: int = 512  # llama.cpp's -ub: tokens one compute graph takes
    flash_attn: str = "auto"  # "auto": whichever measures faster here (once, cached)
    verbose: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafting: DraftOptions = field(default_factory=DraftOptions)
    # What every generation's output follows (run and bench: --grammar, --json-schema);
    # None: nothing. A server's requests bring their own (see Decoder.start).
    grammar: Grammar | None = None
    # The target's multimodal projector (--mmproj): images or audio in prompts; None: text only.
    mmproj: Path | None = None
    # The draft model's own (--mmproj-draft): it then reads the media too; None: the text alone.
    mmproj_draft: Path | None = None


def drafter_kind(model: bool, ngram: bool | None, head: str | None = None) -> str | None:
    """The drafter for a draft model (or a drafting head: its kind, "mtp" or "eagle3")
    and/or n-gram lookup (see EngineOptions.ngram and Policy.decoder)."""
    if model or head:
        return model_drafter_kind(ngram, head or "model")
    return "ngram" if ngram else None


def model_drafter_kind(ngram: bool | None, model: str = "model") -> str:
    """A draft model's (or head's) drafter: lookup first, unless turned off."""
    return model if ngram is False else f"{model}+ngram"


def parse_gpu_layers(value: str, flag: str = "-ngl") -> int:
    """A number of layers to offload, or "auto" / "all" (every layer), as llama.cpp takes."""
    if value in ("auto", "all"):
        return ModelParams.n_gpu_layers
    try:
        return int(value)
    except ValueError:
        raise UserError(
            f"{flag} must be a number of layers, 'auto' or 'all' (got {value!r})"
        ) from None


def parse_tree(tree: str) -> int | None:
    """--tree: the most tokens a round's draft tree may hold (AUTO_TREE_NODES for
    "auto"), or None for "off" (chains)."""
    if tree == "off":
        return None
    if tree == "auto":
        return AUTO_TREE_NODES
    value = _at_least(tree, 2)
    if value is None:
        raise UserError(
            f"--tree must be 'off', 'auto' or a number of draft tokens of at least 2 (got {tree!r})"
        )
    return value


def parse_k(k: str) -> int | None:
    """A draft length: a positive integer, or None for "auto"."""
    if k == "auto":
        return None
    value = _at_least(k, 1)
    if value is None:
        raise UserError(f"-k must be a whole number of at least 1, or 'auto' (got {k!r})")
    return value


def _at_least(text: str, least: int) -> int | None:
    """`text` as a whole number, if it is one of at least `least`."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= least else None
