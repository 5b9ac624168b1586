"""Chat prompts: a conversation, formatted with a chat template, tokenized as llama.cpp does.

The formatting is llama.cpp's own llama_chat_apply_template, as in llama-completion
without --jinja: it knows a fixed set of formats (llama_chat_builtin_templates) and picks
one by name, or by markers in a template's text; it does not run Jinja. A template it
does not recognise is refused, never guessed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Model, apply_chat_template, builtin_chat_templates

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; llama.cpp maps it the same way (common/chat.cpp).
ROLE_ALIASES = {"developer": "system"}
MESSAGES_FORMAT = 'a JSON list of {"role": ..., "content": "..."} objects'


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatOptions:
    """How to wrap a prompt in the model's chat format.

    The conversation is: the system message, the history, then the prompt as the last
    user turn (when there is a prompt). `template` is a built-in template name or the
    text of a template llama.cpp recognises; None uses the model's own.
    """

    system: str | None = None
    history: tuple[Message, ...] = ()
    template: str | None = None


def chat_options(
    chat: bool,
    system: str | None,
    messages: str | None,
    template: str | None,
    prompt: str | None,
) -> ChatOptions | None:
    """The chat settings the command line asks for, read and checked; None for a plain
    prompt. --system, --messages and --chat-template each imply --chat."""
    if not (chat or system is not None or messages is not None or template is not None):
        return None
    if messages == "-" and prompt == "-":
        raise UserError("stdin can feed --messages or -p, not both; put one of them in a file")
    history = read_messages(messages) if messages is not None else ()
    if system and any(m.role == "system" for m in history):
        raise UserError(
            f"--system and the system message in {messages} would be two system messages; "
            "keep one of them"
        )
    return ChatOptions(system, history, template_override(template) if template else None)


def read_messages(source: str) -> tuple[Message, ...]:
    """Messages from a JSON file, or from stdin for '-'."""
    if source == "-":
        return parse_messages(sys.stdin.read(), "stdin")
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"messages file not found: {path}; check the path") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    return parse_messages(text, str(path))


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
    for field in ("role", "content"):
        if field not in item:
            raise UserError(f'{where} has no "{field}"; each message is {{"role", "content"}}')
    role = item["role"]
    if not isinstance(role, str):
        raise UserError(f'{where}: "role" is a {_kind(role)}, not a string')
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise UserError(f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)}")
    return Message(role, _content(item["content"], where))


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


def template_override(spec: str) -> str:
    """--chat-template: a built-in template name as it is, or a template file's text if
    llama.cpp recognises it (checked as llama.cpp's common_chat_verify_template does)."""
    names = builtin_chat_templates()
    if spec in names:
        return spec
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"--chat-template {spec}: neither a file nor one of llama.cpp's built-in "
            f"templates ({', '.join(names)})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    if apply_chat_template(text, [("user", "test")], True) is None:
        raise UserError(
            f"llama.cpp does not recognise the chat template in {path}: it does not run Jinja, "
            "it only picks one of its built-in formats by markers in a template; pass a "
            "built-in name to --chat-template instead"
        )
    return text


def conversation(prompt: str | None, options: ChatOptions) -> list[Message]:
    """The messages to format: system message, history, then the prompt as a user turn."""
    messages = [Message("system", options.system)] if options.system else []
    messages += options.history
    if prompt is not None:
        messages.append(Message("user", prompt))
    return messages


def render(model: Model, messages: list[Message], template: str | None = None) -> str:
    """The conversation in the model's chat format, ready for the assistant's reply.

    If the last message is the assistant's, the reply continues it (a prefill, as
    llama-server does): the turns before it are formatted, then its text follows the
    assistant's header.
    """
    template = template or model.chat_template()
    if template is None:
        raise UserError(
            f"{model.path.name} has no chat template in its metadata; name its format with "
            "--chat-template (e.g. chatml, llama3, gemma), or drop --chat and write the "
            "prompt in the model's format yourself"
        )
    prefill = messages[-1].content if messages[-1].role == "assistant" else None
    turns = messages[:-1] if prefill is not None else messages
    text = apply_chat_template(template, [(m.role, m.content) for m in turns], True)
    if text is None:
        raise UserError(
            f"llama.cpp does not recognise the chat template of {model.path.name} (it does not "
            "run Jinja, it only knows its built-in formats); name the format with "
            "--chat-template, or drop --chat and format the prompt yourself"
        )
    return text + (prefill or "")


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
