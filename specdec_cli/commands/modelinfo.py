"""The `specdec info` and `specdec check` commands: describe a model or a multimodal
projector (or, with none, the llama.cpp build and the machine), vet a draft/target pair or
a projector for a target."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specdec_cli.decoding.translate import SharedVocab
from specdec_cli.llamacpp.model import Model, init_backend
from specdec_cli.models.compat import CompatReport, ModelFacts, read_facts
from specdec_cli.models.config import load_config
from specdec_cli.models.gguf_meta import GGUFFile
from specdec_cli.models.heads import describe_head, head_file_problem, head_summary
from specdec_cli.models.mmproj import projector_of, projector_problem, takes
from specdec_cli.models.resolve import locate_model


def load_model(ref: str, config_path: str | None = None, need_vocab: bool = True) -> ModelFacts:
    """Resolve a model reference (path, config name, Hugging Face ref), read its header and
    its vocabulary (through llama.cpp: no weights are loaded). Without `need_vocab`, a
    vocabulary llama.cpp cannot load is left unknown instead of refused."""
    path = locate_model(ref, load_config(config_path))
    init_backend()  # quiets llama.cpp's log
    return read_facts(path, need_vocab)


def human_count(n: int) -> str:
    """46200000 -> '46.2M'."""
    for divisor, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= divisor:
            return f"{n / divisor:.1f}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    """1185376 -> '1.2 MB' (decimal units, as model hubs show sizes)."""
    for divisor, suffix in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB")):
        if n >= divisor:
            return f"{n / divisor:.1f} {suffix}"
    return f"{n} B"


def _special_token(tokens: list[str], token_id: int | None) -> dict[str, object] | None:
    if token_id is None:
        return None
    text = tokens[token_id] if 0 <= token_id < len(tokens) else None
    return {"id": token_id, "text": text}


def describe(facts: ModelFacts) -> dict[str, object]:
    """The facts `specdec info` shows, as JSON-ready values (counts and sizes unformatted).
    BOS and EOS are llama.cpp's (its defaults apply where the file sets none)."""
    model, vocab = facts.file, facts.vocab
    return {
        "file": str(model.path),
        "architecture": model.architecture,
        "vocab_only": model.vocab_only,
        "parameters": model.n_params,
        "layers": model.n_layers,
        "embedding_width": model.embedding_length,
        "context_length": model.context_length,
        "vocab_type": model.vocab_type,
        "vocab_size": len(model.tokens),
        "bos": _special_token(model.tokens, vocab.bos) if vocab else None,
        "eos": _special_token(model.tokens, vocab.eos) if vocab else None,
        "add_bos": vocab.add_bos if vocab else None,
        "quantization": model.quantization,
        "file_size": model.file_size,
        "chat_template": model.chat_template is not None,
        "split_count": model.split_count,
        "drafting_head": describe_head(model),
    }


def describe_projector(file: GGUFFile) -> dict[str, object]:
    """The facts `specdec info` shows of a multimodal projector (an mmproj file)."""
    projector = projector_of(file)
    return {
        "file": str(file.path),
        "architecture": file.architecture,
        "projector_type": projector.projector_type,
        "vision": projector.vision,
        "audio": projector.audio,
        "embedding_width": projector.n_embd,
        "parameters": file.n_params,
        "quantization": file.quantization,
        "file_size": file.file_size,
    }


def _projector_rows(facts: dict[str, object]) -> list[tuple[str, str]]:
    width = facts["embedding_width"]
    written = f"{width} wide (the target's embedding width)" if width else "unknown"
    return [
        ("file", str(facts["file"])),
        ("multimodal projector", str(facts["projector_type"])),
        ("takes", takes(bool(facts["vision"]), bool(facts["audio"]))),
        ("embeddings written", written),
        ("parameters", human_count(facts["parameters"])),  # type: ignore[arg-type]
        ("quantization", str(facts["quantization"])),
        ("file size", human_bytes(facts["file_size"])),  # type: ignore[arg-type]
    ]


def _token_text(token: dict[str, object] | None) -> str:
    if token is None:
        return "none"
    return f"{token['id']} {token['text']!r}" if token["text"] is not None else str(token["id"])


