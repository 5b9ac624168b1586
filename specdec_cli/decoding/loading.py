"""Loading: the models, their contexts and slots, on the devices asked for, and what is
measured of them once (flash attention on or off, the costs of a decode call)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, TypeVar

from specdec_cli.decoding.costmodel import (
    FLASH_ATTN_BATCHES,
    Costs,
    load_costs,
    measure_costs,
    median_costs,
    save_costs,
    time_decodes,
)
from specdec_cli.decoding.flashattn import MIN_CALLS, FlashAttnRecord, Timings
from specdec_cli.decoding.heads import drafter_for
from specdec_cli.decoding.multimodal import Encodings
from specdec_cli.decoding.settings import DEFAULT_MAX_CTX, EngineOptions, parse_k, parse_tree
from specdec_cli.decoding.stats import FlashAttnChoice
from specdec_cli.decoding.translate import Translation
from specdec_cli.decoding.treeshape import MAX_WIDTH
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import backend, costcache, heads, rpc
from specdec_cli.llamacpp.heads import DFlashHead, HeadContext
from specdec_cli.llamacpp.hiddenstates import HiddenStates, record_hidden_states
from specdec_cli.llamacpp.llama import LLAMA_MAX_SEQ, Context, ContextParams
from specdec_cli.llamacpp.machine import physical_cores
from specdec_cli.llamacpp.model import Model, ModelParams, init_backend
from specdec_cli.llamacpp.mtmd import Projector
from specdec_cli.llamacpp.probe import choose_repack
from specdec_cli.models import compat, gguf_meta
from specdec_cli.models.gguf_meta import GGUFFile
from specdec_cli.models.heads import (
    ASSISTANT,
    DFLASH,
    EAGLE3,
    HEAD_FILES,
    LAYER_READERS,
    dflash_block_size,
    head_file_problem,
    head_problem,
    is_mtp_sidecar,
    sidecar_problem,
    target_layers,
)
from specdec_cli.models.mmproj import check_projector, read_projector

# A translated draft's context holds this many times the target's: the same text can
# take it more tokens (a 32k vocabulary's against a 262k one's); past that, no drafts.
TRANSLATED_ROOM = 2
Loaded = TypeVar("Loaded", bound="LoadedModels")
# The context of each head file, by its architecture (an MTP sidecar's: see mtp_head).
HEAD_OF_ARCHITECTURE: dict[str, type[HeadContext]] = {
    EAGLE3: heads.Eagle3Head,
    DFLASH: heads.DFlashHead,
    ASSISTANT: heads.AssistantHead,
}


def cost_sizes(top: int) -> set[int]:
    """The batch sizes -k auto's costs are measured at, up to `top`, the widest round
    (every slot's together): each size up to 5, where k mostly settles (their costs are
    uneven: 2 tokens can cost less than 1); beyond, sizes that double, and `top` itself.
    Those in between are interpolated. A doubling size in the last quarter below `top`
    is left out: it costs nearly what `top` does, and the largest batches are most of
    the measurement's time (with four slots, 129 tokens beside 132)."""
    ladder = {2**i + 1 for i in range(top.bit_length()) if 4 * (2**i + 1) <= 3 * top}
    return {*range(1, min(top, 5) + 1), *ladder, top}


def model_params(
    n_gpu_layers: int | None, device: str | None, flag: str, repack: bool, local: bool = False
) -> ModelParams:
    """What llama.cpp is told to load a model with; None leaves llama.cpp's default.
    `local`: with no device named, this machine's GPUs only (no RPC worker's)."""
    devices = None
    if device is not None:
        devices = tuple(backend.pick_devices(device, backend.gpu_devices(), flag))
    elif local:
        devices = tuple(d.handle for d in backend.gpu_devices() if not rpc.is_remote(d))
    layers = ModelParams.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
    return ModelParams(layers, devices, repack)


class Placement(NamedTuple):
    """Where a model runs: its device (None: every GPU), the flag that named it, and
    whether only this machine's GPUs may hold it (no RPC worker's)."""

    device: str | None
    flag: str
    local: bool = False

    @property
    def key(self) -> str | None:
        """How the measurements' cache names the place."""
        return "local" if self.local else self.device


