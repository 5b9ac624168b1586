"""`specdec serve`: an OpenAI-compatible HTTP server over the engine.

Generations run in slots (--parallel), all advanced by one decode loop in one worker
thread (every llama.cpp call happens there, loading included; see decoding.scheduler),
with a bounded number of requests waiting for a slot. The event loop only parses,
tokenizes (in a helper thread), queues and streams, so a long generation never holds up
/health or another client's 503. Prefix reuse: a request goes to the free slot whose
cache holds the longest start of its prompt, and keeps that start (Context.reuse).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field, replace
from html import escape
from importlib import resources
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from specdec_cli.commands import interrupt
from specdec_cli.commands.display import note, warn
from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.grammar import Grammar, lark_literal
from specdec_cli.decoding.logprobs import TokenLogprob
from specdec_cli.decoding.pieces import Piece, PieceStream
from specdec_cli.decoding.promptcache import PromptCache
from specdec_cli.decoding.scheduler import Counters, Scheduler, Task
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.listening import listen
from specdec_cli.llamacpp import rpc
from specdec_cli.serve.api import (
    ApiError,
    GenerationRequest,
    ServeOptions,
    Speculation,
    parse_body,
    parse_request,
)
from specdec_cli.serve.logprobs import LogprobWriter
from specdec_cli.serve.reasoning import END, START, ThinkingSplitter, opens_thinking
from specdec_cli.serve.reply import Part, ReplyParser
from specdec_cli.serve.toolcalls import MARKER_TEXTS, ToolCallParser, call_grammar, format_for

MAX_BODY_BYTES = 8 * 2**20
RETRY_AFTER_SECONDS = 1
GRACEFUL_SHUTDOWN_SECONDS = 10  # in-flight streams stop within a round; this is a backstop
PUBLIC_PATHS = ("/health", "/")  # no API key: the page holds no data, it asks for the key
# The chat format for a model without a template of its own, as llama-server falls back.
FALLBACK_CHAT_TEMPLATE = "chatml"
# A restart after a lost RPC worker: the listening socket it keeps, and that it waits.
LISTEN_FD_ENV = "SPECDEC_LISTEN_FD"
RESTARTED_ENV = "SPECDEC_RESTARTED"
WORKER_POLL_SECONDS = 1.0
FLUSH_SECONDS = 0.5


# --- generations: in slots, advanced together in the worker thread ----------------------


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
    prompt: list[int]
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
        if os.environ.pop(RESTARTED_ENV, None):
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
        error = ApiError(
            f"{line}; retry",
            status=503,
            kind="server_busy",
            code="worker_lost",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
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
            slot = scheduler.claim(job.prompt)
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
            job.prompt,
            request.max_tokens,
            rng,
            stats,
            request.sampling,
            request.logprobs,
            request.grammar,
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
        prompt: list[int],
        reply: ReplyParser | None = None,
        shown: frozenset[int] = frozenset(),
    ) -> Job:
        """Queue a generation, or refuse it (503, Retry-After) when the queue is full."""
        if self.admitted >= self.engine_options.parallel + self.options.queue:
            self.metrics.rejected += 1
            raise ApiError(
                f"the server is busy ({self.admitted} requests in progress or waiting); retry",
                status=503,
                kind="server_busy",
                code="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
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
            kind = format_for(self.chat_format.template or model.chat_template() or "")
            tools = ToolCallParser(kind, request.parallel_tool_calls)
            markers += MARKER_TEXTS[kind]
        return ReplyParser(thinking, tools), {t for m in markers for t in self._marker_token(m)}

    def tool_grammar(self, request: GenerationRequest, prompt: list[int]) -> Grammar | None:
        """tool_choice "required" or a named function, as a grammar: the reply is the
        call(s) in the template's format, each call's arguments its parameters' schema
        (see toolcalls.call_grammar). None where nothing is required, where the request
        constrains the reply itself, or where the template opened a thinking block (the
        reply begins with thoughts, which no grammar here describes)."""
        assert self.engine is not None
        model = self.engine.model
        if request.tool_choice not in ("required", "function") or request.grammar is not None:
            return None
        if opens_thinking("".join(map(model.token_text, prompt[-4:]))):
            return None
        kind = format_for(self.chat_format.template or model.chat_template() or "")
        parallel = request.parallel_tool_calls
        lark = call_grammar(
            kind, request.offered_tools(), parallel, lambda t: lark_literal(model, t)
        )
        grammar = Grammar.lark(lark, "tool_calls")
        grammar.check(model)  # UserError: a parameters schema llguidance cannot match
        return grammar

    def _marker_token(self, text: str) -> list[int]:
        """The token that is `text` in the target's vocabulary, if one is ([] if it takes
        several); asked once per marker, not per request."""
        if text not in self._marker_tokens:
            assert self.engine is not None
            tokens = self.engine.model.tokenize(text, add_special=False, parse_special=True)
            self._marker_tokens[text] = tokens if len(tokens) == 1 else []
        return self._marker_tokens[text]

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as tokens, checked against the context (in a helper thread:
        llama.cpp's tokenizer only reads the vocabulary)."""
        assert self.engine is not None
        model = self.engine.model
        if request.messages is not None:
            messages, tools = list(request.messages), request.offered_tools()
            kwargs = self.chat_format.kwargs | request.template_kwargs
            format = replace(self.chat_format, kwargs=kwargs)
            tokens = self.engine.tokenize_messages(messages, format, tools)
        elif request.tokens is not None:
            tokens = list(request.tokens)
            if not all(0 <= t < model.n_vocab for t in tokens):
                raise ApiError(
                    f"prompt token ids must be from 0 to {model.n_vocab - 1}", param="prompt"
                )
        else:
            tokens = self.engine.tokenize(request.text or "")
        if request.grammar is not None:  # UserError: what llguidance finds wrong in it
            request.grammar.check(model)
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
        return tokens