def _info_rows(facts: dict[str, object]) -> list[tuple[str, str]]:
    """The facts as (label, human text) rows, in display order."""

    def text(value: object) -> str:
        return "unknown" if value is None else str(value)

    if facts["vocab_only"]:
        parameters = "none: a vocabulary-only file (a tokenizer without weights), not runnable"
    else:
        parameters = human_count(facts["parameters"])
    if facts["add_bos"] is None:  # llama.cpp could not read the vocabulary
        bos = eos = "unknown"
    else:
        bos, eos = _token_text(facts["bos"]), _token_text(facts["eos"])
        if facts["add_bos"]:
            bos += ", added to prompts"
    rows = [
        ("file", text(facts["file"])),
        ("architecture", text(facts["architecture"])),
        ("parameters", parameters),
        ("layers", text(facts["layers"])),
        ("embedding width", text(facts["embedding_width"])),
        ("context length (trained)", text(facts["context_length"])),
        ("vocabulary", f"{text(facts['vocab_type'])}, {facts['vocab_size']} tokens"),
        ("BOS", bos),
        ("EOS", eos),
        ("quantization", "none" if facts["vocab_only"] else text(facts["quantization"])),
        ("file size", human_bytes(facts["file_size"])),
        ("chat template", "yes" if facts["chat_template"] else "no"),
    ]
    rows.append(("drafting head", head_summary(facts["drafting_head"])))  # type: ignore[arg-type]
    if facts["split_count"] > 1:
        rows.append(("split", f"{facts['split_count']} files (parameters: this file only)"))
    return rows


def describe_build() -> dict[str, object]:
    """What `specdec info` shows without a model: the llama.cpp build and this machine."""
    from llama_cpp import __version__ as binding

    from specdec_cli.llamacpp import backend, costcache, machine, rowexp, rpc
    from specdec_cli.llamacpp.probe import choose_repack
    from specdec_cli.models.config import default_config_path

    system_info = backend.system_info()
    return {
        "llama_cpp_python": binding,
        "backends": list(backend.backend_names()),
        "gpu_offload": backend.supports_gpu_offload(),
        "rpc": rpc.built_in(),
        "devices": [{"name": d.name, "description": d.description} for d in backend.gpu_devices()],
        "system_info": system_info,
        "physical_cores": machine.physical_cores(),
        "cpu_amx": machine.advertises_amx(machine.cpu_flags(), system_info),
        "repack": choose_repack(None)[0],  # off where the probe saw them crash
        "row_exp": rowexp.kernel_name(),
        "cache_dir": str(costcache.cache_dir()),
        "config_file": str(default_config_path()),
    }


def _build_rows(facts: dict[str, object]) -> list[tuple[str, str]]:
    devices = ", ".join(f"{d['name']} ({d['description']})" for d in facts["devices"])
    return [
        ("llama-cpp-python", str(facts["llama_cpp_python"])),
        ("llama.cpp backends", ", ".join(facts["backends"])),
        ("GPU offload", "yes" if facts["gpu_offload"] else "no (a CPU-only build)"),
        ("RPC (--rpc, specdec worker)", "yes" if facts["rpc"] else "no (see the README: RPC)"),
        ("devices (-dev)", devices or "none"),
        ("llama.cpp system info", str(facts["system_info"])),
        ("physical cores", str(facts["physical_cores"])),
        ("CPU advertises AMX", "yes" if facts["cpu_amx"] else "no"),
        (
            "repacked kernels (--repack)",
            "on" if facts["repack"] else "off: they crash on this CPU (--repack forces them)",
        ),
        ("exp over a row (sampling)", str(facts["row_exp"])),
        ("cache", str(facts["cache_dir"])),
        ("config file", str(facts["config_file"])),
    ]


def print_info(facts: dict[str, object], *, as_json: bool) -> None:
    """A model's facts (describe), or a projector's (describe_projector)."""
    rows = _projector_rows if "projector_type" in facts else _info_rows
    _print_facts(facts, rows, as_json)


