"""Models loaded once, ready for any number of generations.

This is where the user's choices become objects: which drafter, which draft length
policy, which sampling settings, and the compatibility check between the two models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specdec_cli import backend, compat, costcache, gguf_meta
from specdec_cli.chat import (
    ChatOptions,
    Message,
    chat_tokens,
    conversation,
    own_chat_tokens,
    render,
)
from specdec_cli.costmodel import (
    FLASH_ATTN_BATCHES,
    Costs,
    faster_flash_attn,
    measure_costs,
    time_decodes,
)
from specdec_cli.decode import Decoder
from specdec_cli.drafters import Drafter, LookupThenModel, ModelDrafter, NgramDrafter
from specdec_cli.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.errors import UserError
from specdec_cli.llama import (
    LLAMA_MAX_SEQ,
    Context,
    ContextParams,
    Model,
    ModelParams,
    init_backend,
)
from specdec_cli.machine import physical_cores
from specdec_cli.probe import choose_repack
from specdec_cli.sampling import SamplingParams
from specdec_cli.stats import FlashAttnChoice, Stats
from specdec_cli.textstream import TextStream
from specdec_cli.translate import TranslatedDrafter, Translation
from specdec_cli.treeshape import MAX_WIDTH, AutoTree, FixedTree, TreePolicy

DEFAULT_MAX_CTX = 4096
# A translated draft's context holds this many times the target's: the same text can
# take it more tokens (a 32k vocabulary's against a 262k one's); past that, no drafts.
TRANSLATED_ROOM = 2
LOOKUP_MIN_MATCH = 3  # with a draft model too; measured, see benchmarks/README.md
VERBATIM_PRIOR = 0.99  # -k auto's first estimate for verbatim repeats (see NgramDrafter)
# ...and for a draft of another vocabulary, whose guesses reach the target through its
# text (benchmarks/README.md, "Any draft for any target").
TRANSLATED_PRIOR = 0.5
# The most draft tokens --tree auto verifies in one round.
AUTO_TREE_NODES = 32
# Where -fa auto compares flash attention on and off: a few hundred tokens in, where
# attention's share of a decode starts to show (at most half the context).
FLASH_ATTN_POSITION = 256


@dataclass(frozen=True)
class DraftOptions:
    """What drafts, and how much. `k` is a number of tokens or "auto"."""

    k: str = "auto"
    draft_min: int = 0
    draft_max: int = 16
    p_min: float = 0.0
    ngram_min: int = 1
    ngram_max: int = 4
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
    # N-gram lookup: alone, or tried before the draft model. None: before a draft model
    # (it drafts only where its guesses have lately beaten the model's).
    ngram: bool | None = None
    n_ctx: int = 0  # 0: the model's training context, capped at DEFAULT_MAX_CTX
    threads: int = 0  # 0: the machine's physical cores
    threads_draft: int = 0  # 0: same as threads
    n_gpu_layers: int | None = None  # None: llama.cpp's default, every layer the build can
    n_gpu_layers_draft: int | None = None
    device: str | None = None  # -dev: "CUDA0", "CUDA0,CUDA1" or "none"; None: every GPU
    device_draft: str | None = None  # -devd; None: as -dev
    repack: bool | None = None  # --repack/--no-repack; None: on, unless the CPU crashes
    n_batch: int = 2048  # llama.cpp's -b: tokens one decode call takes
    n_ubatch: int = 512  # llama.cpp's -ub: tokens one compute graph takes
    flash_attn: str = "auto"  # "auto": whichever measures faster here (once, cached)
    verbose: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafting: DraftOptions = field(default_factory=DraftOptions)


def drafter_kind(model: bool, ngram: bool | None) -> str | None:
    """The drafter for a draft model and/or n-gram lookup (see EngineOptions.ngram and
    Engine.make_decoder)."""
    if model:
        return model_drafter_kind(ngram)
    return "ngram" if ngram else None


def model_drafter_kind(ngram: bool | None) -> str:
    """A draft model's drafter: lookup first, unless turned off."""
    return "model" if ngram is False else "model+ngram"


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


