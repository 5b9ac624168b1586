"""`specdec serve`'s options, and OpenAI request bodies checked: what a client may send.

No web framework here: the command line reads ServeOptions' defaults without the
server extra installed.

Everything here is pure: a parsed JSON body in, a GenerationRequest or an ApiError out.
Nothing a client sends may raise anything else (wrong types, huge numbers, lone UTF-16
surrogates that cannot be encoded): the server answers 400 and goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from specdec_cli.decoding.grammar import Grammar, check_json_bytes
from specdec_cli.decoding.logprobs import MAX_TOP, LogprobOptions
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.media import Media, media_from_bytes
from specdec_cli.llamacpp.mtmd import MARKER
from specdec_cli.models.chat import ChatFormat, Message, messages_from

MAX_STOPS = 16
MAX_K = 256  # a draft length beyond this is never useful, and is refused
SEED_MODULUS = 2**64  # numpy takes seeds >= 0; OpenAI's may be negative
# Content parts that carry media, and the kind each must hold (OpenAI's chat API).
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio"}
AUDIO_FORMATS = ("wav", "mp3", "flac")


@dataclass(frozen=True)
class ServeOptions:
    """Where and how `specdec serve` listens; names and defaults as llama-server's."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    alias: str | None = None  # the model's name in the API; None: the target's file name
    cors: str | None = None  # an origin allowed to call the API from a browser; None: none
    # -np: generations decoded at once, each in a slot of its own; llama-server's default
    # (its "auto" gives 4), and one decode call of 4 rounds costs little more than one
    # on memory-bound machines (benchmarks/README.md, "Many requests at once").
    parallel: int = 4
    queue: int = 16  # requests that may wait for a slot
    # MiB of host memory for slots' caches that new prompts displaced (llama-server's
    # --cache-ram, and its default); 0: none.
    cache_ram: int = 8192
    # Tokens of recent requests' texts that every slot's n-gram lookup may find (greedy
    # requests; see ngram.TextMemory), as llama-server's ngram-mod map is shared.
    ngram_memory: int = 16384
    # --chat-template, --jinja, ...; by default the model's own template, as Jinja
    chat: ChatFormat = field(default_factory=ChatFormat)
    # Thinking (<think>...</think>) as reasoning_content ("deepseek", and "auto": what
    # llama-server's auto does for these models), or left in the content ("none").
    reasoning_format: str = "deepseek"


RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    """An answer other than 200, with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def retry_later(cls, message: str, code: str) -> ApiError:
        """503 with Retry-After: the server cannot take the request now (loading, busy,
        a worker away), but will."""
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return cls(f"{message}; retry", status=503, kind="server_busy", code=code, headers=headers)


@dataclass(frozen=True)
class Speculation:
    """The extension field "speculative": off, the server's own drafting, or a draft
    length and tree setting."""

    enabled: bool = True
    k: str | None = None  # a number of tokens or "auto"; None: as the server was started
    tree: str | None = None  # "off", "auto" or a number of tokens; None: as started


@dataclass(frozen=True)
class GenerationRequest:
    """One request, checked. Exactly one of `text`, `tokens` and `messages` is set."""

    chat: bool
    text: str | None = None
    tokens: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    max_tokens: int = -1  # -1: until the model stops or the context is full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    speculation: Speculation = field(default_factory=Speculation)
    logprobs: LogprobOptions | None = None  # None: none asked for
    # Chat: the functions the model may call, and how ("auto", "none", "required", or
    # "function": the one named); the parser keeps one call where parallel is False.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # Variables for the chat template, over the server's --chat-template-kwargs
    # (llama-server's field, e.g. {"enable_thinking": false})
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # What the output follows: response_format's JSON object or schema, or llama-server's
    # "grammar" (GBNF) or "json_schema" (see decoding/grammar.py); None: nothing.
    grammar: Grammar | None = None
    grammar_field: str | None = None  # the field the grammar came in, for its errors
    # Chat: the images and audio of the messages' content parts, in order, each named by
    # its part ("messages[0].content[1]"); a media marker stands in each one's place.
    media: tuple[Media, ...] = ()

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the chat template gets: none for "none", only the named one for a
        named choice (whose call, as "required"'s, a grammar then enforces: see
        Service.tool_grammar)."""
        if self.tool_choice == "none":
            return []
        if self.tool_choice == "function":
            return [t for t in self.tools if t["function"]["name"] == self.tool_name]
        return list(self.tools)


