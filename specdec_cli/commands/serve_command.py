"""`specdec serve`: its flags, turned into the server's options."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from specdec_cli.commands.flags import (
    ConfigOpt,
    CoupledOpt,
    DraftsOpt,
    EngineFlags,
    FlagValues,
    MinPOpt,
    ModelOpt,
    ReasoningFormat,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerboseOpt,
    described,
    draft_length_option,
    takes_chat_flags,
    takes_engine_flags,
    takes_projector_flags,
    temp_option,
)
from specdec_cli.commands.options import (
    engine_options,
    first_given,
    ignored_options,
    only_given,
    shared_options,
)
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.errors import UserError
from specdec_cli.messages import warn
from specdec_cli.models.chat import chat_format
from specdec_cli.serve.api import ServeOptions


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
