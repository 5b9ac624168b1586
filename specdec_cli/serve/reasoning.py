"""A model's thinking, told apart from its answer: `<think>...</think>` (DeepSeek R1,
Qwen3) becomes `reasoning_content`, as llama-server's --reasoning-format deepseek does.

Text arrives in pieces, and a marker can be cut anywhere ("</thi" + "nk>"): what could
still be the start of a marker is held back until the next piece says. The thinking
counts only where the reply begins with it (after white space), or where the prompt
ended inside it: templates such as DeepSeek R1's open the section themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_cli.decoding.textstream import tail_starting

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ThinkingSplitter:
    """Feed the reply's text as it comes; each call returns what may be shown now."""

    def __init__(self, opened: bool = False) -> None:
        # "start": not yet known whether the reply thinks; then "thinking", "after"
        # (its end marker seen), "answer".
        self.state = "thinking" if opened else "start"
        self.held = ""

    def feed(self, text: str) -> Split:
        self.held += text
        out = Split()
        while self.held:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(START):
                    self.held, self.state = stripped[len(START) :], "thinking"
                elif START.startswith(stripped):  # white space, or "<thi": wait
                    break
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = self.held.find(END)
                if end < 0:
                    keep = tail_starting(self.held, END)
                    out.reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    break
                out.reasoning += self.held[:end]
                self.held, self.state = self.held[end + len(END) :], "after"
            elif self.state == "after":  # the white space between the two is neither's
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "answer"
            else:
                out.content += self.held
                self.held = ""
        return out

    def finish(self) -> Split:
        """The end of the reply: what was held back is what it seemed."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return Split(reasoning=held)
        return Split(content=held)


def opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves the reply inside the thinking section."""
    tail = prompt.rstrip()
    return tail.endswith(START)
