"""`specdec info` and `specdec check`: what a model file is, and whether two go together."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdec_cli.commands.flags import ConfigOpt, JsonOpt
from specdec_cli.errors import UserError
from specdec_cli.models.gguf_meta import read_gguf
from specdec_cli.models.heads import HEAD_FILES
from specdec_cli.models.resolve import HEAD


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
