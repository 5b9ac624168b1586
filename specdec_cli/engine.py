"""Models loaded once, ready for any number of generations.

This is where the user's choices become objects: which drafter, which draft length
policy, which sampling settings, and the compatibility check between the two models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specdec_cli import compat, costcache, gguf_meta
from specdec_cli.chat import ChatOptions, prompt_tokens
from specdec_cli.costmodel import Costs, measure_costs
from specdec_cli.decode import Decoder
from specdec_cli.drafters import Drafter, LookupThenModel, ModelDrafter, NgramDrafter
from specdec_cli.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.errors import UserError
from specdec_cli.llama import Context, ContextParams, Model, init_backend, physical_cores
from specdec_cli.sampling import SamplingParams
from specdec_cli.stats import Stats
from specdec_cli.textstream import TextStream

DEFAULT_MAX_CTX = 4096
LOOKUP_MIN_MATCH = 3  # with a draft model too; measured, see benchmarks/README.md


@dataclass(frozen=True)
class DraftOptions:
    """What drafts, and how much. `k` is a number of tokens or "auto"."""

    k: str = "auto"
    draft_min: int = 0
    draft_max: int = 16
    p_min: float = 0.0
    ngram_min: int = 1
    ngram_max: int = 4


@dataclass(frozen=True)
class EngineOptions:
    target: Path
    draft: Path | None = None  # a draft model file
    ngram: bool = False  # n-gram lookup: alone, or tried before the draft model
    n_ctx: int = 0  # 0: the model's training context, capped at DEFAULT_MAX_CTX
    threads: int = 0  # 0: the machine's physical cores
    threads_draft: int = 0  # 0: same as threads
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    n_batch: int = 2048  # llama.cpp's -b: tokens one decode call takes
    n_ubatch: int = 512  # llama.cpp's -ub: tokens one compute graph takes
    flash_attn: str = "off"  # measured faster on CPU here: see README
    verbose: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafting: DraftOptions = field(default_factory=DraftOptions)


def drafter_kind(model: bool, ngram: bool) -> str | None:
    """The drafter for a draft model and/or n-gram lookup: see Engine.make_decoder."""
    if model:
        return "model+ngram" if ngram else "model"
    return "ngram" if ngram else None


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
        self.warnings = check_models(options.target, draft_path)
        self._owned: list[Model | Context] = []
        self.model = self._own(Model(options.target, options.n_gpu_layers))
        n_ctx = options.n_ctx or min(self.model.n_ctx_train, DEFAULT_MAX_CTX)
        threads = options.threads or physical_cores()
        self.target = self._own(
            Context(self.model, ContextParams(n_ctx, threads, options.flash_attn))
        )
        self.draft_ctx: Context | None = None
        self._costs: Costs | None = None
        if draft_path:
            draft_model = self._own(Model(draft_path, options.n_gpu_layers_draft))
            # The draft must be able to hold the same sequence as the target.
            draft_params = ContextParams(
                self.target.n_ctx, options.threads_draft or threads, options.flash_attn
            )
            self.draft_ctx = self._own(Context(draft_model, draft_params))
        self.decoder = self.make_decoder(
            drafter_kind(draft_path is not None, options.ngram), options.drafting.k
        )

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    def make_decoder(self, kind: str | None, k: str) -> Decoder:
        """A decoder drafting with `kind` ("model", "ngram", "model+ngram", or None for
        target-only) and draft length k (a number or "auto"). All decoders share the
        loaded models."""
        d, sampling = self.options.drafting, self.options.sampling
        if kind is None:
            return Decoder(self.target, None, sampling)
        lookup = NgramDrafter(d.ngram_min, d.ngram_max, sampling.greedy)
        if kind == "ngram":
            drafter: Drafter = lookup
        elif self.draft_ctx is None:
            raise UserError("no draft model is loaded; pass one with -d")
        elif kind == "model":
            drafter = ModelDrafter(self.draft_ctx, sampling, self.model.n_vocab)
        else:
            # Next to a draft model, only longer matches are worth more than its guess.
            n_min = max(d.ngram_min, LOOKUP_MIN_MATCH)
            lookup = NgramDrafter(n_min, max(d.ngram_max, n_min), sampling.greedy)
            drafter = LookupThenModel(
                lookup, ModelDrafter(self.draft_ctx, sampling, self.model.n_vocab)
            )
        n = parse_k(k)
        length: DraftLength
        if n is None:
            costs = self.costs()
            if kind == "ngram":  # a lookup costs next to nothing
                costs = replace(costs, draft_over_target=0.0)
            length = AutoLength(
                costs, d.draft_min, d.draft_max, d.p_min, uses_confidence=d.p_min > 0.0
            )
        else:
            length = FixedLength(n, d.p_min)
        return Decoder(self.target, drafter, sampling, length, label=k)

    def costs(self) -> Costs:
        """The draft's and the target's measured costs, for -k auto: measured once per
        models and settings, and kept on disk (see costcache)."""
        if self._costs is None:
            # A batch must fit in the context after the measuring position.
            top = min(self.options.drafting.draft_max + 1, self.target.n_ctx // 2)
            # Every size up to 5, where k mostly settles (their costs are uneven: 2
            # tokens can cost less than 1); beyond, sizes double up to the largest, and
            # those in between are interpolated.
            sizes = {*range(1, min(top, 5) + 1), top}
            sizes |= {2**i + 1 for i in range(top.bit_length()) if 2**i < top}
            key = costcache.cache_key(self._model_paths(), self._cost_settings(sizes))
            self._costs = costcache.load(key)
            if self._costs is None:
                if self.notify:
                    self.notify(
                        "measuring the models' costs for -k auto (once for these models "
                        f"and settings; kept in {costcache.cache_dir()})"
                    )
                costcache.save(key, self.measure_costs(sizes, reps=5))
        return self._costs

    def _model_paths(self) -> list[Path]:
        o = self.options
        return [o.target, o.draft] if o.draft else [o.target]

    def _cost_settings(self, sizes: set[int]) -> dict[str, object]:
        """What, besides the model files, changes what a decode call costs."""
        o = self.options
        return {
            "threads": [self.target.threads, self.draft_ctx.threads if self.draft_ctx else 0],
            "gpu_layers": [o.n_gpu_layers, o.n_gpu_layers_draft],
            "flash_attn": o.flash_attn,
            "sizes": sorted(sizes),
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
            return prompt_tokens(self.model, prompt, chat)
        return self.model.tokenize(prompt)

    def generate(
        self,
        prompt: list[int],
        n_predict: int,
        rng: np.random.Generator,
        stats: Stats,
        stop: tuple[str, ...] = (),
        decoder: Decoder | None = None,
    ) -> Iterator[str]:
        """Yield the generated text in pieces as the tokens are accepted."""
        stream = TextStream(stop)
        rounds = (decoder or self.decoder).generate(prompt, n_predict, rng, stats)
        try:
            for new in rounds:
                for token in new.tokens:
                    text = stream.push(self.model.piece(token))
                    if text:
                        yield text
                    if stream.stopped:
                        stats.stop_reason = "stop"
                        return
            tail = stream.flush()
            if tail:
                yield tail
        finally:
            rounds.close()


def check_models(target: Path, draft: Path | None) -> list[str]:
    """Refuse files llama.cpp would choke on, and drafts that cannot pair with the target,
    before loading any weights. Returns warnings worth showing."""
    files = [gguf_meta.read_gguf(path) for path in (target, draft) if path]
    for file in files:
        if file.vocab_only:
            raise UserError(compat.vocab_only_message(file))
    if draft is None:
        return []
    report = compat.check_pair(*(compat.facts_of(file) for file in files))
    if not report.ok:
        raise UserError(
            f"{draft.name} cannot draft for {target.name}: {report.problems[0]} "
            "(run `specdec check -m TARGET -d DRAFT` for the full report)"
        )
    return list(report.warnings)