def model_params(
    n_gpu_layers: int | None, device: str | None, flag: str, repack: bool
) -> ModelParams:
    """What llama.cpp is told to load a model with; None leaves llama.cpp's default."""
    devices = None
    if device is not None:
        devices = tuple(backend.pick_devices(device, backend.gpu_devices(), flag))
    layers = ModelParams.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
    return ModelParams(layers, devices, repack)


def _draft_device(options: EngineOptions) -> tuple[str | None, str]:
    """The draft's -devd, or else -dev as llama.cpp does; and the flag it came from."""
    if options.device_draft is not None:
        return options.device_draft, "-devd"
    return options.device, "-dev"


def offload_warning(options: EngineOptions, can_offload: bool) -> str | None:
    """One line when -ngl/-ngld asked for GPU layers that this build cannot offload."""
    given = [
        flag
        for flag, layers in (("-ngl", options.n_gpu_layers), ("-ngld", options.n_gpu_layers_draft))
        if layers not in (None, 0)
    ]
    if can_offload or not given:
        return None
    return (
        f"this llama.cpp build has no GPU backend ({', '.join(backend.backend_names())} only): "
        f"{' and '.join(given)} ignored, the models run on the CPU "
        "(to offload, reinstall llama-cpp-python with GPU support: see the README, GPU builds)"
    )


def parse_tree(tree: str) -> int | None:
    """--tree: the most tokens a round's draft tree may hold (AUTO_TREE_NODES for
    "auto"), or None for "off" (chains)."""
    if tree == "off":
        return None
    if tree == "auto":
        return AUTO_TREE_NODES
    try:
        value = int(tree)
    except ValueError:
        value = 0
    if value < 2:
        raise UserError(
            f"--tree must be 'off', 'auto' or a number of draft tokens of at least 2 (got {tree!r})"
        )
    return value


def parse_k(k: str) -> int | None:
    """A draft length: a positive integer, or None for "auto"."""
    if k == "auto":
        return None
    try:
        value = int(k)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"-k must be a whole number of at least 1, or 'auto' (got {k!r})")
    return value