# --- metrics -----------------------------------------------------------------------


@dataclass
class Metrics:
    """Counters since start-up, in Prometheus text (names as vLLM's where they exist)."""

    requests: int = 0
    rejected: int = 0
    cancelled: int = 0  # stopped early: the client went away, or the server is stopping
    totals: Stats = field(default_factory=Stats)
    drafts: int = 0  # rounds with a draft

    def record(self, stats: Stats) -> None:
        self.requests += 1
        self.cancelled += stats.stop_reason == "cancelled"
        self.totals.add(stats)
        self.drafts += sum(n for k, n in stats.draft_lengths.items() if k)

    def text(self, processing: int, deferred: int, counters: Counters) -> str:
        t, c = self.totals, counters
        decodes = max(c.decodes, 1)
        rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
            ("requests_total", "counter", "Generations finished", [("", self.requests)]),
            ("requests_rejected_total", "counter", "Requests refused, queue full",
             [("", self.rejected)]),
            ("requests_cancelled_total", "counter",
             "Generations stopped early (client gone, or server stopping)",
             [("", self.cancelled)]),
            ("requests_processing", "gauge", "Generations in a slot", [("", processing)]),
            ("requests_deferred", "gauge", "Generations waiting for a slot", [("", deferred)]),
            ("decode_total", "counter", "Target decode calls of the decode loop",
             [("", c.decodes)]),
            ("n_busy_slots_per_decode", "gauge", "Slots advanced per decode call, on average",
             [("", c.busy_slot_decodes / decodes)]),
            ("n_tokens_per_decode", "gauge", "Tokens per decode call, on average",
             [("", c.decoded_tokens / decodes)]),
            ("prompt_tokens_total", "counter", "Prompt tokens", [("", t.prompt_tokens)]),
            ("prompt_tokens_cached_total", "counter",
             "Prompt tokens reused from the previous generation's cache",
             [("", t.prompt_reused)]),
            ("generation_tokens_total", "counter", "Generated tokens", [("", t.tokens)]),
            ("time_per_output_token_seconds", "summary", "Generation time per output token",
             [("_sum", t.seconds), ("_count", t.tokens)]),
            ("spec_decode_num_drafts_total", "counter", "Rounds that verified a draft",
             [("", self.drafts)]),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed",
             [("", t.drafted)]),
            ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted",
             [("", t.accepted)]),
            ("spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Draft tokens accepted, by place in their draft (0: first)",
             [(f'{{position="{i}"}}', n) for i, n in sorted(t.accepted_at.items())]),
            ("spec_decode_num_accepted_beside_chain_total", "counter",
             "Draft tokens accepted on a tree's side branches (a chain would have missed them)",
             [("", t.accepted_beside)]),
            ("target_passes_total", "counter", "Target passes (each verifies one draft)",
             [("", t.target_passes)]),
        ]  # fmt: skip
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP specdec:{name} {help_text}.", f"# TYPE specdec:{name} {kind}"]
            lines += [f"specdec:{name}{suffix} {value}" for suffix, value in samples]
        return "\n".join(lines) + "\n"


# --- response bodies ---------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "cancelled": "stop"}  # else: "length"


