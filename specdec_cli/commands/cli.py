"""The command line: parse, call, print. The work happens in the modules it calls."""

from __future__ import annotations

import difflib
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specdec_cli import __version__, interrupt
from specdec_cli.commands.bench import (
    BenchOptions,
    fit_context,
    longest_k,
    variants,
    widest_tree,
)
from specdec_cli.commands.benchjob import (
    bench_workload,
    check_outputs,
    drafter_kinds,
    measure,
    split_list,
    vocabulary,
    write_outputs,
)
from specdec_cli.commands.display import DRAFTED_COLOR, TARGET_COLOR, print_bench
from specdec_cli.commands.options import (
    MODEL_HELP,
    ConfigOpt,
    CoupledOpt,
    DraftsOpt,
    EngineFlags,
    FlagValues,
    GrammarFileOpt,
    GrammarOpt,
    JsonOpt,
    JsonSchemaFileOpt,
    JsonSchemaOpt,
    MinPOpt,
    ModelOpt,
    ReasoningFormat,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerboseOpt,
    VerbosePromptOpt,
    described,
    draft_length_option,
    engine_options,
    first_given,
    generation_options,
    grammar_option,
    ignored_options,
    only_given,
    shared_options,
    takes_chat_flags,
    takes_engine_flags,
    takes_projector_flags,
    temp_option,
)
from specdec_cli.commands.prompts import read_media_files, read_prompt, read_prompts
from specdec_cli.commands.runner import Output, generate, logprob_options
from specdec_cli.decoding.engine import NO_PROJECTOR
from specdec_cli.decoding.logprobs import MAX_TOP
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import (
    GenerationOptions,
    parse_tree,
)
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import rpc
from specdec_cli.messages import warn
from specdec_cli.models.chat import chat_format, chat_options
from specdec_cli.models.config import load_config, pair_lines
from specdec_cli.models.gguf_meta import read_gguf
from specdec_cli.models.heads import HEAD_FILES
from specdec_cli.models.mmproj import check_media, read_projector
from specdec_cli.models.resolve import HEAD
from specdec_cli.serve.api import ServeOptions

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Lossless speculative decoding for llama.cpp GGUF models.",
)


def _print_version(value: bool) -> None:
    if value:
        from llama_cpp import __version__ as binding

        from specdec_cli.llamacpp.backend import backend_names

        backends = ", ".join(backend_names())
        remote = "built in" if rpc.built_in() else "not built in (see the README)"
        print(
            f"specdec {__version__} (llama-cpp-python {binding}; llama.cpp backends: "
            f"{backends}; RPC: {remote})"
        )
        raise typer.Exit()


def _list_devices(value: bool) -> None:
    if value:
        from specdec_cli.llamacpp.backend import device_list_text, gpu_devices

        print(device_list_text(gpu_devices()))
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Show versions and the backends llama.cpp was built with.",
        ),
    ] = False,
    list_devices: Annotated[
        bool,
        typer.Option(
            "--list-devices",
            callback=_list_devices,
            is_eager=True,
            help="List the devices -dev/-devd can name (GPUs), as llama.cpp does.",
        ),
    ] = False,
) -> None:
    """Lossless speculative decoding for llama.cpp GGUF models."""


