"""A generation's answer as its events come back from the decode loop: one JSON body at
the end, or server-sent events as it goes, each chunk a run of text from one source
(accepted draft tokens, or the target's own)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

from starlette.responses import JSONResponse, Response

from specdec_cli.decoding.logprobs import TokenLogprob
from specdec_cli.serve.logprobs import LogprobWriter
from specdec_cli.serve.reply import Part
from specdec_cli.serve.responses import (
    Endpoint,
    as_api_error,
    error_response,
    finish_reason,
    sse,
    timings,
    usage,
)
from specdec_cli.serve.service import Chunk, Event, Failed, Finished, Job


class Answer:
    """What the client of one job gets, written by `endpoint`'s shapes; `writer` writes
    its tokens' log-probabilities, where the request asked for them."""

    def __init__(
        self, job: Job, endpoint: Endpoint, model_name: str, writer: LogprobWriter | None
    ) -> None:
        self.job, self.endpoint, self.writer = job, endpoint, writer
        self.model_name = model_name

    async def _events(self) -> AsyncIterator[list[Event]]:
        """The job's events as they come, several at a time when the client lags."""
        events = self.job.events
        while True:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            yield batch
            if isinstance(batch[-1], Finished | Failed):
                return

    async def body(self) -> Response:
        """The whole answer, once the generation ends."""
        job, endpoint, writer = self.job, self.endpoint, self.writer
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        async for batch in self._events():
            parts += [e.piece.text for e in batch if isinstance(e, Chunk)]
            logprobs += [lp for e in batch if isinstance(e, Chunk) for lp in e.piece.logprobs]
        end = batch[-1]
        if isinstance(end, Failed):
            return error_response(as_api_error(end.error, job.request.grammar_field))
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
                "model": self.model_name,
                "choices": [choice],
                "usage": usage(end.stats),
                "timings": timings(end.stats),
            }
        )

    async def stream(self, watcher: asyncio.Task[None]) -> AsyncIterator[bytes]:
        """Server-sent events, with the figures so far in each chunk's "specdec" field.
        Log-probabilities, when asked for, go with the chunk that carries their tokens'
        text: those of text the reply still holds back (a tag, a tool call) wait for it.
        `watcher` (the client's disconnect) is cancelled when all is sent."""
        job, endpoint, writer = self.job, self.endpoint, self.writer
        held_logprobs: list[TokenLogprob] = []
        head = {
            "id": endpoint.new_id(),
            "object": endpoint.chunk_object,
            "created": int(time.time()),
            "model": self.model_name,
        }
        try:
            if endpoint.chat:
                yield sse({**head, "choices": [endpoint.delta(None)]})
            async for batch in self._events():
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
                yield sse(as_api_error(end.error, job.request.grammar_field).body())
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
