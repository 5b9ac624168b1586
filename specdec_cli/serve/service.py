"""The engine behind `specdec serve`: generations in slots (--parallel), all advanced by
one decode loop in one worker thread (every llama.cpp call happens there, loading
included; see decoding.scheduler), with a bounded number of requests waiting for a slot.
The event loop only parses, tokenizes (in a helper thread) and queues; each generation
hands its pieces back to it as events. Prefix reuse: a request goes to the free slot
whose cache holds the longest start of its prompt, and keeps that start
(Context.reuse)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.grammar import Grammar, lark_literal
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.pieces import Piece, PieceStream
from specdec_cli.decoding.promptcache import PromptCache
from specdec_cli.decoding.scheduler import Scheduler, Task
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import rpc
from specdec_cli.llamacpp.media import Media, not_taken
from specdec_cli.messages import note, warn
from specdec_cli.models.chat import ChatFormat, Message, runs_jinja
from specdec_cli.serve.api import (
    ApiError,
    GenerationRequest,
    ServeOptions,
    Speculation,
)
from specdec_cli.serve.metrics import Metrics
from specdec_cli.serve.reasoning import END, START, ThinkingSplitter, opens_thinking
from specdec_cli.serve.reply import ReplyParser
from specdec_cli.serve.restart import restart_on, restarted
from specdec_cli.serve.toolcalls import (
    MARKER_TEXTS,
    THOUGHTS_OPEN,
    THOUGHTS_OPTIONAL,
    ToolCallParser,
    call_grammar,
    format_for,
)

# The chat format for a model without a template of its own, as llama-server falls back.
FALLBACK_CHAT_TEMPLATE = "chatml"
# After a lost RPC worker: how often to ask whether it is back, and how long the event
# loop gets to send the 503s before the process starts over.
WORKER_POLL_SECONDS = 1.0
FLUSH_SECONDS = 0.5


@dataclass(frozen=True)
class Chunk:
    """Text for the client, with the generation's running figures."""

    piece: Piece
    drafted: int
    accepted: int
    tokens: int


@dataclass(frozen=True)
class Finished:
    stats: Stats


@dataclass(frozen=True)
class Failed:
    error: Exception
    stats: Stats


Event = Chunk | Finished | Failed


@dataclass
class Job:
    """A queued generation, and the channel its events come back on."""

    request: GenerationRequest
    prompt: MediaPrompt  # closed once the job is done
    seed: int
    loop: asyncio.AbstractEventLoop
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # A chat reply's thinking, answer and tool calls, parted (None: the text as it is),
    # and the control tokens whose text that needs (see PieceStream)
    reply: ReplyParser | None = None
    shown: frozenset[int] = frozenset()
    # Events from the worker not yet handed over. A round's tokens come microseconds
    # apart: waking the event loop once for all of them, not once each, keeps its
    # thread from taking the GIL from the decode loop over and over.
    _pending: deque[Event] = field(default_factory=deque)
    _wake_scheduled: bool = False

    def emit(self, event: Event) -> None:
        """From the worker thread: hand an event to the event loop."""
        self._pending.append(event)
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    def _hand_over(self) -> None:
        """On the event loop: move what the worker emitted into the queue."""
        self._wake_scheduled = False
        while self._pending:
            self.events.put_nowait(self._pending.popleft())


