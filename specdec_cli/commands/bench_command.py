"""`specdec bench`: its flags, and the plan of variants it measures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specdec_cli.commands.bench import BenchOptions, fit_context, longest_k, variants, widest_tree
from specdec_cli.commands.benchjob import (
    bench_workload,
    check_outputs,
    drafter_kinds,
    measure,
    split_list,
    vocabulary,
    write_outputs,
)
from specdec_cli.commands.display import print_bench
from specdec_cli.commands.flags import (
    ConfigOpt,
    CoupledOpt,
    EngineFlags,
    FlagValues,
    GrammarFileOpt,
    GrammarOpt,
    JsonSchemaFileOpt,
    JsonSchemaOpt,
    MinPOpt,
    ModelOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    described,
    takes_chat_flags,
    takes_engine_flags,
    temp_option,
)
from specdec_cli.commands.options import (
    engine_options,
    first_given,
    grammar_option,
    only_given,
    shared_options,
)
from specdec_cli.decoding.settings import parse_tree
from specdec_cli.models.chat import chat_format


def output_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """A file to write (--json, --plot), but not another flag: `--json -n 64`, written as
    `run --json` is, would take -n for the file and then fail on a stray 64."""
    if value is not None and str(value).startswith("-") and str(value) != "-":
        example = "bench.json" if "--json" in param.opts else "speedup.png"
        raise typer.BadParameter(
            f"{value} is a flag, not a file name: give the file to write, e.g. "
            f"{param.opts[0]} {example}"
        )
    return value


@takes_engine_flags
@takes_chat_flags
def bench(
    model: ModelOpt,
    draft: Annotated[
        list[str] | None,
        typer.Option(
            "-d",
            "-md",
            "--draft",
            metavar="DRAFT",
            help="Drafter(s) to measure: a draft model (same forms as -m) and/or 'ngram'. "
            "Repeatable; with both, their combination (lookup first) is measured too.",
        ),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option(
            "-k",
            "--draft-length",
            metavar="LIST",
            help=described("Draft lengths to try, e.g. 1,2,4,8,auto.", BenchOptions.ks),
        ),
    ] = None,
    tree: Annotated[
        str | None,
        typer.Option(
            "--tree",
            metavar="LIST",
            help=described(
                "Tree settings to try with each k, e.g. off,auto,16 (see run --tree).",
                BenchOptions.trees,
            ),
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            metavar="FILE",
            help=described(
                "One prompt per line; or questions in Spec-Bench's and MT-Bench's JSON "
                'Lines (a .jsonl file, one {"question_id", "category", "turns"} a line): '
                "each a conversation in the target's chat format, each turn after the "
                "model's own answers to the turns before it; figures per category too.",
                "a built-in set of story, code, list, factual and copy prompts",
            ),
        ),
    ] = None,
    suite: Annotated[
        str | None,
        typer.Option(
            "--suite",
            metavar="NAME",
            help="A built-in question file instead of --prompts: spec-bench (Spec-Bench's "
            "480 questions in 13 categories, MT-Bench's 80 among them; Apache-2.0).",
        ),
    ] = None,
    per_category: Annotated[
        int | None,
        typer.Option(
            "--per-category",
            min=1,
            metavar="N",
            help="With --suite or a question file: only the first N questions of each "
            "category, in the file's order.",
        ),
    ] = None,
    n_predict: Annotated[
        int | None,
        typer.Option(
            "-n",
            "--n-predict",
            min=1,
            metavar="N",
            help=described("Tokens per generation.", BenchOptions.n_predict),
        ),
    ] = None,
    repeat: Annotated[
        int | None,
        typer.Option(
            "--repeat",
            min=1,
            metavar="N",
            help=described("Repeats of the whole set.", BenchOptions.repeat),
        ),
    ] = None,
    temp: temp_option(BenchOptions.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    coupled: CoupledOpt = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="N",
            help=described("Random seed (sampling only).", BenchOptions.seed),
        ),
    ] = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFileOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_schema_file: JsonSchemaFileOpt = None,
    *,
    engine_flags: EngineFlags,  # -c, -b, -t, -ngl, -fa, ...: see takes_engine_flags
    chat_flags: FlagValues,  # --chat-template, --jinja, ...: for questions (--suite, .jsonl)
    json_path: Annotated[
        Path | None,
        typer.Option(
            "--json",
            metavar="FILE",
            help="Write every figure to this JSON file.",
            callback=output_file,
        ),
    ] = None,
    plot_path: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write a PNG of tokens/s and acceptance against k, and with questions "
            "the speedup by category (needs matplotlib).",
            callback=output_file,
        ),
    ] = None,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Measure speedup, acceptance and cost: target-only vs every drafter and k, side by side.

    Loads the models once, runs all variants interleaved on the same prompts (warm-up
    excluded), measures the draft's cost and the target's cost of verifying n tokens,
    and reports the speedup a perfect implementation would reach with the measured
    acceptance, so you see why speculation pays or does not.

    \b
    Examples:
      specdec bench -m target.gguf -d draft.gguf -d ngram -k 1,2,4,8,auto --json out.json
      specdec bench -m chat-model.gguf -d ngram -k auto --suite spec-bench --per-category 2
    """
    check_outputs(json_path, plot_path)
    workload = bench_workload(prompts, suite, per_category, chat_format(**chat_flags))
    constraint = grammar_option(grammar, grammar_file, json_schema, json_schema_file)
    drafts = draft or []
    kinds = drafter_kinds(drafts, engine_flags["ngram"])
    plan = BenchOptions(
        **only_given(ks=k, trees=tree, n_predict=n_predict, repeat=repeat, seed=seed)
    )
    ks, trees = split_list(plan.ks), split_list(plan.trees)
    variant_list = variants(kinds, ks, trees)
    flags = shared_options(locals())
    flags["temp"] = first_given(temp, BenchOptions.temp)
    options, _ = engine_options(
        model, drafts, config, k=longest_k(ks), tree=widest_tree(trees), **flags
    )
    options = replace(options, grammar=constraint)
    if engine_flags["ctx_size"] is None:
        widest = max(options.drafting.draft_max, parse_tree(options.drafting.tree) or 0)
        with vocabulary(options) as vocab:
            n_ctx = fit_context(vocab, workload, plan.n_predict, ks, widest)
        options = replace(options, n_ctx=n_ctx)
    report = measure(options, variant_list, workload, plan)
    print_bench(report)
    write_outputs(report, json_path, plot_path)