def parse_body(data: bytes) -> dict[str, object]:
    """A request body as a JSON object."""
    try:
        body = json.loads(data)
    except UnicodeDecodeError:
        raise ApiError("the request body is not UTF-8 text; send JSON in UTF-8") from None
    except ValueError as err:  # json.JSONDecodeError, and numbers too long to convert
        raise ApiError(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise ApiError("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body is a JSON {_kind(body)}; send a JSON object")
    return body


def parse_request(
    body: dict[str, object], chat: bool, defaults: SamplingParams
) -> GenerationRequest:
    """A /v1/chat/completions (`chat`) or /v1/completions body, checked field by field.
    `defaults`: the server's sampling settings, for the fields the request leaves out."""
    refuse_unsupported(body, chat)
    stream = _optional(body, "stream", bool) or False
    options = _optional(body, "stream_options", dict)
    if options is not None and not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    include_usage = bool(options and _optional(options, "include_usage", bool, "stream_options."))
    grammar, grammar_field = _grammar(body)
    request = GenerationRequest(
        chat=chat,
        max_tokens=_max_tokens(body, chat),
        sampling=_sampling(body, defaults),
        seed=_seed(body),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        speculation=_speculation(body),
        logprobs=_logprobs(body, chat),
        grammar=grammar,
        grammar_field=grammar_field,
    )
    if chat:
        tools = _tools(body)
        choice, name = _tool_choice(body, tools)
        if choice in ("required", "function") and request.grammar is not None:
            # Both would constrain the one reply: never follow one and drop the other.
            raise ApiError(
                f"tool_choice {body['tool_choice']!r} requires a tool call, which cannot "
                "also follow response_format (or grammar, json_schema): send one of them",
                param="tool_choice",
            )
        messages, media = _messages(body)
        return replace(
            request,
            messages=messages,
            media=media,
            tools=tools,
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=_optional(body, "parallel_tool_calls", bool) is not False,
            template_kwargs=_optional(body, "chat_template_kwargs", dict) or {},
        )
    text, tokens = _prompt(body)
    return replace(request, text=text, tokens=tokens)


def refuse_unsupported(body: dict[str, object], chat: bool) -> None:
    """Features specdec does not implement: a 400 naming them, never a silent ignore."""
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise ApiError("n > 1 is not supported: one choice per request", param="n")
    best_of = _optional(body, "best_of", int)
    if best_of is not None and best_of != 1:
        raise ApiError("best_of > 1 is not supported", param="best_of")
    for name in ("functions", "logit_bias"):
        if body.get(name):
            hint = " (send tools)" if name == "functions" else ""
            raise ApiError(f"{name} is not supported by specdec serve{hint}", param=name)
    if not chat and body.get("tools"):
        raise ApiError("tools need /v1/chat/completions", param="tools")
    if body.get("echo"):
        raise ApiError("echo is not supported by specdec serve", param="echo")
    if not chat and body.get("suffix"):
        raise ApiError("suffix (insertion) is not supported by specdec serve", param="suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if _optional(body, name, float):
            raise ApiError(f"{name} is not supported by specdec serve (leave it 0)", param=name)


def _grammar(body: dict[str, object]) -> tuple[Grammar | None, str | None]:
    """OpenAI's response_format ({"type": "json_object"}, or "json_schema" with its
    {"name", "schema", "strict"}), or llama-server's "grammar" (GBNF) or "json_schema" (a
    schema): at most one. The schema is checked against the vocabulary later (see
    Service.prompt_tokens); here, that it parses. With the field it came in."""
    given: list[tuple[str, Any]] = []
    response_format = _optional(body, "response_format", dict)
    kind = response_format.get("type", "text") if response_format is not None else "text"
    if kind == "json_object":
        # llama-server takes a "schema" beside it too
        schema = response_format.get("schema") if response_format else None
        given.append(("response_format", schema))
    elif kind == "json_schema":
        spec = response_format.get("json_schema") if response_format else None
        if not isinstance(spec, dict):
            raise ApiError(
                'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format",
            )
        given.append(("response_format", spec.get("schema", {"type": "object"})))
    elif kind != "text":
        raise ApiError(
            f"response_format type must be text, json_object or json_schema (got {kind!r})",
            param="response_format",
        )
    if body.get("json_schema") is not None:
        given.append(("json_schema", body["json_schema"]))
    if body.get("grammar") is not None:
        given.append(("grammar", body["grammar"]))
    if not given:
        return None, None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise ApiError(f"give one of {names}, not both", param=given[1][0])
    name, value = given[0]
    try:
        if name == "grammar":
            if not isinstance(value, str):
                raise ApiError("grammar must be a string (GBNF)", param=name)
            return Grammar.gbnf(value), name
        if value is None:
            return Grammar.json_object(), name
        if not isinstance(value, dict | bool):
            raise ApiError("the JSON schema must be a JSON object", param=name)
        return Grammar.json_schema(value), name
    except UserError as err:
        raise ApiError(str(err), param=name) from None


def _max_tokens(body: dict[str, object], chat: bool) -> int:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = _optional(body, name, int)
        if value is not None:
            if value < 1:
                raise ApiError(f"{name} must be at least 1 (got {value})", param=name)
            return value
    return -1


def _sampling(body: dict[str, object], defaults: SamplingParams) -> SamplingParams:
    temp = _optional(body, "temperature", float)
    top_p = _optional(body, "top_p", float)
    min_p = _optional(body, "min_p", float)
    top_k = _optional(body, "top_k", int)
    if temp is not None and temp < 0:
        raise ApiError(f"temperature must be 0 or more (got {temp})", param="temperature")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ApiError(f"{name} must be between 0 and 1 (got {value})", param=name)
    if top_k is not None and top_k < 0:
        raise ApiError(f"top_k must be 0 (off) or more (got {top_k})", param="top_k")
    given = {"temp": temp, "top_p": top_p, "min_p": min_p, "top_k": top_k}
    return replace(defaults, **{k: v for k, v in given.items() if v is not None})


def _logprobs(body: dict[str, object], chat: bool) -> LogprobOptions | None:
    """Chat: `logprobs: true` and `top_logprobs` 0..20 (OpenAI's); completions:
    `logprobs: N` (OpenAI allows 0..5, llama-server more: up to 20 here). Both take
    llama-server's `post_sampling_probs`."""
    post_sampling = _optional(body, "post_sampling_probs", bool) is True
    if chat:
        asked = _optional(body, "logprobs", bool) is True
        top = _optional(body, "top_logprobs", int)
        if top is not None and not asked:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        name, top = "top_logprobs", top or 0
    else:
        if body.get("top_logprobs") is not None:
            raise ApiError(
                "top_logprobs is a chat field; /v1/completions takes logprobs: N",
                param="top_logprobs",
            )
        given = _optional(body, "logprobs", int)
        asked, name, top = given is not None, "logprobs", given or 0
    if not asked:
        return None
    if not 0 <= top <= MAX_TOP:
        raise ApiError(f"{name} must be from 0 to {MAX_TOP} (got {top})", param=name)
    return LogprobOptions(top, post_sampling)


def _seed(body: dict[str, object]) -> int | None:
    seed = _optional(body, "seed", int)
    return None if seed is None else seed % SEED_MODULUS


def _stop(body: dict[str, object]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOPS:
        raise ApiError(f"stop takes at most {MAX_STOPS} strings", param="stop")
    return tuple(_encodable(s, "stop") for s in stop if s)


def _speculation(body: dict[str, object]) -> Speculation:
    value = body.get("speculative")
    if value is None or value is True:
        return Speculation()
    if value is False:
        return Speculation(enabled=False)
    if not isinstance(value, dict) or set(value) - {"k", "tree"}:
        raise ApiError(
            'speculative must be false, true or {"k": N, "tree": T} (N a number of tokens '
            'or "auto"; T "off", "auto" or a number of tokens; both optional)',
            param="speculative",
        )
    return Speculation(k=_draft_length(value.get("k")), tree=_tree(value.get("tree")))


def _draft_length(k: object) -> str | None:
    if k is None or k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ApiError(
            f'speculative.k must be a whole number from 1 to {MAX_K}, or "auto" (got {k!r})',
            param="speculative",
        )
    return str(k)


def _tree(tree: object) -> str | None:
    if tree is None or tree in ("off", "auto"):
        return tree  # type: ignore[return-value]
    if isinstance(tree, bool) or not isinstance(tree, int) or not 2 <= tree <= MAX_K:
        raise ApiError(
            f'speculative.tree must be "off", "auto" or a whole number from 2 to {MAX_K} '
            f"(got {tree!r})",
            param="speculative",
        )
    return str(tree)


TOOL_SHAPE = '{"type": "function", "function": {"name", "description", "parameters"}}'


def _tools(body: dict[str, object]) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ApiError(f"tools must be a list of {TOOL_SHAPE}", param="tools")
    try:  # before the template and the grammar of tool_choice read them
        check_json_bytes("the tools field, as JSON,", tools)
    except UserError as err:
        raise ApiError(str(err), param="tools") from None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type", "function") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            raise ApiError(f"tools[{i}] is not {TOOL_SHAPE}", param="tools")
    return tuple(tools)


def _tool_choice(
    body: dict[str, object], tools: tuple[dict[str, Any], ...]
) -> tuple[str, str | None]:
    """("auto" | "none" | "required", None), or ("function", the name to call)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ApiError('tool_choice "required" needs tools', param="tool_choice")
        return str(choice), None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            'tool_choice must be "auto", "none", "required" or {"type": "function", '
            '"function": {"name": NAME}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise ApiError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "function", name


def _messages(body: dict[str, object]) -> tuple[tuple[Message, ...], tuple[Media, ...]]:
    """The messages, and the media of their content parts (each part a media marker in
    its message's text, as llama-server puts it there)."""
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise ApiError(
            'messages must be a non-empty list of {"role", "content"} objects', param="messages"
        )
    media: list[Media] = []
    items = [_media_in(item, f"messages[{i}]", media) for i, item in enumerate(items)]
    try:
        messages = messages_from(items, "request")
    except UserError as err:
        raise ApiError(str(err), param="messages") from None
    for message in messages:
        _encodable(message.content, "messages")
    return messages, tuple(media)


def _media_in(message: object, where: str, media: list[Media]) -> object:
    """A message whose media parts are read into `media` and become text parts holding
    a marker; anything else as it came (messages_from checks it)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
            media.append(_media_part(part, f"{where}.content[{j}]"))
            part = {"type": "text", "text": MARKER}
        parts.append(part)
    return {**message, "content": parts}


def _media_part(part: dict[str, Any], where: str) -> Media:
    """An image_url part (a data: URL) or an input_audio part (base64 and its format),
    read and checked (see media.py); a 400 naming the part otherwise."""
    kind = MEDIA_PARTS[part["type"]]
    data = _image_url(part, where) if kind == "image" else _input_audio(part, where)
    try:
        media = media_from_bytes(data, where)
    except UserError as err:
        raise ApiError(str(err), param=where) from None
    if media.kind != kind:
        raise ApiError(f"{where} is {media.kind}, sent as {part['type']}", param=where)
    return media


def _image_url(part: dict[str, Any], where: str) -> bytes:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ApiError(f'{where}: image_url has no "url" string', param=where)
    if url.startswith(("http://", "https://")):
        raise ApiError(
            f"{where}: remote image URLs are not fetched; send the image in a data: URL "
            "(data:image/png;base64,...)",
            param=where,
        )
    header, comma, payload = url.partition(",")
    if not (header.startswith("data:") and header.endswith(";base64") and comma):
        raise ApiError(
            f"{where}: image_url is not a base64 data: URL (data:image/png;base64,...)",
            param=where,
        )
    return _base64(payload, where)


def _input_audio(part: dict[str, Any], where: str) -> bytes:
    value = part.get("input_audio")
    data = value.get("data") if isinstance(value, dict) else None
    audio_format = value.get("format") if isinstance(value, dict) else None
    if not isinstance(data, str) or audio_format not in AUDIO_FORMATS:
        raise ApiError(
            f'{where}: input_audio must be {{"data": BASE64, "format": '
            f"{' or '.join(map(repr, AUDIO_FORMATS))}}}",
            param=where,
        )
    return _base64(data, where)


def _base64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(f"{where}: the data is not base64", param=where) from None


def _prompt(body: dict[str, object]) -> tuple[str | None, tuple[int, ...] | None]:
    """A prompt as OpenAI takes it: text, or token ids; a list of one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encodable(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(
            "one prompt per request (a list of several is not supported)", param="prompt"
        )
    raise ApiError("prompt must be a string or a list of token ids", param="prompt")


def _encodable(text: str, param: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(f"{param} holds an unpaired UTF-16 surrogate", param=param) from None
    return text


def _optional(body: dict[str, object], name: str, kind: type, prefix: str = "") -> object:
    """body[name] if it is of `kind` (a float also takes a whole number), None if it is
    absent or null; anything else is the client's mistake."""
    value = body.get(name)
    if value is None:
        return None
    if kind is int and _is_int(value):
        return value
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ApiError(f"{prefix}{name} must be a finite number", param=prefix + name)
        return float(value)
    if kind not in (int, float) and isinstance(value, kind):
        return value
    names = {int: "a whole number", float: "a number", bool: "true or false", dict: "an object"}
    raise ApiError(
        f"{prefix}{name} must be {names[kind]} (got a {_kind(value)})", param=prefix + name
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list"}
    return names.get(type(value), "object")
