"""Chat prompts: a conversation, formatted with a chat template, tokenized as llama.cpp does.

By default the model's own template runs as Jinja (jinja.py), as llama-server runs it
since --jinja became its default. With --no-jinja, or a built-in format's name, the
formatting is llama.cpp's own llama_chat_apply_template: it knows a fixed set of formats
(llama_chat_builtin_templates) and picks one by name, or by markers in a template's
text. A template it does not recognise is refused, never guessed.
"""

from __future__ import annotations

import json
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import Model, apply_chat_template, builtin_chat_templates
from specdec_cli.models import jinja

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; llama.cpp maps it the same way (common/chat.cpp).
ROLE_ALIASES = {"developer": "system"}
MESSAGES_FORMAT = 'a JSON list of {"role": ..., "content": "..."} objects'


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # An assistant's calls, in OpenAI's shape ({"id", "type", "function": {"name",
    # "arguments"}}), and a tool message's answer to one.
    tool_calls: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape): a call's
        arguments as an object, where they are JSON."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [_with_object_arguments(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    with suppress(TypeError, ValueError):  # not JSON text: as the client sent it
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes text. `template`: a built-in format's name (always
    llama.cpp's), or a template's text; None: the model's own. `jinja`: run the template
    as Jinja (else llama.cpp recognises it, or refuses). `kwargs`: variables the template
    may read (--chat-template-kwargs, e.g. {"enable_thinking": false})."""

    template: str | None = None
    jinja: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ChatOptions:
    """How to wrap a prompt in the model's chat format.

    The conversation is: the system message, the history, then the prompt as the last
    user turn (when there is a prompt), formatted as `format` says.
    """

    system: str | None = None
    history: tuple[Message, ...] = ()
    format: ChatFormat = field(default_factory=ChatFormat)


def chat_options(
    chat: bool,
    system: str | None,
    messages: str | None,
    prompt: str | None,
    format: ChatFormat,
) -> ChatOptions | None:
    """The chat settings the command line asks for, read and checked; None for a plain
    prompt. --system, --messages and a chat template each imply --chat."""
    if not (chat or system is not None or messages is not None or format.template is not None):
        return None
    if messages == "-" and prompt == "-":
        raise UserError("stdin can feed --messages or -p, not both; put one of them in a file")
    history = read_messages(messages) if messages is not None else ()
    if system and any(m.role == "system" for m in history):
        raise UserError(
            f"--system and the system message in {messages} would be two system messages; "
            "keep one of them"
        )
    return ChatOptions(system, history, format)


def chat_format(
    chat_template: str | None = None,
    chat_template_file: str | None = None,
    jinja: bool = True,
    chat_template_kwargs: str | None = None,
) -> ChatFormat:
    """--chat-template, --chat-template-file, --jinja/--no-jinja and
    --chat-template-kwargs (commands.options.CHAT_FLAGS), read and checked."""
    if chat_template is not None and chat_template_file is not None:
        raise UserError("--chat-template and --chat-template-file name two templates; keep one")
    if chat_template_file is not None:
        if not jinja:
            raise UserError("--chat-template-file is a Jinja template; drop --no-jinja")
        text = _read_template(Path(chat_template_file), "--chat-template-file")
    else:
        text = template_override(chat_template, jinja) if chat_template is not None else None
    kwargs = parse_template_kwargs(chat_template_kwargs) if chat_template_kwargs else {}
    return ChatFormat(text, jinja, kwargs)


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object of extra variables for the template."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(
            f"--chat-template-kwargs is not valid JSON ({err.msg}); give an object, e.g. "
            "'{\"enable_thinking\": false}'"
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"--chat-template-kwargs must be a JSON object, not a {_kind(value)}")
    return value


def read_messages(source: str) -> tuple[Message, ...]:
    """Messages from a JSON file, or from stdin for '-'."""
    if source == "-":
        return parse_messages(sys.stdin.read(), "stdin")
    path = Path(source)
    text = _read_text(path, f"messages file not found: {path}; check the path")
    return parse_messages(text, str(path))


def _read_text(path: Path, missing: str) -> str:
    """A UTF-8 file's text; a missing one says `missing`, an unreadable one says why."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(missing) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def parse_messages(text: str, origin: str) -> tuple[Message, ...]:
    """An OpenAI-style message list; `origin` names the file in error messages."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{origin} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); "
            f"--messages takes {MESSAGES_FORMAT}"
        ) from None
    if isinstance(data, dict) and "messages" in data:
        raise UserError(
            f'{origin} holds a JSON object; --messages takes the list itself (the "messages" '
            "value of a chat request)"
        )
    if not isinstance(data, list):
        raise UserError(f"{origin} holds a JSON {_kind(data)}; --messages takes {MESSAGES_FORMAT}")
    if not data:
        raise UserError(f"{origin} holds an empty list; --messages takes {MESSAGES_FORMAT}")
    return messages_from(data, origin)


def messages_from(items: list[object], origin: str) -> tuple[Message, ...]:
    """Messages from a parsed JSON list (a file's, or a chat request's "messages")."""
    return tuple(_message(item, f"{origin}: messages[{i}]") for i, item in enumerate(items))


def _message(item: object, where: str) -> Message:
    if not isinstance(item, dict):
        raise UserError(f'{where} is a {_kind(item)}, not an object with "role" and "content"')
    calls = _tool_calls(item.get("tool_calls"), where)
    for key in ("role", "content"):
        if key not in item and not (key == "content" and calls):
            raise UserError(f'{where} has no "{key}"; each message is {{"role", "content"}}')
    role = item["role"]
    if not isinstance(role, str):
        raise UserError(f'{where}: "role" is a {_kind(role)}, not a string')
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise UserError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}")
    content = item.get("content")
    call_id = item.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise UserError(f'{where}: "tool_call_id" is a {_kind(call_id)}, not a string')
    text = "" if content is None and calls else _content(content, where)
    return Message(role, text, calls, call_id)


def _tool_calls(calls: object, where: str) -> tuple[dict[str, Any], ...]:
    """An assistant message's tool_calls, checked: OpenAI's shape."""
    if calls is None:
        return ()
    shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
    if not isinstance(calls, list):
        raise UserError(f'{where}: "tool_calls" is a {_kind(calls)}, not a list of {shape}')
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise UserError(f"{where}: tool_calls[{j}] is not {shape}")
    return tuple(calls)


def _content(content: object, where: str) -> str:
    """A string, or a list of text parts joined by newlines (as llama.cpp joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(
            f'{where}: "content" is a {_kind(content)}, not a string or a list of text parts'
        )
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise UserError(
                f'{where}: content[{j}] is not a text part ({{"type": "text", "text": "..."}}); '
                "only text is supported"
            )
        if not isinstance(part.get("text"), str):
            raise UserError(f'{where}: content[{j}] has no "text" string')
        texts.append(part["text"])
    return "\n".join(texts)


def _kind(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "list",
        dict: "object",
    }.get(type(value), type(value).__name__)


def template_override(spec: str, use_jinja: bool = True) -> str:
    """--chat-template: a built-in template name as it is, or a template file's text: as
    Jinja (checked to compile), or with --no-jinja only if llama.cpp recognises it
    (checked as llama.cpp's common_chat_verify_template does)."""
    names = builtin_chat_templates()
    if spec in names:
        return spec
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"--chat-template {spec}: neither a file nor one of llama.cpp's built-in "
            f"templates ({', '.join(names)})"
        )
    text = _read_template(path, "--chat-template")
    if use_jinja:
        return text
    if apply_chat_template(text, [("user", "test")], True) is None:
        raise UserError(
            f"llama.cpp does not recognise the chat template in {path}: it does not run Jinja, "
            "it only picks one of its built-in formats by markers in a template; pass a "
            "built-in name to --chat-template instead, or drop --no-jinja"
        )
    return text


