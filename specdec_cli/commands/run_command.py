"""`specdec run`: its flags, and the input read and checked before any model loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specdec_cli.commands.display import DRAFTED_COLOR, TARGET_COLOR
from specdec_cli.commands.flags import (
    MODEL_HELP,
    ConfigOpt,
    CoupledOpt,
    DraftsOpt,
    EngineFlags,
    FlagValues,
    GrammarFileOpt,
    GrammarOpt,
    JsonSchemaFileOpt,
    JsonSchemaOpt,
    MinPOpt,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerboseOpt,
    VerbosePromptOpt,
    described,
    draft_length_option,
    takes_chat_flags,
    takes_engine_flags,
    takes_projector_flags,
    temp_option,
)
from specdec_cli.commands.options import (
    engine_options,
    generation_options,
    grammar_option,
    ignored_options,
    shared_options,
)
from specdec_cli.commands.prompts import read_media_files, read_prompt, read_prompts
from specdec_cli.commands.runner import Output, generate, logprob_options
from specdec_cli.decoding.engine import NO_PROJECTOR
from specdec_cli.decoding.logprobs import MAX_TOP
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import GenerationOptions
from specdec_cli.errors import UserError
from specdec_cli.messages import warn
from specdec_cli.models.chat import chat_format, chat_options
from specdec_cli.models.config import load_config, pair_lines
from specdec_cli.models.mmproj import check_media, read_projector


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
