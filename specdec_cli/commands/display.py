"""Where output goes: generated text on stdout, stats on stderr.

On a terminal the stats are live (rich); anywhere else they are one plain line at
the end, so that pipes and log files stay parseable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from specdec_cli.commands.bench import BenchReport
from specdec_cli.decoding.stats import Stats
from specdec_cli.errors import UserError
from specdec_cli.messages import warn


def stats_line(stats: Stats, width: int, final: bool = False) -> Text:
    """The live (or, when `final`, the closing) stats on one line of at most `width`
    columns: the parts that do not fit are left out whole, the least important first."""
    parts = [(f"{stats.tokens_per_second:.1f} tok/s", "bold green"), (f"{stats.tokens} tokens", "")]
    if stats.drafted:
        parts.append(
            (f"accept {stats.acceptance_rate:.1%} ({stats.accepted}/{stats.drafted})", "cyan")
        )
        parts.append((f"{stats.tokens_per_pass:.2f} tok/pass", "magenta"))
        k = f"k={stats.k}"
        if stats.draft_lengths:
            k += f" (last {stats.last_k}, mean {stats.mean_k:.2f})"
        parts.append((k, ""))
        if stats.tree != "off":
            parts.append((f"tree={stats.tree} depth {stats.accepted_depth:.2f}", ""))
    if final:
        parts.append((f"stop: {stats.stop_reason}", ""))
        if stats.seed is not None:
            parts.append((f"seed {stats.seed}", ""))
        if stats.flash_attn:
            parts.append((f"-fa {stats.flash_attn}", ""))
    line = Text()
    for text, style in parts:
        separator = "  " if line else ""
        if len(line) + len(separator) + len(text) > width - 1:  # the last column wraps
            continue
        line.append(separator)
        line.append(text, style=style)
    return line


# --color: accepted draft tokens in one colour, the target's own in another.
DRAFTED_COLOR, TARGET_COLOR = "green", "yellow"
_SGR = {DRAFTED_COLOR: "\x1b[32m", TARGET_COLOR: "\x1b[33m"}  # ANSI foreground colours
_RESET = "\x1b[0m"


class Display(Protocol):
    """Shows generated text as it comes, and the Stats it was given as they change."""

    def text(self, chunk: str, drafted: bool = False) -> None: ...

    def finish(self) -> None: ...


def _style(drafted: bool, color: bool) -> str:
    """The colour of a piece of text ("" for none)."""
    if not color:
        return ""
    return DRAFTED_COLOR if drafted else TARGET_COLOR


def _write_stdout(chunk: str, style: str) -> None:
    sys.stdout.write(f"{_SGR[style]}{chunk}{_RESET}" if style else chunk)
    sys.stdout.flush()


class PlainDisplay:
    """Text straight to stdout; one summary line on stderr at the end."""

    def __init__(
        self, stats: Stats, show_text: bool = True, summary: bool = True, color: bool = False
    ) -> None:
        self.stats = stats
        self.show_text = show_text
        self.summary = summary
        self.color = color

    def text(self, chunk: str, drafted: bool = False) -> None:
        if self.show_text:
            _write_stdout(chunk, _style(drafted, self.color))

    def finish(self) -> None:
        if self.show_text:
            _write_stdout("\n", "")
        if self.summary:
            print(f"specdec: {self.stats.summary()}", file=sys.stderr)


def same_terminal(a: TextIO, b: TextIO) -> bool:
    """Whether both streams write to the same terminal (stdout and stderr on one screen)."""
    try:
        return a.isatty() and b.isatty() and os.path.sameopenfile(a.fileno(), b.fileno())
    except (OSError, ValueError):
        return False


class LiveDisplay:
    """Live stats under the text on a terminal.

    When stdout is that same terminal, the text goes through rich too: finished lines
    are printed above the live area and the line being written stays inside it, so the
    text streams token by token without the two fighting over the cursor.
    """

    def __init__(
        self, stats: Stats, show_text: bool = True, summary: bool = True, color: bool = False
    ) -> None:
        self.console = Console(stderr=True)
        self.stats = stats  # read at each refresh, as the decode loop updates it
        self.show_text = show_text
        self.summary = summary
        self.color = color
        self.text_in_live = show_text and same_terminal(sys.stdout, sys.stderr)
        self._line = Text()
        # rich's Live would otherwise capture stdout and print it on stderr's console:
        # `specdec run ... > out.txt` must leave the text in out.txt.
        self.live = Live(
            get_renderable=self._render,
            console=self.console,
            refresh_per_second=4,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()

    def _render(self) -> Group:
        parts = [self._line] if self._line else []
        return Group(*parts, stats_line(self.stats, self.console.width))

    def text(self, chunk: str, drafted: bool = False) -> None:
        if not self.show_text:
            return
        style = _style(drafted, self.color)
        if not self.text_in_live:
            _write_stdout(chunk, style)
            return
        first, *rest = chunk.split("\n")
        self._line.append(first, style=style)
        for line in rest:
            self._print_line()
            self._line.append(line, style=style)

    def _print_line(self) -> None:
        self.console.print(self._line, highlight=False, emoji=False)
        self._line = Text()

    def finish(self) -> None:
        self.live.stop()
        if self.text_in_live:
            self._print_line()
        elif self.show_text:
            _write_stdout("\n", "")
        if self.summary:
            self.console.print(stats_line(self.stats, self.console.width, final=True))


def make_display(stats: Stats, as_json: bool, quiet: bool, color: bool = False) -> Display:
    """Live stats on a terminal unless quiet; with --json the JSON replaces text and summary.
    `color` (who chose each token) only where the text goes to a terminal."""
    color = color and not as_json and sys.stdout.isatty()
    if not quiet and sys.stderr.isatty():
        return LiveDisplay(stats, show_text=not as_json, summary=not as_json, color=color)
    return PlainDisplay(stats, show_text=not as_json, summary=not (as_json or quiet), color=color)


BENCH_COLUMNS = (
    "variant",
    "tok/s",
    "min-max",
    "speedup",
    "accept",
    "tok/pass",
    "draft",
    "verify",
    "other",
    "ideal",
    "effic.",
)


def bench_rows(figures: dict) -> list[list[str]]:
    """One row of text per variant, from BenchReport.to_dict()'s figures."""
    rows = []
    for d in [figures["baseline"], *figures["runs"]]:
        share = d["time_share"]
        speculative = d["drafter"] is not None
        rows.append(
            [
                d["name"] + (" *" if speculative and d["name"] == figures["best"] else ""),
                f"{d['tokens_per_second']:.1f}",
                f"{d['tokens_per_second_min']:.1f}-{d['tokens_per_second_max']:.1f}",
                f"{d['speedup']:.2f}x",
                f"{d['acceptance_rate']:.1%}" if speculative else "-",
                f"{d['tokens_per_pass']:.2f}",
                f"{share['draft']:.0%}",
                f"{share['verify']:.0%}",
                # Outside the decode calls, undoing rejected drafts included.
                f"{share['other'] + share['rollback']:.0%}",
                f"{d['theoretical_speedup']:.2f}x" if speculative else "-",
                f"{d['efficiency']:.0%}" if speculative else "-",
            ]
        )
    return rows