def _read_template(path: Path, flag: str) -> str:
    text = _read_text(path, f"{flag}: {path} not found; check the path")
    if "{%" in text or "{{" in text:
        jinja.compile_template(text)  # a syntax error now, in one line, not per request
    return text


def conversation(prompt: str | None, options: ChatOptions) -> list[Message]:
    """The messages to format: system message, history, then the prompt as a user turn."""
    messages = [Message("system", options.system)] if options.system else []
    messages += options.history
    if prompt is not None:
        messages.append(Message("user", prompt))
    return messages


def with_markers(text: str, n: int, marker: str) -> str:
    """`text` with a marker for each of n images or audio clips, as llama.cpp's mtmd-cli
    places them: where the text holds markers already, as it is; else all before it."""
    return text if marker in text else marker * n + text


def with_media_markers(messages: list[Message], n: int, marker: str) -> list[Message]:
    """A conversation with a marker for each of n images or audio clips: where its
    messages hold markers already, as they are; else before the text of the last user
    message (with_markers)."""
    if any(marker in m.content for m in messages):
        return messages
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise UserError("images and audio go in a user message; the conversation has none")
    last = messages[users[-1]]
    marked = Message(last.role, with_markers(last.content, n, marker))
    return [*messages[: users[-1]], marked, *messages[users[-1] + 1 :]]


