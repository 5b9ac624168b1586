"""Where output goes: generated text on stdout, stats on stderr.

On a terminal the stats are live (rich); anywhere else they are one plain line at
the end, so that pipes and log files stay parseable.
"""

from __future__ import annotations

import sys
from typing import Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from specdec_cli.stats import Stats


def warn(message: str) -> None:
    print(f"specdec: warning: {message}", file=sys.stderr)


def stats_line(stats: Stats) -> Text:
    line = Text()
    line.append(f"{stats.tokens_per_second:7.1f} tok/s", style="bold green")
    line.append(f"  {stats.tokens} tokens")
    if stats.drafted:
        line.append(f"  accept {stats.acceptance_rate:6.1%}", style="cyan")
        line.append(f" ({stats.accepted}/{stats.drafted})")
        line.append(f"  {stats.tokens_per_pass:4.2f} tok/pass", style="magenta")
        line.append(f"  k={stats.k}")
        if stats.draft_lengths:
            line.append(f" (last {stats.last_k}, mean {stats.mean_k:.2f})")
    return line


class Display(Protocol):
    def text(self, chunk: str) -> None: ...

    def update(self, stats: Stats) -> None: ...

    def finish(self, stats: Stats) -> None: ...


class PlainDisplay:
    """Text straight to stdout; one summary line on stderr at the end."""

    def __init__(self, show_text: bool = True, summary: bool = True) -> None:
        self.show_text = show_text
        self.summary = summary

    def text(self, chunk: str) -> None:
        if self.show_text:
            sys.stdout.write(chunk)
            sys.stdout.flush()

    def update(self, stats: Stats) -> None:
        pass

    def finish(self, stats: Stats) -> None:
        if self.show_text:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if self.summary:
            print(f"specdec: {stats.summary()}", file=sys.stderr)


class LiveDisplay:
    """Live stats under the text on a terminal.

    When stdout is that same terminal, the text goes through rich too: finished lines
    are printed above the live area and the line being written stays inside it, so the
    text streams token by token without the two fighting over the cursor.
    """

    def __init__(self, show_text: bool = True, summary: bool = True) -> None:
        self.console = Console(stderr=True)
        self.show_text = show_text
        self.summary = summary
        self.text_in_live = show_text and sys.stdout.isatty()
        self._line = ""
        self._stats: Stats | None = None
        self.live = Live(
            get_renderable=self._render,
            console=self.console,
            refresh_per_second=4,
            transient=True,
        )
        self.live.start()

    def _render(self) -> Group:
        parts = [Text(self._line)] if self._line else []
        if self._stats is not None:
            parts.append(stats_line(self._stats))
        return Group(*parts)

    def text(self, chunk: str) -> None:
        if not self.show_text:
            return
        if not self.text_in_live:
            sys.stdout.write(chunk)
            sys.stdout.flush()
            return
        *done, self._line = (self._line + chunk).split("\n")
        for line in done:
            self.console.print(line, markup=False, highlight=False, emoji=False)

    def update(self, stats: Stats) -> None:
        self._stats = stats

    def finish(self, stats: Stats) -> None:
        self.live.stop()
        if self.text_in_live:
            self.console.print(self._line, markup=False, highlight=False, emoji=False)
        elif self.show_text:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if self.summary:
            self.console.print(stats_line(stats).append(f"  stop: {stats.stop_reason}"))


def make_display(as_json: bool, quiet: bool) -> Display:
    """Live stats on a terminal unless quiet; with --json the JSON replaces text and summary."""
    if not quiet and sys.stderr.isatty():
        return LiveDisplay(show_text=not as_json, summary=not as_json)
    return PlainDisplay(show_text=not as_json, summary=not (as_json or quiet))