CATEGORY_COLUMNS = (
    "category",
    "variant",
    "tok/s",
    "speedup",
    "paired (range)",
    "tok/pass",
    "accept",
    "k mean",
)


def category_rows(figures: dict) -> list[list[str]]:
    """One row of text per category and variant (the target alone first), from
    BenchReport.to_dict()'s figures; none without categories."""
    entries = [figures["baseline"], *figures["runs"]]
    rows = []
    for category in figures["baseline"]["categories"]:
        for d in entries:
            c = d["categories"][category]
            speculative = d["drafter"] is not None
            rows.append(
                [
                    category,
                    d["name"],
                    f"{c['tokens_per_second']:.1f}",
                    f"{c['speedup']:.2f}x",
                    paired_text(c) if speculative else "-",
                    f"{c['tokens_per_pass']:.2f}",
                    f"{c['acceptance_rate']:.1%}" if speculative else "-",
                    f"{c['k_mean']:.2f}" if speculative else "-",
                ]
            )
    return rows


def paired_text(figures: dict) -> str:
    """The median of the repeats' paired speedups, and their range (see
    BenchReport.paired_figures): whether a category's gain or loss is more than the
    repeats' spread."""
    low, high = figures["paired_speedup_min"], figures["paired_speedup_max"]
    return f"{figures['paired_speedup']:.2f}x ({low:.2f}-{high:.2f})"


