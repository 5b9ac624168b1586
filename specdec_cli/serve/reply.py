"""What a chat reply's text becomes in the API: thinking (reasoning_content), the answer
(content) and tool calls, parted as the text streams (reasoning.py, then toolcalls.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec_cli.serve.reasoning import ThinkingSplitter
from specdec_cli.serve.toolcalls import ToolCall, ToolCallParser


@dataclass
class Part:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def __add__(self, other: Part) -> Part:
        return Part(
            self.content + other.content,
            self.reasoning + other.reasoning,
            self.calls + other.calls,
        )


class ReplyParser:
    """Feed the reply's text as it comes; each call returns what may be sent now."""

    def __init__(self, thinking: ThinkingSplitter | None, tools: ToolCallParser | None) -> None:
        self.thinking, self.tools = thinking, tools

    def feed(self, text: str) -> Part:
        if self.thinking is None:
            return self._answer(text)
        split = self.thinking.feed(text)
        return Part(reasoning=split.reasoning) + self._answer(split.content)

    def finish(self) -> Part:
        out = Part()
        if self.thinking is not None:
            split = self.thinking.finish()
            out = Part(reasoning=split.reasoning) + self._answer(split.content)
        if self.tools is not None:
            parsed = self.tools.finish()
            out += Part(parsed.content, calls=parsed.calls)
        return out

    def _answer(self, text: str) -> Part:
        return Part(self.tools.feed(text) if self.tools is not None else text)
