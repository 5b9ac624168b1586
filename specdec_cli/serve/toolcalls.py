"""Tool calls in a model's reply, in the formats llama-server parses, chosen from the
chat template as llama-server chooses:

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- Llama 3.x: the reply is `{"name": ..., "parameters": {...}}`, or follows `<|python_tag|>`;
- generic (any other template): the reply is JSON, `{"tool_call": {...}}`,
  `{"tool_calls": [...]}` or a call itself.

The reply's text arrives in pieces. Text before a call streams as content; from the
first sign of a call (its marker, or a reply that starts with "{") the rest is held and
parsed when the reply ends. A reply that held text but holds no valid call is content
after all: nothing the model wrote is dropped. The parser only reads the text, so
speculation goes on as ever.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec_cli.decoding.grammar import JSON_WHITESPACE, check_schema_depth
from specdec_cli.decoding.textstream import tail_starting
from specdec_cli.serve.reasoning import END, START

HERMES, MISTRAL, LLAMA3, GENERIC = "hermes", "mistral", "llama3", "generic"
# The texts a reply in each format must keep, though they may be control tokens
# (which llama.cpp otherwise writes as nothing); the first begins a call.
MARKER_TEXTS = {HERMES: ("<tool_call>", "</tool_call>"), MISTRAL: ("[TOOL_CALLS]",),
                LLAMA3: ("<|python_tag|>",), GENERIC: ()}  # fmt: skip
# Where a reply that must call thinks first: the prompt opened the block, or the model may.
THOUGHTS_OPEN, THOUGHTS_OPTIONAL = "open", "optional"
_ANY = "(.|\\n)*"  # any text, in llguidance's regex
_END_TEXT = re.escape(END).replace("/", "\\/")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# A $ref to a part of its own document, in JSON text as json.dumps writes it.
_LOCAL_REF = re.compile(r'"\$ref": "#(?=[/"])')


def format_for(template: str) -> str:
    """The call format a chat template's model writes, by the template's markers."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return LLAMA3
    return GENERIC


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser:
    """Feed the reply as it comes: `feed` returns the content that may be shown now;
    `finish` the rest of the content and the calls."""

    def __init__(self, kind: str, parallel: bool = True) -> None:
        self.kind, self.parallel = kind, parallel
        self.marker = next(iter(MARKER_TEXTS[kind]), "")  # "" for the generic format
        # JSON formats: whether the reply begins with "{" (None: only white space so far)
        self.json_reply: bool | None = None if kind in (LLAMA3, GENERIC) else False
        self.pending = ""  # not shown yet: what may begin a call, or a call's text
        self.holding = False  # a call may have begun: hold the rest until the end

    def feed(self, text: str) -> str:
        """Only the text not shown yet is looked at: a piece's work does not grow with the
        reply."""
        self.pending += text
        if self.holding:
            return ""
        if self.json_reply is None:
            start = self.pending.lstrip()[:1]
            if not start:
                return ""  # nothing but white space yet: a JSON reply may follow
            self.json_reply = self.holding = start == "{"
            if self.holding:
                return ""
        at = self.pending.find(self.marker) if self.marker else -1
        if at >= 0:
            self.holding = True
            return self._show(at)
        return self._show(len(self.pending) - tail_starting(self.pending, self.marker))

    def finish(self) -> Parsed:
        rest, self.pending = self.pending, ""
        calls = self._parse(rest) if self.holding else []
        if not calls:
            return Parsed(rest)
        if not self.parallel:
            calls = calls[:1]
        return Parsed(_outside_calls(self.kind, rest), calls)

    def _show(self, end: int) -> str:
        out, self.pending = self.pending[:end], self.pending[end:]
        return out

    def _parse(self, text: str) -> list[ToolCall]:
        if self.kind == HERMES:
            return [c for body in _HERMES_CALL.findall(text) for c in _calls(_json(body))]
        # Mistral's marker always comes first (it is what started the holding); Llama
        # 3's may not (a reply that is JSON), nor the generic format's (it has none).
        body = text.split(self.marker, 1)[1] if self.marker and self.marker in text else text
        return _calls(_json(body))


def _outside_calls(kind: str, text: str) -> str:
    """The content a reply with calls keeps: for Hermes, what lies between the calls."""
    return _HERMES_CALL.sub("", text).strip() if kind == HERMES else ""


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _calls(value: Any) -> list[ToolCall]:
    """Calls from parsed JSON: one call, a list of calls, or {"tool_call(s)": ...}."""
    if isinstance(value, dict) and "tool_calls" in value:
        value = value["tool_calls"]
    elif isinstance(value, dict) and "tool_call" in value:
        value = value["tool_call"]
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            item = item["function"]  # OpenAI's own shape, as some models echo it
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return []  # not calls after all: the text is content
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(item["name"], arguments))
    return calls


