"""`specdec serve`'s HTTP routes over a Service: OpenAI's endpoints, /health, /metrics,
/slots and the page, with --api-key and --cors; bodies read up to MAX_BODY_BYTES and
checked off the event loop, so that a long one never holds up another client."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from html import escape
from importlib import resources

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

from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.scheduler import Counters
from specdec_cli.errors import UserError
from specdec_cli.serve.api import ApiError, GenerationRequest, parse_body, parse_request
from specdec_cli.serve.logprobs import LogprobWriter
from specdec_cli.serve.reply import ReplyParser
from specdec_cli.serve.responses import Endpoint, error_response
from specdec_cli.serve.service import Job, Service
from specdec_cli.serve.streaming import Answer

MAX_BODY_BYTES = 8 * 2**20
# With a projector: room for images in base64 (4/3 of their bytes) at media.py's limit.
MAX_MEDIA_BODY_BYTES = 64 * 2**20
PUBLIC_PATHS = ("/health", "/")  # no API key: the page holds no data, it asks for the key


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
        encodings = service.engine.encodings if service.engine else None
        encoded = encodings.encoded if encodings else 0
        text = service.metrics.text(processing, len(service.waiting), counters, encoded)
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
                self._answer(job, endpoint).stream(watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return await self._answer(job, endpoint).body()
        finally:
            watcher.cancel()

    async def _admit(self, request: Request, endpoint: Endpoint) -> Job:
        service = self.service
        if service.engine is None:
            raise ApiError.retry_later(service.unavailable, "loading")
        most = MAX_MEDIA_BODY_BYTES if service.engine_options.mmproj else MAX_BODY_BYTES
        body = await read_body(request, most)
        # in a helper thread: the body may be megabytes, a grammar's checks read it all
        # (llguidance compiles in its own threads, see grammar.on_compile_thread)
        parsed = await asyncio.to_thread(
            lambda: parse_request(parse_body(body), endpoint.chat, service.engine_options.sampling)
        )
        service.check_speculation(parsed.speculation)
        try:
            prompt = await asyncio.to_thread(service.prompt, parsed)
        except UserError as err:  # a chat template llama.cpp does not know, say
            raise ApiError(str(err)) from None
        try:
            parsed, reply, shown = await self._chat_reply(parsed, prompt.tokens, endpoint)
        except BaseException:
            prompt.close()
            raise
        return service.admit(parsed, prompt, reply, frozenset(shown))

    async def _chat_reply(
        self, parsed: GenerationRequest, prompt: list[int], endpoint: Endpoint
    ) -> tuple[GenerationRequest, ReplyParser | None, set[int]]:
        """How a chat reply is parted, and the request with the grammar its tools need."""
        if not endpoint.chat:
            return parsed, None, set()
        service = self.service
        reply, shown = service.reply_parser(parsed, prompt)
        try:
            tools = await asyncio.to_thread(service.tool_grammar, parsed, prompt)
        except UserError as err:
            raise ApiError(str(err), param="tools") from None
        if tools is not None:
            parsed = replace(parsed, grammar=tools, grammar_field="tools")
        return parsed, reply, shown

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        """Stop the generation when its client goes away (the body is read already, so
        the next message can only be the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancelled.set()

    def _answer(self, job: Job, endpoint: Endpoint) -> Answer:
        """The job's answer; its log-probabilities' writer only where they were asked for
        (nothing to read then, not even the engine)."""
        engine, options = self.service.engine, job.request.logprobs
        writer = None
        if options is not None and engine is not None:
            writer = LogprobWriter(engine.model, endpoint.chat, options, job.shown)
        return Answer(job, endpoint, self.service.model_name, writer)


async def read_body(request: Request, most: int) -> bytes:
    """The body, up to `most` bytes (413 past that)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > most:
        raise ApiError(f"the request body is over {most} bytes", status=413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > most:
            raise ApiError(f"the request body is over {most} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)