class Engine:
    def __init__(self, options: EngineOptions, notify: Callable[[str], None] | None = None) -> None:
        """`notify` hears of slow one-time work (measuring costs), for the user."""
        self.options = options
        self.notify = notify
        draft_path = options.draft
        init_backend(options.verbose)
        pairing = check_models(options.target, draft_path)
        self.warnings = pairing.warnings + batch_warnings(options)
        self.repack, repack_note = choose_repack(options.repack)
        offload_note = offload_warning(options, backend.supports_gpu_offload())
        self.warnings += [note for note in (repack_note, offload_note) if note]
        # Both checked (device names) before the first, maybe long, load.
        repack = self.repack
        target_params = model_params(options.n_gpu_layers, options.device, "-dev", repack)
        draft_params = model_params(options.n_gpu_layers_draft, *_draft_device(options), repack)
        self._owned: list[Model | Context] = []
        self.model = self._own(Model(options.target, target_params))
        n_ctx = options.n_ctx or min(self.model.n_ctx_train, DEFAULT_MAX_CTX)
        threads = options.threads or physical_cores()
        # Before the contexts: their flash attention setting is fixed when they are made.
        self.flash_attn = self._choose_flash_attn(n_ctx, threads)
        draft_model = self._own(Model(draft_path, draft_params)) if draft_path else None
        self.tree_nodes = self._tree_nodes(draft_model, n_ctx)
        # A tree's leaves are the target's sequences; the draft needs one per node it
        # extends (see drafters._Growth).
        target_seqs = self.tree_nodes + 1 if self.tree_nodes else 1
        draft_seqs = min(LLAMA_MAX_SEQ, MAX_WIDTH * self._longest_draft() + 1)
        target_params = self._context_params(
            n_ctx, threads, n_rs_seq=self._longest_draft(), n_seq_max=target_seqs
        )
        self.target = self._own(Context(self.model, target_params))
        self.draft_ctx: Context | None = None
        self._costs: Costs | None = None
        if draft_model:
            # The draft must be able to hold the same sequence as the target.
            context_params = self._context_params(
                self.target.n_ctx * (TRANSLATED_ROOM if pairing.translated else 1),
                options.threads_draft or threads,
                n_seq_max=draft_seqs if self.tree_nodes else 1,
            )
            self.draft_ctx = self._own(Context(draft_model, context_params))
        # A draft of another vocabulary: its prompts, and the texts both vocabularies share.
        self.translation: Translation | None = None
        if draft_model and pairing.translated:
            self._translate_drafts(draft_model, pairing.differences[0])
        self.decoder = self.make_decoder(
            drafter_kind(draft_path is not None, options.ngram), options.drafting.k
        )

    def _translate_drafts(self, draft_model: Model, why: str) -> None:
        self.translation = Translation(self.model, draft_model)
        self.warnings.append(
            f"{draft_model.path.name} has another vocabulary than {self.model.path.name} "
            f"({why}): its drafts are translated, by their text when greedy, among the "
            f"{self.translation.shared.n_shared} token texts both share when sampling"
        )

    def _context_params(
        self, n_ctx: int, threads: int, n_rs_seq: int = 0, n_seq_max: int = 1
    ) -> ContextParams:
        o = self.options
        return ContextParams(
            n_ctx, threads, self.flash_attn.used, o.n_batch, o.n_ubatch, n_rs_seq, n_seq_max
        )

    def _tree_nodes(self, draft_model: Model | None, n_ctx: int) -> int:
        """The most tokens a draft tree may hold (0: chains only). A tree verifies in one
        decode call, and a context holds at most a batch's worth of sequences (one per
        leaf, and the accepted one). A recurrent model keeps one state per sequence, not
        per branch: it drafts and verifies chains."""
        tree = self.options.drafting.tree
        nodes = parse_tree(tree) or 0
        recurrent = [m.path.name for m in (self.model, draft_model) if m and m.recurrent]
        if nodes and recurrent:
            if tree != "auto":  # auto: trees where they pay, and they cannot here
                raise UserError(
                    f"--tree {tree}: {recurrent[0]} is recurrent and cannot verify or draft "
                    "a tree (its state is one per sequence); use --tree off"
                )
            return 0
        nodes = min(nodes, self.options.n_batch - 1, n_ctx - 1)
        return nodes if nodes >= 2 else 0

    def _longest_draft(self) -> int:
        """The most draft tokens one round can verify, within one decode call."""
        d = self.options.drafting
        n = parse_k(d.k) or d.draft_max
        return max(0, min(n, self.options.n_batch - 1))

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    def make_decoder(self, kind: str | None, k: str, tree: str | None = None) -> Decoder:
        """A decoder drafting with `kind` ("model", "ngram", "model+ngram", or None for
        target-only), draft length k (a number or "auto") and `tree` ("off", "auto" or
        a number of tokens; None: the options'). All decoders share the loaded models."""
        d, sampling = self.options.drafting, self.options.sampling
        tree = d.tree if tree is None else tree
        if kind is None:
            return Decoder(self.target, None, sampling)
        lookup = NgramDrafter(d.ngram_min, d.ngram_max, sampling.greedy)
        if kind == "ngram":
            drafter: Drafter = lookup
        elif self.draft_ctx is None:
            raise UserError("no draft model is loaded; pass one with -d")
        elif kind == "model":
            drafter = self.model_drafter(self.draft_ctx)
        else:
            # Next to a draft model, only longer matches are worth more than its guess.
            n_min = max(d.ngram_min, LOOKUP_MIN_MATCH)
            lookup = NgramDrafter(n_min, max(d.ngram_max, n_min), sampling.greedy)
            drafter = LookupThenModel(lookup, self.model_drafter(self.draft_ctx))
        # With -k auto, a lookup beside the model has a length policy of its own: it learns
        # that copied text is accepted far longer than the model's guesses.
        auto = parse_k(k) is None
        own = kind == "model+ngram" and auto
        lengths = {"ngram": self._draft_length("ngram", k)} if own else {}
        if auto and kind != "model":
            # A verbatim repeat is accepted far longer still: it starts out trusted.
            lengths[NgramDrafter.VERBATIM_SOURCE] = self._draft_length("ngram", k, VERBATIM_PRIOR)
        translated = self.translation is not None and kind != "ngram"
        length = self._draft_length(kind, k, TRANSLATED_PRIOR if translated else AutoLength.PRIOR)
        policy = self._tree_policy(tree, kind)
        return Decoder(
            self.target, drafter, sampling, length, k, policy, tree if policy else "off", lengths
        )

    def model_drafter(self, ctx: Context) -> ModelDrafter | TranslatedDrafter:
        """The draft model's drafter: in the target's vocabulary, or translated to it."""
        sampling = self.options.sampling
        if self.translation is None:
            return ModelDrafter(ctx, sampling, self.model.n_vocab)
        return TranslatedDrafter(ModelDrafter(ctx, sampling), self.translation)

    def _draft_length(self, kind: str, k: str, prior: float = AutoLength.PRIOR) -> DraftLength:
        """-k as a policy for a drafter of this kind: a fixed length, or auto's, priced
        with what this drafter costs and starting from `prior` acceptance."""
        d = self.options.drafting
        n = parse_k(k)
        if n is not None:
            return FixedLength(n, d.p_min)
        return AutoLength(
            self._costs_for(kind),
            d.draft_min,
            d.draft_max,
            d.p_min,
            uses_confidence=d.p_min > 0.0,
            prior=prior,
        )

    def fits_tree(self, tree: str) -> bool:
        """Whether a tree setting is no wider than this engine was made for. "auto"
        always fits: where no tree can be drafted, it drafts chains."""
        nodes = parse_tree(tree)
        return nodes is None or tree == "auto" or nodes <= self.tree_nodes

    def _tree_policy(self, tree: str, kind: str) -> TreePolicy | None:
        nodes = parse_tree(tree)
        if nodes is None or not self.tree_nodes:
            return None
        if not self.fits_tree(tree):
            raise UserError(
                f"--tree {tree} is wider than this engine was made for ({self.tree_nodes})"
            )
        if tree == "auto":
            return AutoTree(self._costs_for(kind), min(nodes, self.tree_nodes))
        return FixedTree(nodes)

    def _costs_for(self, kind: str) -> Costs:
        """The measured costs as a drafter of this kind pays them: a lookup costs next
        to nothing; a translated draft model takes as many draft calls a target token
        as its tokens are shorter than the target's."""
        costs = self.costs()
        if kind == "ngram":
            return replace(costs, draft_over_target=0.0)
        if self.translation is not None:
            calls = self.translation.calls_per_token
            return replace(costs, draft_over_target=costs.draft_over_target * calls)
        return costs

    def costs(self) -> Costs:
        """The draft's and the target's measured costs, for -k auto: measured once per
        models and settings, and kept on disk (see costcache)."""
        if self._costs is None:
            # A batch must fit in the context after the measuring position.
            widest = max(self.options.drafting.draft_max, self.tree_nodes)
            top = min(widest + 1, self.target.n_ctx // 2)
            # Every size up to 5, where k mostly settles (their costs are uneven: 2
            # tokens can cost less than 1); beyond, sizes double up to the largest, and
            # those in between are interpolated.
            sizes = {*range(1, min(top, 5) + 1), top}
            sizes |= {2**i + 1 for i in range(top.bit_length()) if 2**i < top}
            key = costcache.cache_key(self._model_paths(), self._cost_settings(sizes))
            self._costs = costcache.load(key)
            if self._costs is None:
                self._announce("the models' costs for -k auto", "these models")
                costcache.save(key, self.measure_costs(sizes, reps=5))
        return self._costs

    def _announce(self, what: str, scope: str) -> None:
        """Tell the user why this run pauses: one-time work, kept in the cache."""
        if self.notify:
            self.notify(
                f"measuring {what} (once for {scope} and settings; kept in {costcache.cache_dir()})"
            )

    def _choose_flash_attn(self, n_ctx: int, threads: int) -> FlashAttnChoice:
        """-fa as given, or for "auto" whichever of on and off decodes the target faster
        on this machine: measured once per target and settings, kept in the cache."""
        asked = self.options.flash_attn
        if asked != "auto":
            return FlashAttnChoice(asked, asked)
        o = self.options
        settings = {
            "measure": "flash_attn",
            "threads": threads,
            "gpu_layers": o.n_gpu_layers,
            "device": o.device,
            "repack": self.repack,
        }
        key = costcache.cache_key([o.target], settings)
        used = (costcache.load_entry("flash_attn", key) or {}).get("used")
        if used not in ("on", "off"):
            self._announce("flash attention on and off for -fa auto", "this model")
            used = faster_flash_attn(self.time_flash_attn(n_ctx, threads))
            costcache.save_entry("flash_attn", key, {"used": used})
        return FlashAttnChoice(asked, used)

    def time_flash_attn(self, n_ctx: int, threads: int) -> dict[str, float]:
        """Seconds of the target's decodes with flash attention "on" and "off", in two
        short-lived contexts (see costmodel.time_decodes)."""
        position = min(FLASH_ATTN_POSITION, n_ctx // 2)
        size = position + max(FLASH_ATTN_BATCHES) + 1
        contexts: dict[str, Context] = {}
        try:
            for setting in ("on", "off"):
                contexts[setting] = Context(self.model, ContextParams(size, threads, setting))
            return time_decodes(contexts, position)
        finally:
            for context in contexts.values():
                context.close()

    def describe(self) -> dict[str, object]:
        """What a run with these models and settings needs to be reproduced."""
        o = self.options
        models = {"target": o.target, "draft": o.draft}
        return {
            "models": {
                role: {"path": str(path), "bytes": path.stat().st_size}
                for role, path in models.items()
                if path
            },
            "n_ctx": self.target.n_ctx,
            "threads": self.target.threads,
            "threads_draft": self.draft_ctx.threads if self.draft_ctx else None,
            "n_batch": o.n_batch,
            "n_ubatch": o.n_ubatch,
            **self._load_settings(),
        }

    def _model_paths(self) -> list[Path]:
        o = self.options
        return [o.target, o.draft] if o.draft else [o.target]

    def _load_settings(self) -> dict[str, object]:
        """How the models were loaded, as far as it changes what a decode costs."""
        o = self.options
        return {
            "gpu_layers": [o.n_gpu_layers, o.n_gpu_layers_draft],
            "devices": [o.device, o.device_draft],
            "repack": self.repack,
        }

    def _cost_settings(self, sizes: set[int]) -> dict[str, object]:
        """What, besides the model files, changes what a decode call costs."""
        return {
            "threads": [self.target.threads, self.draft_ctx.threads if self.draft_ctx else 0],
            "flash_attn": self.flash_attn.used,
            "sizes": sorted(sizes),
            **self._load_settings(),
        }

    def measure_costs(self, sizes: Iterable[int], reps: int = 9, position: int = 64) -> Costs:
        """Measure (again) at `position` tokens into the context; later decoders use these."""
        sizes = set(sizes)
        position = max(1, min(position, self.target.n_ctx - max(sizes) - 1))
        self._costs = measure_costs(self.target, self.draft_ctx, sizes, reps, position)
        return self._costs

    def close(self) -> None:
        for obj in reversed(self._owned):
            obj.close()
        self._owned.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokenize(self, prompt: str | None, chat: ChatOptions | None = None) -> list[int]:
        """The prompt's tokens; with `chat`, wrapped in the target's chat format (the
        prompt may then be None: the conversation is in chat.history)."""
        if chat is not None:
            return self.tokenize_messages(conversation(prompt, chat), chat.template)
        assert prompt is not None
        tokens = self.model.tokenize(prompt)
        if self.translation is not None:  # a translated draft tokenizes the prompt its own way
            self.translation.remember(tokens, self.translation.draft.tokenize(prompt))
        return tokens

    def tokenize_messages(self, messages: list[Message], template: str | None = None) -> list[int]:
        """A conversation's tokens in the target's chat format (`template`, or its own),
        and for a translated draft in the draft's own."""
        tokens = chat_tokens(self.model, render(self.model, messages, template))
        if self.translation is not None:
            draft = self.translation.draft
            self.translation.remember(tokens, own_chat_tokens(draft, messages))
        return tokens

    def pieces(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        stop: tuple[str, ...] = (),
        decoder: Decoder | None = None,
        sampling: SamplingParams | None = None,
    ) -> Iterator[Piece]:
        """Yield one Piece per generated token, saying who proposed it, and a last one
        (token None) for text held back until the end. `sampling`: this generation's
        (None: the options')."""
        stream = TextStream(stop)
        stats.flash_attn = self.flash_attn
        rounds = (decoder or self.decoder).generate(prompt, n_predict, rng, stats, sampling)
        try:
            for new in rounds:
                for i, token in enumerate(new.tokens):
                    text = stream.push(self.model.piece(token))
                    yield Piece(text, token, new.source if i < new.n_drafted else TARGET)
                    if stream.stopped:
                        stats.stop_reason = "stop"
                        return
            yield Piece(stream.flush(), None, TARGET)
        finally:
            rounds.close()


TARGET = "target"  # a Piece's `by` when the target chose the token itself


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it lets out (held-back text of the tokens
    before it included; "" while a character or a possible stop string is incomplete)."""

    text: str
    token: int | None  # None: the end of generation, releasing what was held back
    by: str  # TARGET, or the drafter whose guess the target accepted ("model", "ngram")

    @property
    def drafted(self) -> bool:
        return self.by != TARGET


def batch_warnings(options: EngineOptions) -> list[str]:
    """A round verifies its draft in one decode call of at most -b tokens: the draft
    token plus the one before it. Longer drafts are cut; say so."""
    d, most = options.drafting, options.n_batch - 1
    asked = [("-k", parse_k(d.k) or 0), ("--draft-max", d.draft_max if d.k == "auto" else 0)]
    return [
        f"{flag} {n} is more than one batch can verify; drafts stop at {most} tokens "
        "(raise -b to allow more)"
        for flag, n in asked
        if n > most
    ]


def check_models(target: Path, draft: Path | None) -> compat.CompatReport:
    """Refuse files llama.cpp would choke on, and drafts that cannot pair with the target,
    before loading any weights. The report says whether drafts are translated, and what
    is worth a warning."""
    files = [gguf_meta.read_gguf(path) for path in (target, draft) if path]
    for file in files:
        if file.vocab_only:
            raise UserError(compat.vocab_only_message(file))
    if draft is None:
        return compat.CompatReport()
    report = compat.check_pair(*(compat.facts_of(file) for file in files))
    if not report.ok:
        raise UserError(
            f"{draft.name} cannot draft for {target.name}: {report.problems[0]} "
            "(run `specdec check -m TARGET -d DRAFT` for the full report)"
        )
    return report
