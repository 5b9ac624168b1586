"""`specdec bench` between its flags and its table: the workload, the drafters to
compare, the measurement with its progress bar, and the files it writes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from specdec_cli.commands.bench import (
    BUILTIN_PROMPTS,
    BenchOptions,
    BenchReport,
    Variant,
    run_bench,
)
from specdec_cli.commands.display import bench_progress, load_pyplot, write_plot
from specdec_cli.commands.options import split_drafts
from specdec_cli.commands.runner import loaded_engine
from specdec_cli.commands.workload import Workload, choose_workload
from specdec_cli.decoding.settings import EngineOptions, model_drafter_kind
from specdec_cli.errors import UserError
from specdec_cli.llamacpp.model import Model, init_backend
from specdec_cli.models.chat import ChatFormat
from specdec_cli.models.resolve import HEAD


def bench_workload(
    prompts: Path | None, suite: str | None, per_category: int | None, chat: ChatFormat
) -> Workload:
    """--prompts, --suite and --per-category; the chat flags shape questions only."""
    workload = choose_workload(prompts, suite, per_category, BUILTIN_PROMPTS)
    if workload.chat is None:
        if chat != ChatFormat():
            raise UserError(
                "--chat-template, --chat-template-file, --jinja and --chat-template-kwargs "
                "format questions (--suite, a .jsonl --prompts file); plain prompts go to "
                "the model as written: drop them"
            )
        return workload
    return replace(workload, chat=chat)


@contextmanager
def vocabulary(options: EngineOptions) -> Iterator[Model]:
    """The target's vocabulary alone (no weights): enough to size the context."""
    init_backend(options.verbose)
    model = Model(options.target, vocab_only=True)
    try:
        yield model
    finally:
        model.close()


def split_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def check_outputs(json_path: Path | None, plot_path: Path | None) -> None:
    """Fail now, not after minutes of measuring."""
    for path, flag in ((json_path, "--json"), (plot_path, "--plot")):
        if path:
            check_writable(path, flag)
    if plot_path:
        load_pyplot()


def check_writable(path: Path, flag: str) -> None:
    """Refuse, before any work, a path that a file cannot be written to."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: there is no directory {path.parent}; create it first")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable here; choose another path")


def drafter_kinds(drafts: list[str], ngram: bool | None) -> list[str]:
    """What -d names: each of a model (or the target's head, 'mtp') and 'ngram' alone, and
    both together (lookup first); a model alone drafts as `run` would (with lookup first,
    unless --no-ngram)."""
    if not drafts:
        raise UserError("nothing to compare: pass a draft model, 'mtp' and/or 'ngram' with -d")
    model_draft, lookup = split_drafts(drafts)
    model = HEAD if any(d.lower() == HEAD for d in drafts) else "model" if model_draft else None
    if model and not lookup:
        return [model_drafter_kind(ngram, model)]
    kinds = [kind for kind in (model, "ngram" if lookup else None) if kind]
    if len(kinds) == 2:
        kinds.append(f"{model}+ngram")
    return kinds


def measure(
    options: EngineOptions, variant_list: list[Variant], workload: Workload, plan: BenchOptions
) -> BenchReport:
    """Every variant on every prompt, as often as the plan says, with a progress bar."""
    with loaded_engine(options) as engine:
        total = len(variant_list) * workload.generations * plan.repeat
        with bench_progress(total) as advance:
            return run_bench(engine, variant_list, workload, plan, advance)


def write_outputs(report: BenchReport, json_path: Path | None, plot_path: Path | None) -> None:
    """--json and --plot."""
    if json_path:
        try:
            json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as err:
            raise UserError(f"cannot write {json_path}: {err.strerror or err}") from None
    if plot_path:
        write_plot(report, str(plot_path))
