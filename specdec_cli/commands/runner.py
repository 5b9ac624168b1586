"""`specdec run`'s generations: the models loaded once, then the text and the stats shown
as asked (streamed, one JSON object, or one JSON line per --prompts line)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np
import typer

from specdec_cli import interrupt
from specdec_cli.commands.display import make_display
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.logprobs import LogprobOptions, TokenLogprob
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.pieces import Piece
from specdec_cli.decoding.settings import EngineOptions, GenerationOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import rpc
from specdec_cli.llamacpp.media import Media
from specdec_cli.messages import note, warn
from specdec_cli.models.chat import ChatOptions


@dataclass(frozen=True)
class Output:
    """How `run` shows its generations."""

    as_json: bool = False
    json_tokens: bool = False
    color: bool = False
    quiet: bool = False
    json_lines: bool = False  # --prompts: one JSON line per prompt
    prompt: bool = False  # --verbose-prompt: the prompt as the model receives it, on stderr
    logprobs: LogprobOptions | None = None  # --logprobs: in each --json-tokens record


def generate(
    options: EngineOptions,
    texts: dict[int, str | None],
    generation: GenerationOptions,
    stop: tuple[str, ...],
    chat: ChatOptions | None,
    output: Output,
    media: Sequence[Media] = (),
) -> None:
    """Load the models and generate from each prompt (keyed by its line number), each
    with `media` (images and audio, checked: see media.py)."""
    with loaded_engine(options, quiet=output.quiet) as engine:
        if output.json_lines:
            _run_many(engine, texts, generation, stop, chat, output, media)
        else:
            _run_one(engine, texts[0], generation, stop, chat, output, media)


@contextmanager
def loaded_engine(options: EngineOptions, quiet: bool = False) -> Iterator[Engine]:
    """The models loaded and their warnings said; a closed stdout then ends quietly, and
    a lost RPC worker in one line."""
    # Say why the first -k auto run pauses (a person, or a log, would wonder).
    with (
        rpc.guard(options.rpc, rpc.exit_with),
        Engine(options, notify=None if quiet else note) as engine,
        ends_quietly_on_closed_pipe(),
    ):
        for message in engine.warnings:
            warn(message)
        yield engine


@contextmanager
def ends_quietly_on_closed_pipe() -> Iterator[None]:
    """`specdec run ... | head`: when the reader goes away, stop without a word, exit 0."""
    try:
        yield
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None


def _run_one(
    engine: Engine,
    text: str | None,
    generation: GenerationOptions,
    stop: tuple[str, ...],
    chat: ChatOptions | None,
    output: Output,
    media: Sequence[Media],
) -> None:
    """One generation: the text as it comes (or held for --json), then the stats."""
    with prompt_of(engine, text, chat, output, media) as prompt:
        _generate_one(engine, prompt, generation, stop, output)


def _generate_one(
    engine: Engine,
    prompt: MediaPrompt,
    generation: GenerationOptions,
    stop: tuple[str, ...],
    output: Output,
) -> None:
    stats = Stats(seed=None if engine.options.sampling.greedy else generation.seed)
    display = make_display(stats, output.as_json, output.quiet, output.color)
    pieces: list[Piece] = []
    rng = np.random.default_rng(generation.seed)

    def finish() -> None:
        display.finish()
        if output.as_json:
            print(json.dumps(_record(engine, pieces, generation.seed, stats, output)))

    try:
        with interrupt.generating(), _ends_on_lost_worker(engine, stats, finish):
            for piece in _pieces(engine, prompt, generation, rng, stats, stop, output):
                pieces.append(piece)
                if piece.text:
                    display.text(piece.text, drafted=piece.drafted)
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    finish()
    if stats.stop_reason == "interrupted":
        raise typer.Exit(interrupt.EXIT_CODE)


def _pieces(
    engine: Engine,
    prompt: MediaPrompt,
    generation: GenerationOptions,
    rng: np.random.Generator,
    stats: Stats,
    stop: tuple[str, ...],
    output: Output,
) -> Iterator[Piece]:
    """The generation's pieces (see Engine.pieces), as run's options ask."""
    return engine.pieces(
        prompt.tokens,
        generation.n_predict,
        rng,
        stats,
        stop,
        logprobs=output.logprobs,
        media=prompt.media,
    )


def _ends_on_lost_worker(
    engine: Engine, stats: Stats, finish: Callable[[], None]
) -> AbstractContextManager[None]:
    """With --rpc: a worker lost mid-generation ends the process with one line naming it,
    after what was generated so far is shown (`finish`)."""

    def lost(line: str) -> None:
        stats.stop_reason = "worker lost"
        finish()
        rpc.exit_with(line)

    return rpc.guard(engine.options.rpc, lost)


def _run_many(
    engine: Engine,
    texts: dict[int, str | None],
    generation: GenerationOptions,
    stop: tuple[str, ...],
    chat: ChatOptions | None,
    output: Output,
    media: Sequence[Media],
) -> None:
    """One JSON line per prompt, each with a seed of its own derived from --seed."""
    for line, text in texts.items():
        with prompt_of(engine, text, chat, output, media) as prompt:
            _generate_line(engine, line, text, prompt, generation, stop, output)


def _generate_line(
    engine: Engine,
    line: int,
    text: str | None,
    prompt: MediaPrompt,
    generation: GenerationOptions,
    stop: tuple[str, ...],
    output: Output,
) -> None:
    """A --prompts line's generation, and its JSON line."""
    seed = line_seed(generation.seed, line)
    stats, pieces = Stats(), []

    def finish() -> None:
        record = _record(engine, pieces, seed, stats, output)
        print(json.dumps({"index": line, "prompt": text} | record), flush=True)

    rng = np.random.default_rng(seed)
    try:
        with interrupt.generating(), _ends_on_lost_worker(engine, stats, finish):
            for piece in _pieces(engine, prompt, generation, rng, stats, stop, output):
                pieces.append(piece)  # one by one: a lost worker shows what came
    except KeyboardInterrupt:
        raise typer.Exit(interrupt.EXIT_CODE) from None
    finish()