FILTERS = ("top_k", "top_p", "min_p")  # SamplingParams' filters, by their flags' order


def sampling_flags(settings: dict[str, Any]) -> str:
    """How the bench sampled, as the flags that sample so ("greedy" when it did not)."""
    sampling = settings["sampling"]
    if sampling["temp"] <= 0:
        return "greedy"
    flags = " ".join(f"--{name.replace('_', '-')} {sampling[name]}" for name in FILTERS)
    coupled = " --coupled" if sampling["coupled"] else ""
    return f"--temp {sampling['temp']} {flags}{coupled} --seed {settings['seed']}"


def print_bench(report: BenchReport) -> None:
    """A rich table on a terminal; whitespace-separated columns when piped. Both show
    the figures `--json` writes, computed once."""
    figures = report.to_dict()
    for message in figures["warnings"]:
        warn(message)
    rows = bench_rows(figures)
    settings = f"settings: -fa {report.flash_attn}, {sampling_flags(figures['settings'])}"
    grammar = figures["settings"].get("grammar")
    if grammar:
        settings += f", under a grammar ({grammar['kind'].replace('_', ' ')})"
    c = report.costs
    costs = (
        f"costs: target {c.target_seconds * 1e3:.2f} ms/token, "
        f"draft {c.draft_over_target:.3f} of that, verify n tokens: "
        + " ".join(f"{n}:{v:.2f}" for n, v in sorted(c.verify.items()))
    )
    base = figures["baseline"]
    wrapper = (
        f"target only, all runs: {base['tokens_per_second_all_runs']:.1f} tok/s by our clock, "
        f"{base['llama_cpp_tokens_per_second']:.1f} by llama.cpp's own clock of its decode "
        f"calls ({1 - base['overhead_share']:.1%}); our overhead in speculative runs: "
        + ", ".join(f"{d['name']} {d['overhead_share']:.1%}" for d in figures["runs"])
    )
    by_category = category_rows(figures)
    if not sys.stdout.isatty():
        print("\t".join(BENCH_COLUMNS))
        for row in rows:
            print("\t".join(row))
        if by_category:  # a second table, after a blank line
            print()
            print("\t".join(CATEGORY_COLUMNS))
            for row in by_category:
                print("\t".join(row))
        print(f"# {settings}")
        print(f"# {costs}")
        print(f"# {wrapper}")
        print(f"# {figures['verdict']}")
        return
    table = Table(
        title=f"{report.n_prompts} {'prompts' if report.workload.chat is None else 'questions'} "
        f"x {report.repeat} repeats, "
        f"{report.n_predict} tokens each (medians over repeats)"
    )
    for name in BENCH_COLUMNS:
        table.add_column(name, justify="left" if name == "variant" else "right")
    for row in rows:
        table.add_row(*row, style="bold green" if row[0].endswith(" *") else None)
    console = Console()
    console.print(table)
    if by_category:
        console.print(category_table(by_category, len(figures["runs"]) + 1))
    console.print(settings, style="dim")
    console.print(costs, style="dim")
    console.print(wrapper, style="dim")
    console.print(
        "draft / verify / other: shares of wall time; ideal: the speedup with zero "
        "overhead at this acceptance; effic.: speedup / ideal",
        style="dim",
    )
    console.print(figures["verdict"], style="bold")


