"""OpenAI's response shapes: a completion's or a chat's body and streamed chunks, usage,
llama-server's timings, and errors (an error's JSON body, or its server-sent event)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from starlette.responses import JSONResponse

from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.serve.api import ApiError
from specdec_cli.serve.reply import Part

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


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def sse(data: dict[str, object] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def as_api_error(error: Exception, param: str | None = None) -> ApiError:
    """What a generation failed with, as the client sees it: a 400 for what the request
    asked (a grammar's dead end: `param` names the grammar's field), a 500 for anything
    else."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, UserError):
        return ApiError(str(error), param=param)
    return ApiError(f"generation failed: {error}", status=500, kind="server_error")