@contextmanager
def prompt_of(
    engine: Engine,
    text: str | None,
    chat: ChatOptions | None,
    output: Output,
    media: Sequence[Media],
) -> Iterator[MediaPrompt]:
    """The prompt with its media (see Engine.prompt), checked (and shown, with
    --verbose-prompt) before a first -k auto run's measuring: bad input is told at once,
    not after the wait."""
    with engine.prompt(text, chat, media) as prompt:
        if output.prompt:
            show_prompt(engine, prompt.tokens)
        engine.check_prompt(prompt.tokens)
        yield prompt


def show_prompt(engine: Engine, tokens: list[int]) -> None:
    """--verbose-prompt: the prompt's text as the model receives it, special tokens
    written out, and its token count (llama.cpp's flag)."""
    text = "".join(engine.model.token_text(t) for t in tokens)
    print(f"prompt ({len(tokens)} tokens):\n{text}", file=sys.stderr, flush=True)


def _record(
    engine: Engine, pieces: list[Piece], seed: int, stats: Stats, output: Output
) -> dict[str, object]:
    """One generation in JSON: its text, seed and stats (and each token, with --json-tokens)."""
    record = {"text": "".join(p.text for p in pieces), "seed": seed, **stats.to_dict()}
    if output.json_tokens:
        record["token_list"] = token_records(engine, pieces)
    return record


def token_records(engine: Engine, pieces: list[Piece]) -> list[dict[str, object]]:
    """--json-tokens: each token's id, its own text, and who chose it; with --logprobs,
    its log-probability and the likeliest tokens at its place (none for the tokens of a
    stop string: see Piece.logprobs)."""
    text = engine.model.piece
    records: list[dict[str, object]] = [
        {"id": p.token, "text": text(p.token).decode(errors="replace"), "by": p.by}
        for p in pieces
        if p.token is not None
    ]
    # The pieces let them out in the tokens' order; only a stop string's, at the end, never.
    logprobs = [lp for p in pieces for lp in p.logprobs]
    for record, lp in zip(records, logprobs, strict=False):
        record |= _logprob_record(engine, lp)
    return records


def _logprob_record(engine: Engine, lp: TokenLogprob) -> dict[str, object]:
    def text(token: int) -> str:
        return engine.model.piece(token).decode(errors="replace")

    top = [{"id": t, "text": text(t), "logprob": value} for t, value in lp.top]
    return {"logprob": lp.logprob, "top_logprobs": top}


def logprob_options(top: int | None, post_sampling: bool) -> LogprobOptions | None:
    """--logprobs N and --post-sampling-probs, as a generation takes them."""
    if top is None:
        if post_sampling:
            raise UserError("--post-sampling-probs needs --logprobs N")
        return None
    return LogprobOptions(top, post_sampling)


def line_seed(seed: int, line: int) -> int:
    """The seed of a --prompts line: its own random stream, derived from --seed and the
    line number (so that lines added elsewhere do not change it), and the --seed that
    reruns that line alone with -p."""
    return int(np.random.SeedSequence([seed, line]).generate_state(1)[0])