def _draft_placement(options: EngineOptions) -> Placement:
    """The draft's -devd, or else -dev as llama.cpp does. With --rpc and no -devd, the
    draft stays on this machine: drafting pays its latency token by token."""
    if options.device_draft is not None:
        return Placement(options.device_draft, "-devd")
    if options.rpc:
        return Placement(None, "-devd", local=True)
    return Placement(options.device, "-dev")


def _draft_params(options: EngineOptions, repack: bool) -> ModelParams:
    device, flag, local = _draft_placement(options)
    return model_params(options.n_gpu_layers_draft, device, flag, repack, local)


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


class LoadedModels:
    """The target and draft models, their contexts and slots, and what was measured of
    them (flash attention, the costs -k auto prices drafts with)."""

    def __init__(self, options: EngineOptions, notify: Callable[[str], None] | None = None) -> None:
        """`notify` hears of slow one-time work (measuring costs), for the user."""
        self.options = options
        self.notify = notify
        draft_path = options.draft
        init_backend(options.verbose)
        # The workers' devices, before any device is chosen: -dev may name them.
        self.workers = rpc.add_workers(options.rpc) if options.rpc else []
        # A -d file that is a head (EAGLE-3, DFlash, an assistant, an MTP sidecar), not a
        # model of its own. Each header read once: a large vocabulary's takes a fifth of a second.
        target_file = gguf_meta.read_gguf(options.target)
        draft_file = gguf_meta.read_gguf(draft_path) if draft_path else None
        head_class = head_of_file(target_file, draft_file)
        pairing = check_models(target_file, None if head_class else draft_file)
        check_slots(options)
        if options.mmproj:  # a projector for another model, refused before anything loads
            check_projector(read_projector(options.mmproj), target_file)
        if options.mmproj_draft:
            check_draft_projector(options, None if head_class else draft_file, pairing)
        self.warnings = pairing.warnings + batch_warnings(options)
        self.repack, repack_note = choose_repack(options.repack)
        offload_note = offload_warning(options, backend.supports_gpu_offload())
        self.warnings += [note for note in (repack_note, offload_note) if note]
        # Both checked (device names) before the first, maybe long, load.
        repack = self.repack
        target_params = model_params(options.n_gpu_layers, options.device, "-dev", repack)
        # An MTP sidecar's blocks load as the target's own would.
        sidecar = head_class is not None and draft_file is not None and is_mtp_sidecar(draft_file)
        uses_head = head_class is None and wants_head(options, target_file)
        if uses_head:
            head_class = mtp_head(target_file)
        target_params = replace(target_params, load_mtp=uses_head)
        draft_params = replace(_draft_params(options, repack), load_mtp=sidecar)
        self._owned: list[Model | Context | HeadContext | Projector] = []
        self._flash_attn_records: dict[Path, FlashAttnRecord] = {}  # by model, for -fa auto
        self.model = self._own(Model(options.target, target_params))
        parallel = options.parallel
        n_ctx = options.n_ctx or min(self.model.n_ctx_train, DEFAULT_MAX_CTX) * parallel
        threads = options.threads or physical_cores()
        loaded = self._own(Model(draft_path, draft_params)) if draft_path else None
        draft_model, head_model = (None, loaded) if head_class else (loaded, None)
        chains_only = head_class.chains_only(head_model or self.model) if head_class else None
        self.tree_nodes = self._tree_nodes(draft_model, n_ctx, chains_only)
        # Before the contexts: their flash attention setting is fixed when they are made.
        self.flash_attn = self._choose_flash_attn(
            self.model, n_ctx, threads, options.n_gpu_layers, options.device
        )
        # A tree's leaves are the target's sequences; the draft needs one per node it
        # extends (see treegrowth.TreeGrowth). Each slot has as many of its own.
        target_seqs = self.tree_nodes + 1 if self.tree_nodes else 1
        draft_seqs = min(LLAMA_MAX_SEQ // parallel, MAX_WIDTH * self._longest_draft() + 1)
        target_params = self._context_params(
            n_ctx,
            threads,
            self.flash_attn.used,
            n_rs_seq=self._longest_draft(),
            n_seq_max=target_seqs * parallel,
        )
        self.target = self._own(Context(self.model, target_params))
        # A drafting head (the target's own MTP blocks, or a head file).
        self.head: HeadContext | None = None
        if head_class:
            head_seqs = draft_seqs if self.tree_nodes else 1
            self.head = self._own(self._open_head(head_class, head_model, draft_file, head_seqs))
        self.draft_ctx: Context | None = None
        self.draft_flash_attn: str | None = None  # the draft's own choice (see below)
        # What -k auto prices with: the median of the measurements kept, and the first.
        self._prices: tuple[Costs, Costs] | None = None
        if draft_model:
            # The draft must be able to hold the same sequence as the target.
            draft_n_ctx = self.target.n_ctx * (TRANSLATED_ROOM if pairing.translated else 1)
            draft_threads = options.threads_draft or threads
            # Its own choice: a small model's heads can turn it the other way.
            self.draft_flash_attn = self._choose_flash_attn(
                draft_model,
                draft_n_ctx,
                draft_threads,
                options.n_gpu_layers_draft,
                _draft_placement(options).key,
            ).used
            context_params = self._context_params(
                draft_n_ctx,
                draft_threads,
                self.draft_flash_attn,
                n_seq_max=(draft_seqs if self.tree_nodes else 1) * parallel,
            )
            self.draft_ctx = self._own(Context(draft_model, context_params))
        # The slots: one generation each, all verified in one decode call (see decode.step).
        self.slots = self.target.split(parallel)
        self.draft_slots: list[Context | None] = (
            list(self.draft_ctx.split(parallel)) if self.draft_ctx else [None] * parallel
        )
        # Each slot's head, and the target's states it reads (recorded from the target's
        # first decode on): its final hidden states, or the layer inputs EAGLE-3 names.
        layers: list[int] = []  # the target's final states, unless a head file reads its layers
        if draft_file is not None and draft_file.architecture in LAYER_READERS:
            layers = target_layers(draft_file)
        self.head_slots: list[tuple[HeadContext, HiddenStates]] = (
            [
                (head, record_hidden_states(slot, layers))
                for head, slot in zip(self.head.split(parallel), self.slots, strict=True)
            ]
            if self.head
            else []
        )
        # A draft of another vocabulary: its prompts, and the texts both vocabularies share.
        self.translation: Translation | None = None
        if draft_model and pairing.translated:
            self._translate_drafts(draft_model, pairing.differences[0])
        # Images or audio: the projector, and the media it has encoded (see multimodal.py).
        self.encodings: Encodings | None = None
        if options.mmproj:
            use_gpu = backend.supports_gpu_offload() and options.n_gpu_layers != 0
            projector = Projector(
                options.mmproj, self.model, threads, use_gpu, options.flash_attn, options.verbose
            )
            self.encodings = Encodings(self._own(projector))
        # The draft model's own projector (checked above: a draft model of the same text).
        self.draft_encodings: Encodings | None = None
        if options.mmproj_draft and self.draft_ctx is not None:
            use_gpu = backend.supports_gpu_offload() and options.n_gpu_layers_draft != 0
            projector = Projector(
                options.mmproj_draft,
                self.draft_ctx.model,
                self.draft_ctx.threads,
                use_gpu,
                options.flash_attn,
                options.verbose,
            )
            self.draft_encodings = Encodings(self._own(projector))

    def _open_head(
        self,
        head_class: type[HeadContext],
        model: Model | None,
        file: GGUFFile | None,
        seqs_per_slot: int,
    ) -> HeadContext:
        """The drafting head's context, one for every slot, as the draft model's: of the
        target's own MTP blocks (`model` None), or of a head file. A DFlash file's block
        size comes from its header (models/heads.py reads it)."""
        parallel = self.options.parallel
        if head_class is DFlashHead:
            assert model is not None and file is not None
            return DFlashHead(self.target, parallel, model, dflash_block_size(file))
        return head_class(self.target, parallel, model, seqs_per_slot)

    @property
    def head_kind(self) -> str | None:
        """The drafter kind of the drafting head ("mtp", "eagle3", ...; None: no head)."""
        return drafter_for(self.head).name if self.head else None

    def _translate_drafts(self, draft_model: Model, why: str) -> None:
        self.translation = Translation(self.model, draft_model)
        self.warnings.append(
            f"{draft_model.path.name} has another vocabulary than {self.model.path.name} "
            f"({why}): its drafts are translated, by their text when greedy, among the "
            f"{self.translation.shared.n_shared} token texts both share when sampling"
        )

    def _context_params(
        self,
        n_ctx: int,
        threads: int,
        flash_attn: str,
        n_rs_seq: int = 0,
        n_seq_max: int = 1,
    ) -> ContextParams:
        o = self.options
        return ContextParams(n_ctx, threads, flash_attn, o.n_batch, o.n_ubatch, n_rs_seq, n_seq_max)

    def _tree_nodes(self, draft_model: Model | None, n_ctx: int, chains_only: str | None) -> int:
        """The most tokens a draft tree may hold (0: chains only). A tree verifies in one
        decode call, and a context holds at most a batch's worth of sequences (one per
        leaf, and the accepted one). A recurrent model keeps one state per sequence, not
        per branch: it drafts and verifies chains. A drafting head grows trees as a draft
        model does, but for those that draft chains only (`chains_only` says why)."""
        tree = self.options.drafting.tree
        nodes = parse_tree(tree) or 0
        if nodes and chains_only:
            if tree != "auto":
                raise UserError(f"--tree {tree}: {chains_only}; use --tree off")
            return 0
        recurrent = [m.path.name for m in (self.model, draft_model) if m and m.recurrent]
        if nodes and recurrent:
            if tree != "auto":  # auto: trees where they pay, and they cannot here
                raise UserError(
                    f"--tree {tree}: {recurrent[0]} is recurrent and cannot verify or draft "
                    "a tree (its state is one per sequence); use --tree off"
                )
            return 0
        parallel = self.options.parallel
        nodes = min(nodes, self.options.n_batch // parallel - 1, n_ctx // parallel - 1)
        nodes = min(nodes, LLAMA_MAX_SEQ // parallel - 1)  # a sequence per leaf, per slot
        return nodes if nodes >= 2 else 0

    def _longest_draft(self) -> int:
        """The most draft tokens one round can verify, within one decode call."""
        d = self.options.drafting
        n = parse_k(d.k) or d.draft_max
        return max(0, min(n, self.options.n_batch - 1))

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    def costs(self) -> Costs:
        """The draft's and the target's measured costs, for -k auto: the median of the
        measurements kept on disk for these models and settings, after this run adds
        one if there are fewer than costcache.MEASUREMENTS (see costcache)."""
        return self._measured()[0]

    def first_costs(self) -> Costs:
        """The first of those measurements, the same in every run: what a
        rejection-sampled generation prices with (see AutoLength)."""
        return self._measured()[1]

    def _measured(self) -> tuple[Costs, Costs]:
        if self._prices is None:
            # A batch must fit in the context after the measuring position.
            # With slots, a batch holds every slot's round.
            widest = max(self.options.drafting.draft_max, self.tree_nodes)
            top = min((widest + 1) * self.options.parallel, self.target.n_ctx // 2)
            sizes = cost_sizes(top)
            key = costcache.cache_key(self._model_paths(), self._cost_settings(sizes))
            measured = load_costs(key)
            if len(measured) < costcache.MEASUREMENTS:
                times = f"{len(measured) + 1} of {costcache.MEASUREMENTS}, one a run,"
                self._announce("the models' costs for -k auto", "these models", times)
                measured.append(self.measure_costs(sizes, reps=5))
                save_costs(key, measured)
            self._prices = median_costs(measured), measured[0]
        return self._prices

    def _announce(self, what: str, scope: str, times: str = "once") -> None:
        """Tell the user why this run pauses: work done `times`, kept in the cache."""
        if self.notify:
            self.notify(
                f"measuring {what} ({times} for {scope} and settings; "
                f"kept in {costcache.cache_dir()})"
            )

    def _choose_flash_attn(
        self, model: Model, n_ctx: int, threads: int, gpu_layers: int | None, device: str | None
    ) -> FlashAttnChoice:
        """-fa as given, or for "auto" whichever of on and off runs `model` (the target,
        or the draft) faster on this machine, from what was measured and what runs spent
        (see flashattn.py). `device`: where it runs (see Placement.key)."""
        asked = self.options.flash_attn
        if asked != "auto":
            return FlashAttnChoice(asked, asked)
        o = self.options
        settings = {
            "measure": "flash_attn",
            "threads": threads,
            "gpu_layers": gpu_layers,
            "device": device,
            "repack": self.repack,
            "slots": o.parallel,
        }
        key = costcache.cache_key([model.path], settings)
        record = FlashAttnRecord.load(key, deepest=n_ctx // o.parallel // 2)

        def measure(depth: int) -> Timings:
            done = len(record.measured_at(depth))
            times = f"{done + 1} of {costcache.MEASUREMENTS}, one a run, {depth} tokens deep,"
            self._announce("flash attention on and off for -fa auto", model.path.name, times)
            return self.time_flash_attn(model, n_ctx, threads, depth)

        used = record.choose(measure, check_runs=o.parallel == 1)  # slots' calls vary too much
        self._flash_attn_records[model.path] = record
        return FlashAttnChoice(asked, used, record.switched_from)

    def time_flash_attn(self, model: Model, n_ctx: int, threads: int, depth: int) -> Timings:
        """Seconds of `model`'s decodes with flash attention "on" and "off", each slot
        `depth` tokens deep, in two short-lived contexts of as many slots as the engine's
        (see costmodel.time_decodes). With slots, each token's attention spans every
        slot's cells: off computes them all (masked), on skips the other slots', so the
        slots a server will run must be in the cache that is timed."""
        parallel = self.options.parallel
        size = (depth + max(FLASH_ATTN_BATCHES) + 1) * parallel
        contexts: dict[str, Context] = {}
        try:
            for setting in ("on", "off"):
                params = ContextParams(size, threads, setting, n_seq_max=parallel)
                contexts[setting] = Context(model, params)
            slots = {setting: ctx.split(parallel) for setting, ctx in contexts.items()}
            return time_decodes(slots, depth)
        finally:
            for context in contexts.values():
                context.close()

    def _record_flash_attn_spend(self) -> None:
        """What each -fa auto model's context spent a verification-sized call in this
        run, and how deep it went: the evidence later runs' choices are checked by."""
        contexts = [self.target, self.draft_ctx]
        parallel = self.options.parallel
        for ctx in (c for c in contexts if c is not None):
            record = self._flash_attn_records.get(ctx.model.path)
            calls, tokens, seconds, deepest = ctx.spend()
            if record is not None and calls >= MIN_CALLS:
                size = tokens / calls / parallel
                record.add_run(deepest, ctx.flash_attn, seconds / calls, size)

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
            # A split target costs the network's round trips: keyed by where it runs.
            "rpc": [[d.description, d.total_bytes] for d in self.workers],
        }

    def _cost_settings(self, sizes: set[int]) -> dict[str, object]:
        """What, besides the model files, changes what a decode call costs."""
        return {
            "threads": [self.target.threads, self.draft_ctx.threads if self.draft_ctx else 0],
            "flash_attn": [self.flash_attn.used, self.draft_flash_attn],
            "head": self.head_kind,
            "sizes": sorted(sizes),
            **self._load_settings(),
        }

    def measure_costs(self, sizes: Iterable[int], reps: int = 9, position: int = 64) -> Costs:
        """Measure (again) at `position` tokens into the context; later decoders use these."""
        sizes = set(sizes)
        position = max(1, min(position, self.target.n_ctx - max(sizes) - 1))
        draft = self.draft_ctx or self.head
        costs = measure_costs(self.target, draft, sizes, reps, position)  # type: ignore[arg-type]
        self._prices = costs, costs
        return costs

    def close(self) -> None:
        if self._owned:
            self._record_flash_attn_spend()
        for obj in reversed(self._owned):
            obj.close()
        self._owned.clear()

    def __enter__(self: Loaded) -> Loaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_draft_projector(
    options: EngineOptions, draft: GGUFFile | None, pairing: compat.CompatReport
) -> None:
    """--mmproj-draft is refused in one line, before anything loads, where the draft
    could not read what it makes: beside no draft model (a head reads the target's
    states), without the target's own projector, for a draft of another vocabulary
    (which reads the text, translated), or made for another model."""
    assert options.mmproj_draft is not None
    if draft is None:
        raise UserError(
            "--mmproj-draft is a draft model's projector: pass the draft model with -d "
            "(a drafting head reads the target's states over an image, not a projector's)"
        )
    if options.mmproj is None:
        raise UserError("--mmproj-draft needs the target's own projector too: add --mmproj")
    if pairing.translated:
        raise UserError(
            f"--mmproj-draft: {draft.path.name} has another vocabulary than the target, and "
            "its drafts are translated from the text; drop --mmproj-draft"
        )
    check_projector(read_projector(options.mmproj_draft), draft)


def check_slots(options: EngineOptions) -> None:
    """Every slot takes a row of each decode call (llama.cpp keeps a sequence a slot, and
    no more sequences than a batch has rows): more slots than -b are refused."""
    parallel, n_batch = options.parallel, options.n_batch
    if parallel > n_batch:
        raise UserError(
            f"-np {parallel} is more slots than -b {n_batch} has rows (each slot takes a "
            f"row of every decode call); raise -b to {parallel} or more"
        )


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


def head_of_file(target: GGUFFile, draft: GGUFFile | None) -> type[HeadContext] | None:
    """Where the -d file is a head, not a model of its own, its context: an EAGLE-3 or
    DFlash file's (drafting through the target's layer inputs), a Gemma 4 assistant's
    (reading the target's cache), or an MTP sidecar's (the block alone), checked against
    the target in one line. None otherwise."""
    if draft is None:
        return None
    if draft.architecture in HEAD_FILES:
        head, problem = HEAD_OF_ARCHITECTURE[draft.architecture], head_file_problem(target, draft)
    elif is_mtp_sidecar(draft):
        head, problem = mtp_head(draft), sidecar_problem(target, draft)
    else:
        return None
    if problem:
        raise UserError(f"{draft.path.name} cannot draft for {target.path.name}: {problem}")
    return head


def mtp_head(file: GGUFFile) -> type[HeadContext]:
    """The context of a model's MTP blocks (or of a sidecar's): chained where it has
    several, one a draft step."""
    return heads.ChainedMtpHead if file.n_nextn > 1 else heads.MtpHead


def wants_head(options: EngineOptions, target: GGUFFile) -> bool:
    """Whether the target's MTP head drafts: where -d mtp asks (refused in one line where
    it cannot), or by default where the target has one (see EngineOptions.head)."""
    if options.head is False:
        return False
    problem = head_problem(target)
    if options.head and problem:
        raise UserError(f"-d mtp: {problem}; draft with -d ngram or a draft model instead")
    return problem is None


def check_models(target: GGUFFile, draft: GGUFFile | None) -> compat.CompatReport:
    """Refuse files llama.cpp would choke on, and drafts that cannot pair with the target,
    before loading any weights. The report says whether drafts are translated, and what
    is worth a warning."""
    files = [file for file in (target, draft) if file]
    for file in files:
        if file.vocab_only:
            raise UserError(compat.vocab_only_message(file))
    if draft is None:
        return compat.CompatReport()
    report = compat.check_pair(*(compat.facts_of(file) for file in files))
    if not report.ok:
        raise UserError(
            f"{draft.path.name} cannot draft for {target.path.name}: {report.problems[0]} "
            "(run `specdec check -m TARGET -d DRAFT` for the full report)"
        )
    return report