def category_table(rows: list[list[str]], per_category: int) -> Table:
    """The rows of category_rows as a rich table: each category's name once, over its
    `per_category` rows (one a variant)."""
    table = Table(title="by category (medians over repeats)")
    for name in CATEGORY_COLUMNS:
        table.add_column(name, justify="left" if name in ("category", "variant") else "right")
    for i, row in enumerate(rows):
        first = i % per_category == 0
        if first and i:
            table.add_section()
        table.add_row(row[0] if first else "", *row[1:])
    return table


def load_pyplot():
    """matplotlib's pyplot, or a clear error: call it before a long run, not after."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "--plot needs matplotlib: pip install 'specdec-cli[plot]' (or drop --plot)"
        ) from None
    return plt


def plot_figure(report: BenchReport, plt):
    """tokens/s and acceptance rate against k, one line per drafter; -k auto is a point
    of its own at the mean k it chose. With categories, below them the speedup of each
    variant by category."""
    if not report.workload.categories:
        fig, (speed_ax, accept_ax) = plt.subplots(1, 2, figsize=(10, 4))
    else:
        mosaic = [["speed", "accept"], ["category", "category"]]
        fig, axes = plt.subplot_mosaic(mosaic, figsize=(10, 8))
        speed_ax, accept_ax = axes["speed"], axes["accept"]
        plot_categories(report, axes["category"])
    base = report.median_speed(report.baseline)
    speed_ax.axhline(base, color="grey", linestyle="--", label="target only")
    lines = dict.fromkeys((r.variant.drafter, r.variant.tree) for r in report.results[1:])
    for drafter, tree in lines:
        mine = [
            r for r in report.results[1:] if (r.variant.drafter, r.variant.tree) == (drafter, tree)
        ]
        if tree != "off":
            drafter = f"{drafter}, tree={tree}"
        for auto in (False, True):
            runs = [r for r in mine if (r.variant.k == "auto") == auto]
            if not runs:
                continue
            ks = [r.total().mean_k if auto else int(r.variant.k) for r in runs]
            style = {"marker": "*", "markersize": 12, "linestyle": "none"} if auto else {}
            label = f"{drafter}, k=auto (at its mean k)" if auto else drafter
            speeds = [report.median_speed(r) for r in runs]
            speed_ax.plot(ks, speeds, label=label, **({"marker": "o"} | style))
            accept = [r.total().acceptance_rate for r in runs]
            accept_ax.plot(ks, accept, label=label, **({"marker": "o"} | style))
    speed_ax.set(xlabel="k", ylabel="tokens/s", title="speed")
    speed_ax.set_ylim(bottom=0)  # speeds compared by height: the axis starts at 0
    accept_ax.set(xlabel="k", ylabel="acceptance rate", title="acceptance", ylim=(0, 1))
    speed_ax.legend()
    accept_ax.legend()
    fig.tight_layout()
    return fig


def plot_categories(report: BenchReport, ax) -> None:
    """Bars of each speculative variant's speedup in each category, side by side; a line
    at 1x, the target alone."""
    categories = report.workload.categories
    runs = report.results[1:]
    width = 0.8 / max(len(runs), 1)
    for j, result in enumerate(runs):
        x = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(categories))]
        speedups = [report.speedup(result, among) for among in categories.values()]
        ax.bar(x, speedups, width, label=result.variant.name)
    ax.axhline(1.0, color="grey", linestyle="--", label="target only")
    ax.set_xticks(range(len(categories)), list(categories), rotation=30, ha="right")
    ax.set(ylabel="speedup", title="speedup by category")
    ax.legend()


def write_plot(report: BenchReport, path: str) -> None:
    plt = load_pyplot()
    fig = plot_figure(report, plt)
    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise UserError(f"cannot write the plot to {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)


@contextmanager
def bench_progress(total: int) -> Iterator[Callable[[str, int], None]]:
    """A progress bar on a terminal (a sweep takes minutes), saying what is being done;
    nothing otherwise. The callback takes that and how many runs it finished."""
    if not sys.stderr.isatty():
        yield lambda name, steps: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("benchmark", total=total)
        yield lambda name, steps: progress.update(task, advance=steps, description=name)