TOOLS_NEED_JINJA = (
    "tools need the model's Jinja template (llama.cpp's built-in formats cannot describe "
    "them); drop --no-jinja, or name a Jinja template file"
)


def runs_jinja(template: str, format: ChatFormat) -> bool:
    """Whether `template` renders as Jinja (which can describe tools), or as one of
    llama.cpp's built-in formats."""
    return format.jinja and template not in builtin_chat_templates()


def render(
    model: Model,
    messages: list[Message],
    format: ChatFormat | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation in the model's chat format, ready for the assistant's reply;
    `tools`: the functions the model may call, for the template to describe.

    If the last message is the assistant's, the reply continues it (a prefill, as
    llama-server does): the turns before it are formatted, then its text follows the
    assistant's header.
    """
    format = format or ChatFormat()
    template = format.template or model.chat_template()
    if template is None:
        raise UserError(
            f"{model.path.name} has no chat template in its metadata; name its format with "
            "--chat-template (e.g. chatml, llama3, gemma) or --chat-template-file, or drop "
            "--chat and write the prompt in the model's format yourself"
        )
    prefill = messages[-1].content if messages[-1].role == "assistant" else None
    turns = messages[:-1] if prefill is not None else messages
    if runs_jinja(template, format):
        text = _render_jinja(model, template, turns, format.kwargs, tools)
    elif tools:
        raise UserError(TOOLS_NEED_JINJA)
    else:
        text = _render_builtin(model, template, turns)
    return text + (prefill or "")


def _render_builtin(model: Model, template: str, turns: list[Message]) -> str:
    text = apply_chat_template(template, [(m.role, m.content) for m in turns], True)
    if text is None:
        raise UserError(
            f"llama.cpp does not recognise the chat template of {model.path.name} (with "
            "--no-jinja it knows only its built-in formats); drop --no-jinja, name the format "
            "with --chat-template, or drop --chat and format the prompt yourself"
        )
    return text


def _render_jinja(
    model: Model,
    template: str,
    turns: list[Message],
    kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None,
) -> str:
    bos, eos = model.token_text(model.bos), model.token_text(model.eos)
    return render_jinja(template, turns, bos_token=bos, eos_token=eos, kwargs=kwargs, tools=tools)


def render_jinja(
    template: str,
    turns: list[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The template run as Jinja. A template without a system role (it raises, or leaves
    the system message out) gets it at the start of the first user turn instead, as
    llama-server does."""
    special = {"bos_token": bos_token, "eos_token": eos_token, "extra": kwargs, "tools": tools}

    def run(messages: list[Message]) -> str:
        return jinja.render(template, [m.as_dict() for m in messages], **special)

    merged = _system_in_first_user_turn(turns)
    try:
        text = run(turns)
    except jinja.TemplateRaised:
        if merged is None:
            raise
        return run(merged)
    takes_system = merged is None or turns[0].content.strip() in text
    return text if takes_system else run(merged)


def _system_in_first_user_turn(turns: list[Message]) -> list[Message] | None:
    if len(turns) < 2 or turns[0].role != "system" or turns[1].role != "user":
        return None
    first = Message("user", f"{turns[0].content}\n{turns[1].content}")
    return [first, *turns[2:]]


def chat_tokens(model: Model, text: str) -> list[int]:
    """Tokenize formatted chat text as llama-completion does (common_tokenize with
    add_special and parse_special), without a doubled BOS.

    The vocabulary's BOS is added when its add-BOS flag is set, so templates that do not
    write BOS (Llama 3, Gemma) still start with it. When the template writes BOS too, one
    is dropped: llama.cpp's Jinja path (common/chat.cpp) strips a template's leading BOS
    for the same reason.
    """
    tokens = model.tokenize(text, add_special=True, parse_special=True)
    if model.add_bos and tokens[:2] == [model.bos, model.bos]:
        del tokens[0]
    return tokens


def own_chat_tokens(model: Model, messages: list[Message]) -> list[int]:
    """The conversation in the model's own chat format, for a draft of another vocabulary
    (the target's format may be markers the draft has no tokens for). A draft without a
    format it can use gets the messages' text, a paragraph each: it needs the words."""
    try:
        return chat_tokens(model, render(model, messages))
    except UserError:
        return model.tokenize("\n\n".join(m.content for m in messages))