@app.command()
@takes_engine_flags
@takes_chat_flags
@takes_projector_flags
def run(
    model: Annotated[
        str | None,
        typer.Option(
            "-m",
            "--model",
            metavar="MODEL",
            help=described(MODEL_HELP, "the built-in pair 'default' (see --list-pairs)"),
        ),
    ] = None,
    draft: DraftsOpt = None,
    k: draft_length_option(
        "Tokens to draft per round, or 'auto' to choose each round from the running "
        "acceptance and measured costs."
    ) = None,
    tree: TreeOpt = None,
    prompt: Annotated[
        str | None,
        typer.Option(
            "-p",
            "--prompt",
            metavar="TEXT",
            help="The prompt; '-' reads stdin (as does piping text in with no -p).",
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("-f", "--file", metavar="FILE", help="Read the prompt from this file."),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            metavar="FILE",
            help="One prompt per line: one independent generation each, JSON Lines out. "
            "Each record's index is its line number and its seed reruns it alone "
            "(-p LINE --seed SEED).",
        ),
    ] = None,
    n_predict: Annotated[
        int | None,
        typer.Option(
            "-n",
            "--n-predict",
            metavar="N",
            help=described(
                "Tokens to generate at most; -1: until the model stops or the context is full.",
                GenerationOptions.n_predict,
            ),
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop",
            metavar="TEXT",
            help="Stop when this text appears (not printed); repeatable.",
        ),
    ] = None,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Wrap the prompt in the target's chat template as a user message, BOS "
            "added as llama-completion adds it. llama.cpp formats the chat: it knows a "
            "fixed set of formats and recognises a template by its markers; it does not "
            "run Jinja.",
        ),
    ] = False,
    system: Annotated[
        str | None,
        typer.Option("--system", metavar="TEXT", help="A system message (implies --chat)."),
    ] = None,
    messages: Annotated[
        str | None,
        typer.Option(
            "--messages",
            metavar="FILE",
            help='A conversation: a JSON file holding a list of {"role", "content"} objects '
            "(roles system, user, assistant, tool); '-' reads stdin. Implies --chat. A prompt "
            "(-p, -f, or each --prompts line) is added as the last user turn; --system is "
            "added first (refused if the file has a system message). If the conversation "
            "ends with an assistant message, the reply continues it.",
        ),
    ] = None,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            metavar="FILE",
            help="An image (PNG, JPEG, GIF or BMP) the prompt asks about; repeatable. It "
            "goes where the prompt says <__media__>, else before the prompt's text (with "
            "--chat, of the user's turn), as llama-mtmd-cli puts it. Needs --mmproj.",
        ),
    ] = None,
    audio: Annotated[
        list[Path] | None,
        typer.Option(
            "--audio",
            metavar="FILE",
            help="An audio clip (WAV, MP3 or FLAC), as --image, after the images; for a "
            "projector that takes audio.",
        ),
    ] = None,
    verbose_prompt: VerbosePromptOpt = False,
    temp: temp_option(SamplingParams.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    coupled: CoupledOpt = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="N",
            help=described(
                "Random seed; -1 picks one (and reports it).",
                GenerationOptions.seed,
            ),
        ),
    ] = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFileOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_schema_file: JsonSchemaFileOpt = None,
    *,
    engine_flags: EngineFlags,  # -c, -b, -t, -ngl, -fa, ...: see takes_engine_flags
    chat_flags: FlagValues,  # --chat-template, --jinja, ...: see takes_chat_flags
    projector_flags: FlagValues,  # --mmproj, --no-mmproj: see takes_projector_flags
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object at the end (text and stats) instead of streaming text.",
        ),
    ] = False,
    json_tokens: Annotated[
        bool,
        typer.Option(
            "--json-tokens",
            help="With --json (implied) or --prompts: also each token, its text and who "
            "chose it (the target, or the drafter whose guess it accepted).",
        ),
    ] = False,
    logprobs: Annotated[
        int | None,
        typer.Option(
            "--logprobs",
            metavar="N",
            min=0,
            max=MAX_TOP,  # as the API: more would sort the whole vocabulary every token
            help="Add each token's log-probability and the N likeliest tokens at its place "
            "to the --json-tokens records (implied): the target's own, whoever drafted it. "
            "The model's distribution (log-softmax of the logits) unless "
            "--post-sampling-probs.",
        ),
    ] = None,
    post_sampling_probs: Annotated[
        bool,
        typer.Option(
            "--post-sampling-probs",
            help="With --logprobs: the distribution each token was drawn from, after "
            "--top-k, --top-p, --min-p and --temp (greedy: all on the argmax), as "
            "llama-server's post_sampling_probs.",
        ),
    ] = False,
    color: Annotated[
        bool,
        typer.Option(
            "--color",
            help=f"On a terminal, show accepted draft tokens in {DRAFTED_COLOR} and the "
            f"target's own in {TARGET_COLOR}.",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No stats.")] = False,
    list_pairs: Annotated[
        bool,
        typer.Option(
            "--list-pairs", help="List the named pairs (built-in and the config's) and exit."
        ),
    ] = False,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text, speculatively: the draft proposes, the target verifies.

    The output is what the target alone would produce (token for token with --temp 0,
    the same distribution when sampling), only faster when the draft guesses well.

    \b
    Examples:
      specdec run -m target.gguf -d draft.gguf -k 5 -p "Once upon a time" -n 256
      echo "Write a haiku" | specdec run -m target.gguf -d draft.gguf --chat --json
      specdec run -m target.gguf -d ngram -f rewrite-this-code.txt --temp 0
      specdec run -m target.gguf --mmproj mmproj.gguf --image pic.png -p "Describe it" --chat
    """
    if list_pairs:
        print("\n".join(pair_lines(load_config(config))))
        return
    if prompts is not None and (prompt is not None or file is not None):
        raise UserError("--prompts runs its own prompts; drop -p / -f")
    # The input first: a typo there must not wait for models to load (or download).
    chat_opts = chat_options(chat, system, messages, prompt, chat_format(**chat_flags))
    texts = read_prompts(prompts) if prompts else {0: read_prompt(prompt, file, messages)}
    media = read_media_files(image or [], audio or [])
    constraint = grammar_option(grammar, grammar_file, json_schema, json_schema_file)
    options, defaults = engine_options(
        model,
        draft or [],
        config,
        k=k,
        tree=tree,
        **shared_options(locals()),
        **projector_flags,
        find_mmproj=bool(media),
    )
    if media:  # refused from the headers, before anything loads
        if options.mmproj is None:
            raise UserError(NO_PROJECTOR)
        check_media(read_projector(options.mmproj), media)
    options = replace(options, grammar=constraint)
    generation = generation_options(n_predict, seed, defaults)
    token_logprobs = logprob_options(logprobs, post_sampling_probs)
    json_tokens = json_tokens or token_logprobs is not None
    as_json = as_json or (json_tokens and not prompts)
    for message in ignored_options(options, k, color and not as_json):
        warn(message)
    output = Output(
        as_json,
        json_tokens,
        color,
        quiet,
        json_lines=prompts is not None,
        prompt=verbose_prompt,
        logprobs=token_logprobs,
    )
    generate(options, texts, generation, tuple(stop or ()), chat_opts, output, media)


@app.command()
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
        typer.Option("--json", metavar="FILE", help="Write every figure to this JSON file."),
    ] = None,
    plot_path: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write a PNG of tokens/s and acceptance against k, and with questions "
            "the speedup by category (needs matplotlib).",
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


@app.command()
@takes_engine_flags
@takes_chat_flags
@takes_projector_flags
def serve(
    model: ModelOpt,
    draft: DraftsOpt = None,
    k: draft_length_option(
        'Draft length for requests that do not set "speculative": {"k": N}.'
    ) = None,
    tree: TreeOpt = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            metavar="HOST",
            help=described(
                "Address to listen on (0.0.0.0: every interface; mind --api-key).",
                ServeOptions.host,
            ),
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port", min=0, max=65535, metavar="N", help=described("Port.", ServeOptions.port)
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            metavar="KEY",
            help="Require 'Authorization: Bearer KEY' on every endpoint but /health and the "
            "page at /.",
        ),
    ] = None,
    alias: Annotated[
        str | None,
        typer.Option(
            "-a",
            "--alias",
            metavar="NAME",
            help=described("The model's name in the API.", "the target's file name"),
        ),
    ] = None,
    cors: Annotated[
        str | None,
        typer.Option(
            "--cors",
            metavar="ORIGIN",
            help=described("Let web pages from ORIGIN call the API.", "no CORS"),
        ),
    ] = None,
    parallel: Annotated[
        int | None,
        typer.Option(
            "-np",
            "--parallel",
            min=1,
            max=64,
            metavar="N",
            help=described(
                "Generations decoded at once, each in a slot (-c is split among them); "
                "all slots' rounds are verified in one decode call.",
                ServeOptions.parallel,
            ),
        ),
    ] = None,
    cache_ram: Annotated[
        int | None,
        typer.Option(
            "-cram",
            "--cache-ram",
            min=0,
            metavar="MIB",
            help=described(
                "Host memory for slots' caches that new prompts displaced, loaded back "
                "for a prompt that starts the same way (0: none).",
                ServeOptions.cache_ram,
            ),
        ),
    ] = None,
    queue: Annotated[
        int | None,
        typer.Option(
            "--queue",
            min=0,
            metavar="N",
            help=described(
                "Requests that may wait for a free slot; more get 503 with Retry-After.",
                ServeOptions.queue,
            ),
        ),
    ] = None,
    reasoning_format: Annotated[
        ReasoningFormat | None,
        typer.Option(
            "--reasoning-format",
            help=described(
                "Thinking (<think>...</think>) in chat replies: 'deepseek' sends it apart, "
                "as message.reasoning_content and delta.reasoning_content; 'none' leaves it "
                "in the content ('auto': deepseek, as llama-server).",
                ServeOptions.reasoning_format,
            ),
        ),
    ] = None,
    temp: temp_option(SamplingParams.temp) = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    min_p: MinPOpt = None,
    coupled: CoupledOpt = None,
    *,
    engine_flags: EngineFlags,  # -c, -b, -t, -ngl, -fa, ...: see takes_engine_flags
    chat_flags: FlagValues,  # --chat-template, --jinja, ...: see takes_chat_flags
    projector_flags: FlagValues,  # --mmproj, --no-mmproj: see takes_projector_flags
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API, speculatively.

    POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models,
    /health, /metrics (Prometheus), and a chat page at /. Sampling flags are the
    defaults for requests that do not set their own. Stops on Ctrl-C or SIGTERM.

    \b
    Example:
      specdec serve -m target.gguf -d draft.gguf --port 8080 --api-key secret
    """
    try:
        from specdec_cli.serve.server import serve as run_server
    except ImportError as err:
        raise UserError(
            f"specdec serve needs the server extra ({err.name} is missing): "
            "pip install 'specdec-cli[server]'"
        ) from None
    options, _ = engine_options(
        model,
        draft or [],
        config,
        k=k,
        tree=tree,
        **shared_options(locals()),
        **projector_flags,
        find_mmproj=True,
    )
    for message in ignored_options(options, k):
        warn(message)
    given = only_given(
        host=host,
        port=port,
        api_key=api_key,
        alias=alias,
        cors=cors,
        parallel=parallel,
        cache_ram=cache_ram,
        queue=queue,
        reasoning_format=reasoning_format.value if reasoning_format else None,
    )
    given["chat"] = chat_format(**chat_flags)
    serve_options = ServeOptions(**given)
    drafting = replace(options.drafting, ngram_memory=serve_options.ngram_memory)
    # Beside other requests, a sampled one is coupled unless told not to: then its text
    # does not depend on its drafts, and they may be fitted to the batch.
    sampling = replace(options.sampling, coupled=first_given(coupled, serve_options.parallel > 1))
    options = replace(
        options, parallel=serve_options.parallel, drafting=drafting, sampling=sampling
    )
    run_server(options, serve_options)


@app.command()
def worker(
    host: Annotated[
        str,
        typer.Option(
            "-H", "--host", metavar="HOST", help="Address to listen on (beyond loopback: --expose)."
        ),
    ] = rpc.DEFAULT_HOST,
    port: Annotated[
        int, typer.Option("-p", "--port", min=1, max=65535, metavar="PORT", help="Port.")
    ] = rpc.DEFAULT_PORT,
    cache: Annotated[
        bool,
        typer.Option(
            "-c",
            "--cache",
            help="Keep the tensors clients send on disk, so that a reload sends only their "
            "hashes ($LLAMA_CACHE/rpc, else ~/.cache/llama.cpp/rpc).",
        ),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option(
            "-t", "--threads", min=1, metavar="N", help=described("CPU threads.", "physical cores")
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "-d",
            "--device",
            metavar="DEVICES",
            help=described("Devices to serve, comma-separated.", "the GPUs, else the CPU"),
        ),
    ] = None,
    expose: Annotated[
        bool,
        typer.Option(
            "--expose",
            help="Allow -H beyond loopback. ggml-rpc has no authentication: anyone who "
            "reaches the port can run code on this machine's devices. Use a private network "
            "or an SSH tunnel (see the README).",
        ),
    ] = False,
) -> None:
    """Serve this machine's devices to a target elsewhere: llama.cpp's RPC server
    (rpc-server), started from this install. Point `specdec run/bench/serve --rpc
    HOST:PORT` at it. Runs until stopped (Ctrl-C).

    \b
    Example (on each worker, over an SSH tunnel or a private network):
      specdec worker -p 50052
    """
    from specdec_cli.llamacpp.machine import physical_cores

    exposed = rpc.check_host(host, expose)
    if exposed:
        warn(exposed)
    devices = rpc.worker_devices(device)
    # ggml's server loop never returns to Python: Ctrl-C and SIGTERM end it at once.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.serve_worker(host, port, devices, threads or physical_cores(), cache)


# --- model commands (info, check) ---


@app.command()
def info(
    model: Annotated[
        str | None,
        typer.Argument(
            help="A .gguf file, a name from the config, or a Hugging Face ref (OWNER/REPO:Q4_K_M)."
        ),
    ] = None,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Show what a GGUF model is: architecture, size, vocabulary, quantisation; or a
    multimodal projector (an mmproj file): its type, what it takes, its width. Without a
    model: the llama.cpp build (its backends, GPU offload, devices) and this
    machine (cores, where the cache and the config live).

    Reads the file's header, and its vocabulary through llama.cpp (no weights), so it is
    quick even for large models.

    Example: specdec info models/qwen2.5-7b-instruct-q4_k_m.gguf --json
    """
    from specdec_cli.commands import modelinfo

    if model is None:
        modelinfo.print_build(modelinfo.describe_build(), as_json=as_json)
        return
    loaded = modelinfo.load_model(model, config, need_vocab=False)
    if loaded.file.architecture == "clip":
        modelinfo.print_info(modelinfo.describe_projector(loaded.file), as_json=as_json)
        return
    modelinfo.print_info(modelinfo.describe(loaded), as_json=as_json)


@app.command()
def check(
    model: Annotated[
        str,
        typer.Option(
            "-m", "--model", help="The target model to speed up (same forms as `specdec info`)."
        ),
    ],
    draft: Annotated[
        str | None,
        typer.Option(
            "-d",
            "-md",
            "--draft",
            help="The draft model that would propose tokens for it, or 'mtp' for the "
            "target's own MTP head.",
        ),
    ] = None,
    mmproj: Annotated[
        str | None,
        typer.Option(
            "-mm",
            "--mmproj",
            metavar="FILE",
            help="Instead of a draft: a multimodal projector, whether the target takes its "
            "images or audio.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Check that a draft model can serve a target, and how: through the target's own
    vocabulary, or with its drafts translated (another tokenizer). Or, with --mmproj,
    that a multimodal projector was made for the target (its width), and what it takes.

    Prints every reason they cannot, and why drafts would be translated. Exit code 0 if
    they can be paired, 1 if not.

    \b
    Examples:
      specdec check -m qwen2.5-7b-q4_k_m.gguf -d qwen2.5-0.5b-q8_0.gguf
      specdec check -m qwen2.5-vl-7b-q4_k_m.gguf --mmproj mmproj-qwen2.5-vl-7b-f16.gguf
    """
    from specdec_cli.commands import modelinfo
    from specdec_cli.models.compat import check_pair

    if (draft is None) == (mmproj is None):
        raise UserError("check takes a draft (-d DRAFT) or a projector (--mmproj FILE), one")
    target_model = modelinfo.load_model(model, config)
    if mmproj is not None:
        projector = read_gguf(Path(mmproj))
        if not modelinfo.print_projector_check(target_model, projector, as_json=as_json):
            raise typer.Exit(1)
        return
    assert draft is not None
    if draft.lower() == HEAD:
        if not modelinfo.print_head_check(target_model, as_json=as_json):
            raise typer.Exit(1)
        return
    head = modelinfo.load_model(draft, config, need_vocab=False).file
    if head.architecture in HEAD_FILES:
        if not modelinfo.print_head_check(target_model, as_json=as_json, reader=head):
            raise typer.Exit(1)
        return
    draft_model = modelinfo.load_model(draft, config)
    report = check_pair(target_model, draft_model)
    shared = None
    if report.ok and report.translated:
        shared = modelinfo.shared_token_texts(target_model, draft_model)
    modelinfo.print_check(target_model, draft_model, report, as_json=as_json, shared=shared)
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    """Console entry point: turn expected failures into one line and an exit code."""
    try:
        result = app(standalone_mode=False, prog_name="specdec")
    except UserError as err:
        _fail(str(err), err.exit_code)
    except typer.TyperException as err:  # bad flags: click's usage errors, as typer raises them
        _fail_usage(err)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(interrupt.EXIT_CODE)
    # With standalone_mode=False, click returns typer.Exit's code instead of exiting.
    sys.exit(result if isinstance(result, int) else 0)


def _fail_usage(err: typer.TyperException) -> None:
    # typer raises its own copy of click's exceptions: told apart by name, not by class.
    if type(err).__name__ == "NoArgsIsHelpError":  # bare `specdec`: the help, as click does
        print(err.format_message(), file=sys.stderr)
        sys.exit(err.exit_code)
    if type(err).__name__ == "NoSuchOption":
        # click suggests any option a little alike (--bogus: "--verbose"); keep close ones.
        err.possibilities = difflib.get_close_matches(
            err.option_name, err.possibilities or [], cutoff=0.8
        )
    ctx = getattr(err, "ctx", None)
    hint = f" (see: {ctx.command_path} --help)" if ctx else ""
    _fail(f"{err.format_message()}{hint}", err.exit_code)


def _fail(message: str, code: int) -> None:
    print(f"specdec: error: {message}", file=sys.stderr)
    sys.exit(code)