class Service:
    """The engine behind the API: loaded once, then its slots, each running one
    generation, all advanced together by one decode loop in the worker thread."""

    def __init__(self, engine_options: EngineOptions, options: ServeOptions) -> None:
        self.engine_options = engine_options
        self.options = options
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.model_name = options.alias or engine_options.target.name
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="specdec-decode")
        self.admitted = 0  # generations waiting or running
        self.waiting: deque[Job] = deque()  # admitted, not yet in a slot
        self.wake = threading.Condition()  # a job came, or the server stops
        self.stopping = threading.Event()  # shutting down: generations end now
        self.metrics = Metrics()
        self._decoders: dict[tuple[Speculation, int], Decoder] = {}
        self._marker_tokens: dict[str, list[int]] = {}  # see _marker_token
        self.chat_format = options.chat
        # Why requests get 503 while there is no engine (loading, or a worker away).
        self.unavailable = "the model is loading"
        self.listening: socket.socket | None = None  # what a restart keeps (see worker_lost)

    # In the worker thread.

    def load(self) -> Engine:
        """Load the models, and measure their costs now if -k auto could need them, so that
        no request ever waits for a measurement. After a worker was lost (`restarted`),
        wait for every worker first."""
        if restarted():
            self._wait_for_workers()
        engine = Engine(self.engine_options, notify=note)
        for message in engine.warnings:
            warn(message)
        if self.chat_format.template is None and engine.model.chat_template() is None:
            # Chat clients (Open WebUI) use nothing but the chat endpoint.
            self.chat_format = replace(self.chat_format, template=FALLBACK_CHAT_TEMPLATE)
            warn(
                f"{engine.model.path.name} has no chat template: chat requests are formatted "
                f"as {FALLBACK_CHAT_TEMPLATE}, as llama-server does; name its format with "
                "--chat-template (e.g. gemma, llama3)"
            )
        if engine.decoder.drafter is not None:
            engine.costs()
        cache_mib = self.options.cache_ram
        cache = PromptCache(cache_mib * 2**20, note) if cache_mib > 0 else None
        self.scheduler = Scheduler(engine.slots, self.engine_options.n_ubatch, cache)
        return engine

    def _wait_for_workers(self) -> None:
        endpoints = self.engine_options.rpc
        while not self.stopping.is_set():
            try:
                for endpoint in endpoints:
                    rpc.check_worker(endpoint)
                note(f"RPC workers {', '.join(endpoints)} answer: loading the models again")
                return
            except UserError as err:
                self.unavailable = str(err)
                self.stopping.wait(WORKER_POLL_SECONDS)

    def worker_lost(self, line: str) -> None:
        """A worker went away mid-decode (on ggml's thread, which must not return: see
        rpc.guard). Every request in flight ends with 503, and the process starts over on
        the same listening socket: it answers 503 until the workers are back."""
        warn(f"{line}; the server answers 503 until it is back")
        self.unavailable = line
        self.engine = None  # new requests: 503 from now on
        error = ApiError.retry_later(line, "worker_lost")
        if self.scheduler is not None:
            for slot in self.scheduler.busy:
                assert slot.task is not None
                slot.task.done(Stats(stop_reason="worker lost"), error)
        with self.wake:
            while self.waiting:
                self._done(self.waiting.popleft(), Stats(stop_reason="worker lost"), error)
        time.sleep(FLUSH_SECONDS)  # for the event loop to send those answers
        if self.listening is None:
            rpc.exit_with(line)
        restart_on(self.listening)

    def loop(self) -> None:
        """The decode loop: place waiting jobs in free slots, advance every busy slot by
        one round, until the server stops."""
        scheduler = self.scheduler
        assert scheduler is not None
        while True:
            with self.wake:
                while not (self.waiting or scheduler.busy or self.stopping.is_set()):
                    self.wake.wait()
            if self.stopping.is_set():
                scheduler.stop_all()
                self._cancel_waiting()
                return
            self._place_waiting(scheduler)
            scheduler.step()

    def _place_waiting(self, scheduler: Scheduler) -> None:
        """Waiting jobs into free slots, first come first served; each to the slot whose
        cache holds most of its prompt."""
        while self.waiting:
            job = self.waiting[0]
            if job.cancelled.is_set():  # its client left while it waited
                self._done(self.waiting.popleft(), Stats(stop_reason="cancelled"), None)
                continue
            slot = scheduler.claim(job.prompt.tokens)
            if slot is None:
                return
            self.waiting.popleft()
            try:
                scheduler.start(slot, self._task(job, slot.index))
            except Exception as err:  # one bad generation must not end the server
                self._done(job, Stats(), err)

    def _task(self, job: Job, slot: int) -> Task:
        assert self.engine is not None
        request, stats = job.request, Stats(flash_attn=self.engine.flash_attn)
        decoder = self._decoder(request.speculation, slot)
        rng = np.random.default_rng(job.seed)
        generation = decoder.start(
            job.prompt.tokens,
            request.max_tokens,
            rng,
            stats,
            request.sampling,
            request.logprobs,
            request.grammar,
            job.prompt.media,
        )

        def emit(piece: Piece) -> None:
            if piece.text or piece.logprobs:
                job.emit(Chunk(piece, stats.drafted, stats.accepted, stats.tokens))

        return Task(
            generation,
            PieceStream(self.engine.model, request.stop, job.shown),
            emit,
            lambda stats, error: self._done(job, stats, error),
            lambda: job.cancelled.is_set() or self.stopping.is_set(),
            job.id,
        )

    def _done(self, job: Job, stats: Stats, error: Exception | None) -> None:
        job.prompt.close()
        job.emit(Finished(stats) if error is None else Failed(error, stats))
        with suppress(RuntimeError):  # a closed event loop: the server has stopped
            job.loop.call_soon_threadsafe(self._finished, stats)

    def _cancel_waiting(self) -> None:
        while self.waiting:
            self._done(self.waiting.popleft(), Stats(stop_reason="cancelled"), None)

    def _decoder(self, speculation: Speculation, slot: int) -> Decoder:
        """The decoder a request asks for in a slot, made once and kept."""
        assert self.engine is not None
        default = self.engine.decoders[slot]
        if speculation == Speculation():
            return default
        key = (speculation, slot)
        if key not in self._decoders:
            kind = default.drafter.name if speculation.enabled and default.drafter else None
            drafting = self.engine.options.drafting
            self._decoders[key] = self.engine.make_decoder(
                kind, speculation.k or drafting.k, speculation.tree, slot
            )
        return self._decoders[key]

    def check_speculation(self, speculation: Speculation) -> None:
        """A draft length needs a drafter: refuse it before the request is queued."""
        assert self.engine is not None
        asks = speculation.k is not None or speculation.tree not in (None, "off")
        if asks and self.engine.decoder.drafter is None:
            raise ApiError(
                "this server has no drafter (start it with -d DRAFT or -d ngram); "
                'send "speculative": false, or leave it out',
                param="speculative",
            )
        if speculation.tree == "auto" and not self.engine.tree_nodes:
            raise ApiError(
                "this server drafts chains only (its models, or --tree off); "
                'send "tree": "off", or leave it out',
                param="speculative",
            )
        if not self.engine.fits_tree(speculation.tree or "off"):
            raise ApiError(
                f"speculative.tree {speculation.tree} is wider than this server drafts (start "
                f"it with --tree {speculation.tree} or wider)",
                param="speculative",
            )

    def stop(self) -> None:
        """End every generation now, and the decode loop."""
        self.stopping.set()
        with self.wake:
            self.wake.notify()

    # In the event loop.

    def admit(
        self,
        request: GenerationRequest,
        prompt: MediaPrompt,
        reply: ReplyParser | None = None,
        shown: frozenset[int] = frozenset(),
    ) -> Job:
        """Queue a generation, or refuse it (503, Retry-After) when the queue is full. The
        job owns the prompt from here (a refused one is closed)."""
        if self.admitted >= self.engine_options.parallel + self.options.queue:
            prompt.close()
            self.metrics.rejected += 1
            busy = f"the server is busy ({self.admitted} requests in progress or waiting)"
            raise ApiError.retry_later(busy, "server_busy")
        seed = request.seed if request.seed is not None else int(np.random.SeedSequence().entropy)
        loop = asyncio.get_running_loop()
        job = Job(request, prompt, seed % 2**64, loop, reply=reply, shown=shown)
        self.admitted += 1
        with self.wake:
            self.waiting.append(job)
            self.wake.notify()
        return job

    def _finished(self, stats: Stats) -> None:
        """Count a generation in, whether its client stayed to the end or not."""
        self.admitted -= 1
        self.metrics.record(stats)

    def reply_parser(
        self, request: GenerationRequest, prompt: list[int]
    ) -> tuple[ReplyParser, set[int]]:
        """How a chat reply is parted: thinking (unless --reasoning-format none; open
        already where the prompt's template opened it), and tool calls in the format of
        the template, when the request offers tools. And the marker tokens the parts
        need to see in the text."""
        assert self.engine is not None
        model = self.engine.model
        thinking, tools, markers = None, None, []
        if self.options.reasoning_format != "none":
            opened = opens_thinking("".join(map(model.token_text, prompt[-4:])))
            thinking, markers = ThinkingSplitter(opened), [START, END]
        if request.offered_tools():
            kind = format_for(self.template())
            tools = ToolCallParser(kind, request.parallel_tool_calls)
            markers += MARKER_TEXTS[kind]
        return ReplyParser(thinking, tools), {t for m in markers for t in self._marker_token(m)}

    def tool_grammar(self, request: GenerationRequest, prompt: list[int]) -> Grammar | None:
        """tool_choice "required" or a named function, as a grammar: the reply is the
        call(s) in the template's format, each call's arguments its parameters' schema
        (see toolcalls.call_grammar), after the thoughts where the reply thinks first (the
        prompt opened a thinking block, or the template knows one the model may open).
        None where nothing is required (api.parse_request refuses a request that asks
        for both a call and a response_format or grammar)."""
        assert self.engine is not None
        model = self.engine.model
        if request.tool_choice not in ("required", "function"):
            return None
        template = self.template()
        if opens_thinking("".join(map(model.token_text, prompt[-4:]))):
            thinking: str | None = THOUGHTS_OPEN
        else:
            thinking = THOUGHTS_OPTIONAL if END in template else None
        lark = call_grammar(
            format_for(template),
            request.offered_tools(),
            request.parallel_tool_calls,
            lambda text: lark_literal(model, text),
            thinking,
        )
        grammar = Grammar.lark(lark, "tool_calls")
        grammar.check(model)  # UserError: a parameters schema llguidance cannot match
        return grammar

    def template(self) -> str:
        """The chat template requests are formatted with (--chat-template's, else the
        model's own, else the fallback chosen at load)."""
        assert self.engine is not None
        return self.chat_format.template or self.engine.model.chat_template() or ""

    def _marker_token(self, text: str) -> list[int]:
        """The token that is `text` in the target's vocabulary, if one is ([] if it takes
        several); asked once per marker, not per request."""
        if text not in self._marker_tokens:
            assert self.engine is not None
            tokens = self.engine.model.tokenize(text, add_special=False, parse_special=True)
            self._marker_tokens[text] = tokens if len(tokens) == 1 else []
        return self._marker_tokens[text]

    def prompt(self, request: GenerationRequest) -> MediaPrompt:
        """The request's prompt as tokens, and its media, checked against the context (in a
        helper thread: llama.cpp's tokenizer only reads the vocabulary, and libmtmd's only
        prepares the media, as llama-server's HTTP threads do). The caller closes it."""
        prompt = self._prompt(request)
        try:
            self._check_prompt(request, prompt.tokens)
        except ApiError:
            prompt.close()
            raise
        return prompt

    def _prompt(self, request: GenerationRequest) -> MediaPrompt:
        assert self.engine is not None
        if request.messages is not None:
            messages, tools = list(request.messages), request.offered_tools()
            kwargs = self.chat_format.kwargs | request.template_kwargs
            format = replace(self.chat_format, kwargs=kwargs)
            if tools and not runs_jinja(self.template(), format):
                raise ApiError(
                    "this server formats chats in one of llama.cpp's built-in formats, which "
                    "cannot describe tools: send none, or restart it with a Jinja template",
                    param="tools",
                )
            try:
                if request.media:
                    return self._media_prompt(request, messages, format, tools)
                tokens = self.engine.tokenize_messages(messages, format, tools)
            except UserError as err:  # the template failed on these messages, or the media
                raise ApiError(str(err), param="messages") from None
        elif request.tokens is not None:
            tokens = list(request.tokens)
            n_vocab = self.engine.model.n_vocab
            if not all(0 <= t < n_vocab for t in tokens):
                raise ApiError(f"prompt token ids must be from 0 to {n_vocab - 1}", param="prompt")
        else:
            tokens = self.engine.tokenize(request.text or "")
        return MediaPrompt(tokens)

    def _media_prompt(
        self,
        request: GenerationRequest,
        messages: list[Message],
        format: ChatFormat,
        tools: list[dict[str, Any]],
    ) -> MediaPrompt:
        """A chat with images or audio: the media checked against the projector (a 400
        naming the first part it cannot take), then tokenized with the text."""
        assert self.engine is not None
        self._check_media(request.media)
        text = self.engine.chat_text(messages, format, tools)
        return self.engine.media_prompt(text, request.media, request.speculation.enabled)

    def _check_media(self, media: tuple[Media, ...]) -> None:
        assert self.engine is not None
        if self.engine.encodings is None:
            raise ApiError(
                "this server's model takes no images or audio (it was started without --mmproj)",
                param=media[0].name,
            )
        projector = self.engine.encodings.projector
        for item in media:
            refusal = not_taken(item, projector.path.name, projector.vision, projector.audio)
            if refusal:
                raise ApiError(refusal, param=item.name)

    def _check_prompt(self, request: GenerationRequest, tokens: list[int]) -> None:
        assert self.engine is not None
        model = self.engine.model
        if request.grammar is not None:  # what llguidance finds wrong in it
            try:
                request.grammar.check(model)
            except UserError as err:
                raise ApiError(str(err), param=request.grammar_field) from None
        n_ctx = self.engine.slots[0].n_ctx  # each slot's share of -c
        if not tokens:
            raise ApiError("the prompt is empty", param="prompt")
        if len(tokens) >= n_ctx:
            raise ApiError(
                f"the prompt is {len(tokens)} tokens but the context holds {n_ctx}; "
                "shorten it (or restart the server with a larger -c)",
                param="messages" if request.chat else "prompt",
                code="context_length_exceeded",
            )