def call_grammar(
    kind: str,
    tools: list[dict[str, Any]],
    parallel: bool,
    marker: Callable[[str], str],
    thinking: str | None = None,
) -> str:
    """Lark for llguidance (see decoding/grammar.py): a reply that is nothing but calls of
    `tools`, in the format `kind`, as this parser reads them; at most one unless
    `parallel`. Each call's arguments follow its function's parameter schema.
    `marker(text)`: a marker in Lark (a special token where the vocabulary has one).
    `thinking`: THOUGHTS_OPEN where the prompt left the reply inside a thinking block (its
    thoughts run free up to the end marker, then the calls), THOUGHTS_OPTIONAL where the
    model may open one itself; None where it does not think."""
    arguments = "parameters" if kind == LLAMA3 else "arguments"
    # llama.cpp's whitespace between JSON tokens (llguidance's default has no limit)
    spacing = {"whitespace_pattern": JSON_WHITESPACE}
    defs = {_def_name(i): _parameters(tool["function"], i) for i, tool in enumerate(tools)}
    calls = [_call_schema(tool["function"], arguments, i) for i, tool in enumerate(tools)]
    call = {"anyOf": calls, "x-guidance": spacing, "$defs": defs}
    many: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        many["maxItems"] = 1
    start = _start(thinking, marker)
    if kind == HERMES:
        opening, closing = marker("<tool_call>"), marker("</tool_call>")
        repeat = "+" if parallel else ""
        return (
            f"{start}calls: (call NL?){repeat}\n"
            f"call: {opening} NL? {_lark_json(call)} NL? {closing}\n"
            "NL: /\\n/\n"
        )
    if kind == MISTRAL:
        many["x-guidance"], many["$defs"] = spacing, defs
        return f"{start}calls: {marker('[TOOL_CALLS]')} {_lark_json(many)}\n"
    if kind == LLAMA3:
        return f"{start}calls: {_lark_json(call)}\n"
    generic = {
        "type": "object",
        "properties": {"tool_calls": many},
        "required": ["tool_calls"],
        "additionalProperties": False,
        "x-guidance": spacing,
        "$defs": defs,
    }
    return f"{start}calls: {_lark_json(generic)}\n"


def _start(thinking: str | None, marker: Callable[[str], str]) -> str:
    """The start rule, before `calls`: thoughts first where the reply may think. They run
    free until the end marker: where it is a special token, text that never spells it,
    then the token; where it is text, a lazy lexeme that ends at its first occurrence (a
    greedy one would read past it: llguidance's lexer never backtracks)."""
    if thinking is None:
        return "start: calls\n"
    end = marker(END)
    if end.startswith("<["):
        thoughts = f"thoughts: THOUGHT {end}\nTHOUGHT: /{_ANY}/ & ~/{_ANY}{_END_TEXT}{_ANY}/\n"
    else:
        thoughts = f"thoughts[lazy]: /{_ANY}{_END_TEXT}/\n"
    block = "thoughts SPACE?"
    if thinking == THOUGHTS_OPTIONAL:
        block = f"({marker(START)} {block})?"
    # white space between the thoughts and the calls, bounded as JSON_WHITESPACE is: a model
    # indifferent to it must not pad there until max_tokens
    return f"start: {block} calls\n{thoughts}SPACE: /[ \\t\\r\\n]{{1,4}}/\n"


def _lark_json(schema: dict[str, Any]) -> str:
    """`schema` as Lark's %json, once its depth is known to be safe for llguidance (a
    parameters schema whose $refs chain deep would overflow its compiler's stack)."""
    check_schema_depth(schema)
    return f"%json {json.dumps(schema)}"


def _call_schema(function: dict[str, Any], arguments: str, index: int) -> dict[str, Any]:
    """A call of the `index`th tool: its arguments are its parameters, lifted into the
    combined schema's $defs (see _parameters)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments: {"$ref": f"#/$defs/{_def_name(index)}"},
        },
        "required": ["name", arguments],
        "additionalProperties": False,
    }


def _def_name(index: int) -> str:
    return f"tool_{index}_parameters"


def _parameters(function: dict[str, Any], index: int) -> Any:
    """The tool's parameters schema, as it stands in the combined schema's $defs: its
    $refs within itself ("#/$defs/Pet", as Pydantic writes them) rewritten to start from
    there, for they are resolved against the combined schema's root. Its depth is
    checked first: the rewriting recurses."""
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        return {"type": "object"}
    check_schema_depth(parameters)
    return _rebased(parameters, f"#/$defs/{_def_name(index)}")


def _rebased(schema: dict[str, Any], base: str) -> Any:
    """`schema` with every $ref to a part of its own document ("#", "#/...") made a $ref
    to the same part under `base`: rewritten in its JSON text, where such a $ref can only
    be a key and its value (a string's quotes are escaped within it)."""
    text = _LOCAL_REF.sub(lambda _: f'"$ref": "{base}', json.dumps(schema))
    return json.loads(text)