def print_projector_check(target: ModelFacts, projector: GGUFFile, *, as_json: bool) -> bool:
    """`specdec check --mmproj FILE`: whether the target reads the embeddings the projector
    writes, and what it takes. Returns whether it can."""
    info = projector_of(projector)
    problem = projector_problem(info, target.file)
    if as_json:
        facts = {"target": str(target.path), **describe_projector(projector)}
        print(json.dumps(facts | {"problem": problem}))
        return problem is None
    print(f"target:    {target.path}")
    print(f"projector: {projector.path}")
    print(f"result:    {'NOT compatible' if problem else 'compatible'}")
    print(f"takes:     {takes(info.vision, info.audio)} ({info.projector_type})")
    if problem:
        print(f"problem:   {problem}")
    return problem is None


def print_build(facts: dict[str, object], *, as_json: bool) -> None:
    """The build's facts (describe_build)."""
    _print_facts(facts, _build_rows, as_json)


def _print_facts(
    facts: dict[str, object],
    to_rows: Callable[[dict[str, object]], list[tuple[str, str]]],
    as_json: bool,
) -> None:
    """JSON, a table on a terminal, or `label: value` lines for pipes and scripts."""
    if as_json:
        print(json.dumps(facts))
        return
    rows = to_rows(facts)
    if not sys.stdout.isatty():
        for label, value in rows:
            print(f"{label}: {value}")
        return
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        # Text, not str: token texts like [PAD] must not be read as rich markup.
        table.add_row(Text(label), Text(value))
    Console().print(table)


def shared_token_texts(target: ModelFacts, draft: ModelFacts) -> int:
    """How many of the draft's token texts the target's vocabulary has too."""
    models = [Model(facts.path, vocab_only=True) for facts in (target, draft)]
    try:
        return SharedVocab.load(*models).n_shared
    finally:
        for model in models:
            model.close()


def print_head_check(target: ModelFacts, *, as_json: bool, reader: GGUFFile | None = None) -> bool:
    """`specdec check -d mtp` (whether the target drafts with its own head, and how) or
    `-d EAGLE3.gguf` / `-d DFLASH.gguf` / `-d ASSISTANT.gguf` (whether that file fits the
    target). Returns whether it can."""
    head = describe_head(reader or target.file)
    if reader:
        problem = head_file_problem(target.file, reader)
    else:
        problem = head["problem"] if head["heads"] else f"{target.path.name} has no MTP layers"
    if as_json:
        draft = str(reader.path) if reader else "mtp"
        print(json.dumps({"target": str(target.path), "draft": draft, **head, "problem": problem}))
        return problem is None
    print(f"target: {target.path}")
    print(
        f"draft:  {reader.path if reader else 'the target' + chr(39) + 's own MTP head (-d mtp)'}"
    )
    print(f"result: {'NOT compatible' if problem else 'compatible'}")
    print(f"method: {head_summary(head)}")
    if problem:
        print(f"problem: {problem}")
    return problem is None


def print_check(
    target: ModelFacts,
    draft: ModelFacts,
    report: CompatReport,
    *,
    as_json: bool,
    shared: int | None = None,
) -> None:
    """Print the verdict on a draft/target pair, with every problem and warning; for a
    translated pair, why, and how many token texts the vocabularies share (`shared`)."""
    if as_json:
        extra = {} if shared is None else {"shared_token_texts": shared}
        paths = {"target": str(target.path), "draft": str(draft.path)}
        print(json.dumps(paths | report.to_dict() | extra))
        return
    print(f"target: {target.path}")
    print(f"draft:  {draft.path}")
    if not report.ok:
        print("result: NOT compatible")
    elif report.translated:
        print(
            "result: compatible, with drafts translated: the vocabularies differ "
            f"({shared} of the draft's {len(draft.file.tokens)} token texts are the target's too)"
        )
    else:
        print("result: compatible, the draft shares the target's vocabulary")
    for problem in report.problems:
        print(f"problem: {problem}")
    for difference in report.differences:
        print(f"difference: {difference}")
    for warning in report.warnings:
        print(f"warning: {warning}")