def finish_reason(stats: Stats) -> str:
    return FINISH_REASONS.get(stats.stop_reason, "length")


def usage(stats: Stats) -> dict[str, object]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.tokens,
        "total_tokens": stats.prompt_tokens + stats.tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_reused},
    }


def timings(stats: Stats) -> dict[str, object]:
    """llama-server's `timings`, speculative figures included; cache_n: prompt tokens
    reused from the previous generation (its prefix cache)."""
    prompt_n = stats.prompt_tokens - stats.prompt_reused
    return {
        "cache_n": stats.prompt_reused,
        "prompt_n": prompt_n,
        "prompt_ms": stats.prompt_seconds * 1e3,
        "prompt_per_second": prompt_n / stats.prompt_seconds if stats.prompt_seconds else 0.0,
        "predicted_n": stats.tokens,
        "predicted_ms": stats.seconds * 1e3,
        "predicted_per_token_ms": 1e3 / stats.tokens_per_second if stats.tokens_per_second else 0.0,
        "predicted_per_second": stats.tokens_per_second,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "target_passes": stats.target_passes,
        "tokens_per_pass": stats.tokens_per_pass,
        "accepted_beside_chain": stats.accepted_beside,
        "k": stats.k,
        "tree": stats.tree,
    }


@dataclass(frozen=True)
class Endpoint:
    """How one endpoint writes its bodies: /v1/completions or /v1/chat/completions."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def new_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def choice(self, reply: Part, finish: str) -> dict[str, object]:
        if not self.chat:
            return {"index": 0, "text": reply.content, "logprobs": None, "finish_reason": finish}
        # OpenAI's content is null beside tool calls when there is no text
        content = reply.content if reply.content or not reply.calls else None
        message: dict[str, object] = {"role": "assistant", "content": content}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [call.to_dict() for call in reply.calls]
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

    def delta(self, part: Part | None, finish: str | None = None) -> dict[str, object]:
        """A streamed choice; for chat, `part` None opens the assistant's message. Thinking
        goes in delta.reasoning_content (as llama-server sends it), calls whole in
        delta.tool_calls (each with its index, as OpenAI's clients assemble them)."""
        if not self.chat:
            text = part.content if part else ""
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta: dict[str, object] = {"role": "assistant", "content": ""}
        if part is not None:
            delta = {"content": part.content} if part.content else {}
            if part.reasoning:
                delta["reasoning_content"] = part.reasoning
            if part.calls:
                delta["tool_calls"] = [
                    {"index": i, **call.to_dict()} for i, call in enumerate(part.calls)
                ]
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


# --- the HTTP application ----------------------------------------------------------


class ApiKeyMiddleware:
    """--api-key: `Authorization: Bearer KEY` on every path but the public ones."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                error = ApiError(
                    "invalid or missing API key: send Authorization: Bearer KEY",
                    status=401,
                    kind="authentication_error",
                    code="invalid_api_key",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def sse(data: dict[str, object] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class Api:
    """The routes, over a Service."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def app(self, on_loaded: Callable[[BaseException | None], None]) -> Starlette:
        options = self.service.options
        middleware = []
        if options.cors:
            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=[options.cors],
                    allow_methods=["GET", "POST"],
                    allow_headers=["Authorization", "Content-Type"],
                )
            )
        if options.api_key:
            middleware.append(Middleware(ApiKeyMiddleware, key=options.api_key))
        routes = [
            Route("/", self.page),
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/metrics", self.metrics),
            Route("/slots", self.slots),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            loading = asyncio.get_running_loop().run_in_executor(
                self.service.worker, self.service.load
            )
            loading.add_done_callback(lambda f: self._loaded(f, on_loaded))
            yield

        return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)

    def _loaded(self, future: asyncio.Future[Engine], on_loaded: Callable) -> None:
        error = future.exception()
        if error is None:
            self.service.engine = future.result()
            self.service.worker.submit(self.service.loop)
        on_loaded(error)

    async def health(self, request: Request) -> Response:
        if self.service.engine is None:
            status = {"status": "unavailable", "error": self.service.unavailable}
            return JSONResponse(status, status_code=503)
        return JSONResponse({"status": "ok"})

    async def page(self, request: Request) -> Response:
        html = (
            resources.files("specdec_cli.serve").joinpath("webui.html").read_text(encoding="utf-8")
        )
        return HTMLResponse(html.replace("{{MODEL}}", escape(self.service.model_name)))

    async def models(self, request: Request) -> Response:
        s = self.service
        model = {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "specdec"}
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics(self, request: Request) -> Response:
        service, scheduler = self.service, self.service.scheduler
        processing = len(scheduler.busy) if scheduler else 0
        counters = scheduler.counters if scheduler else Counters()
        text = service.metrics.text(processing, len(service.waiting), counters)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        """Each slot: idle, reading its prompt or generating, and its figures so far."""
        scheduler = self.service.scheduler
        return JSONResponse(scheduler.describe() if scheduler else [])

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint(chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint(chat=True))

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        try:
            job = await self._admit(request, endpoint)
        except ApiError as error:
            return error_response(error)
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        if job.request.stream:
            return StreamingResponse(
                self._stream(job, endpoint, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return await self._complete(job, endpoint)
        finally:
            watcher.cancel()

    async def _admit(self, request: Request, endpoint: Endpoint) -> Job:
        service = self.service
        if service.engine is None:
            raise ApiError(
                f"{service.unavailable}; retry",
                status=503,
                kind="server_busy",
                code="loading",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        body = await read_body(request)
        # in a helper thread: the body may be megabytes, a grammar's checks read it all
        # (llguidance compiles in its own threads, see grammar.on_compile_thread)
        parsed = await asyncio.to_thread(
            lambda: parse_request(parse_body(body), endpoint.chat, service.engine_options.sampling)
        )
        service.check_speculation(parsed.speculation)
        try:
            prompt = await asyncio.to_thread(service.prompt_tokens, parsed)
        except UserError as err:  # a chat template llama.cpp does not know, say
            raise ApiError(str(err)) from None
        reply, shown = service.reply_parser(parsed, prompt) if endpoint.chat else (None, set())
        if endpoint.chat:
            try:
                tools = await asyncio.to_thread(service.tool_grammar, parsed, prompt)
            except UserError as err:
                raise ApiError(str(err), param="tools") from None
            if tools is not None:
                parsed = replace(parsed, grammar=tools)
        return service.admit(parsed, prompt, reply, frozenset(shown))

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        """Stop the generation when its client goes away (the body is read already, so
        the next message can only be the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled.set()

    async def _events(self, job: Job) -> AsyncIterator[list[Event]]:
        """The job's events as they come, several at a time when the client lags."""
        while True:
            batch = [await job.events.get()]
            while not job.events.empty():
                batch.append(job.events.get_nowait())
            yield batch
            if isinstance(batch[-1], Finished | Failed):
                return

    def _logprob_writer(self, job: Job, endpoint: Endpoint) -> LogprobWriter | None:
        options = job.request.logprobs
        if options is None:  # asked for nothing: nothing to read, not even the engine
            return None
        engine = self.service.engine
        if engine is None:
            return None
        return LogprobWriter(engine.model, endpoint.chat, options, job.shown)

    async def _complete(self, job: Job, endpoint: Endpoint) -> Response:
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        writer = self._logprob_writer(job, endpoint)
        async for batch in self._events(job):
            parts += [e.piece.text for e in batch if isinstance(e, Chunk)]
            logprobs += [lp for e in batch if isinstance(e, Chunk) for lp in e.piece.logprobs]
        end = batch[-1]
        if isinstance(end, Failed):
            return error_response(_as_api_error(end.error))
        reply = Part("".join(parts))
        if job.reply is not None:
            reply = job.reply.feed(reply.content) + job.reply.finish()
        finish = "tool_calls" if reply.calls else finish_reason(end.stats)
        choice = endpoint.choice(reply, finish)
        if writer is not None:
            choice["logprobs"] = writer.write(logprobs)
        return JSONResponse(
            {
                "id": endpoint.new_id(),
                "object": endpoint.object,
                "created": int(time.time()),
                "model": self.service.model_name,
                "choices": [choice],
                "usage": usage(end.stats),
                "timings": timings(end.stats),
            }
        )

    async def _stream(
        self, job: Job, endpoint: Endpoint, watcher: asyncio.Task[None]
    ) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per run of text from one source (accepted draft
        tokens, or the target's own), with the figures so far in the "specdec" field.
        Log-probabilities, when asked for, go with the chunk that carries their tokens'
        text: those of text the reply still holds back (a tag, a tool call) wait for it."""
        writer = self._logprob_writer(job, endpoint)
        held_logprobs: list[TokenLogprob] = []
        head = {
            "id": endpoint.new_id(),
            "object": endpoint.chunk_object,
            "created": int(time.time()),
            "model": self.service.model_name,
        }
        try:
            if endpoint.chat:
                yield sse({**head, "choices": [endpoint.delta(None)]})
            async for batch in self._events(job):
                for chunk in merge_runs(batch):
                    figures = {
                        "source": "draft" if chunk.piece.drafted else "target",
                        "draft_n": chunk.drafted,
                        "draft_n_accepted": chunk.accepted,
                        "predicted_n": chunk.tokens,
                    }
                    held_logprobs += chunk.piece.logprobs
                    part = Part(chunk.piece.text)
                    if job.reply is not None:
                        part = job.reply.feed(part.content)
                    if part:
                        choice = endpoint.delta(part)
                        if writer is not None:
                            choice["logprobs"] = writer.write(held_logprobs)
                            held_logprobs = []
                        yield sse({**head, "choices": [choice], "specdec": figures})
            end = batch[-1]
            if isinstance(end, Failed):
                yield sse(_as_api_error(end.error).body())
            else:
                held = job.reply.finish() if job.reply is not None else Part()
                if held:
                    choice = endpoint.delta(held)
                    if writer is not None:
                        choice["logprobs"] = writer.write(held_logprobs)
                        held_logprobs = []
                    yield sse({**head, "choices": [choice]})
                finish = "tool_calls" if held.calls else finish_reason(end.stats)
                last = endpoint.delta(Part(), finish=finish)
                if writer is not None:  # tokens of no text to send (a control token's)
                    last["logprobs"] = writer.write(held_logprobs)
                yield sse({**head, "choices": [last], "timings": timings(end.stats)})
                if job.request.include_usage:
                    yield sse({**head, "choices": [], "usage": usage(end.stats)})
            yield sse("[DONE]")
        finally:
            job.cancelled.set()  # the client went away mid-stream, or all is sent
            watcher.cancel()


def merge_runs(batch: list[Event]) -> Iterator[Chunk]:
    """Consecutive chunks from the same source as one (text joined, latest figures)."""
    run: Chunk | None = None
    for event in batch:
        if not isinstance(event, Chunk):
            continue
        if run is not None and run.piece.drafted == event.piece.drafted:
            text = run.piece.text + event.piece.text
            logprobs = run.piece.logprobs + event.piece.logprobs
            piece = replace(event.piece, text=text, logprobs=logprobs)
            run = Chunk(piece, event.drafted, event.accepted, event.tokens)
            continue
        if run is not None:
            yield run
        run = event
    if run is not None:
        yield run


def _as_api_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, UserError):
        return ApiError(str(error))
    return ApiError(f"generation failed: {error}", status=500, kind="server_error")


async def read_body(request: Request) -> bytes:
    """The body, up to MAX_BODY_BYTES (413 past that)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


# --- the process -------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, with specdec's signal handling: SIGINT/SIGTERM end every generation with
    its last chunk and the process with code 0 (uvicorn would raise the signal again once
    done, which kills the process with SIGTERM's default action); while the models load,
    Ctrl-C ends the process at once, as `specdec run` does."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            with interrupt.handled_by_server():
                yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.service.engine is None and not self.should_exit:
            interrupt.exit_now()
        self.service.stop()
        super().handle_exit(sig, frame)


def restart_on(sock: socket.socket) -> None:
    """Start this server process over, keeping its listening socket (so that clients
    get 503, not a refused connection, while it waits for its workers)."""
    os.set_inheritable(sock.fileno(), True)
    os.environ[LISTEN_FD_ENV] = str(sock.fileno())
    os.environ[RESTARTED_ENV] = "1"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def listening_socket(options: ServeOptions) -> socket.socket:
    """The socket a restart handed over, else a new one."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is not None:
        return socket.socket(fileno=int(fd))
    return listen(options.host, options.port, "--port or --host")


def serve(engine_options: EngineOptions, options: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM."""
    sock = listening_socket(options)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    service = Service(engine_options, options)
    service.listening = sock
    failure: list[BaseException] = []

    def on_loaded(error: BaseException | None) -> None:
        if error is not None:
            failure.append(error)
            server.should_exit = True
        else:
            note(f"ready: {url} (model {service.model_name}); Ctrl-C stops")

    config = uvicorn.Config(
        Api(service).app(on_loaded),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = _Server(config, service)
    note(f"loading the models; {url}/health answers 503 until they are ready")
    try:
        with rpc.guard(engine_options.rpc, service.worker_lost):
            server.run(sockets=[sock])
    finally:
        service.stop()
        service.worker.shutdown(wait=True)
        if service.engine is not None:
            service.engine.close()
        sock.close()
    if failure:
        raise failure[0]
