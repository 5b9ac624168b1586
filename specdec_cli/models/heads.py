"""Which targets can draft with their own MTP ("nextn") head, read from the file's header
before anything loads: llama.cpp aborts the process on a graph it cannot build."""

from __future__ import annotations

from specdec_cli.models.gguf_meta import GGUFFile

# The architectures whose MTP blocks llama.cpp runs as a draft context (those with an
# LLM_GRAPH_TYPE_DECODER_MTP graph in src/models), by their GGUF names.
MTP_ARCHITECTURES = frozenset(
    {
        "bailingmoe3",
        "cohere2moe",
        "deepseek2",
        "deepseek32",
        "deepseek4",
        "glm-dsa",
        "glm4moe",
        "glm5-next",
        "hy_v3",
        "mimo2",
        "nemotron_h_moe",
        "qwen35",
        "qwen35moe",
        "qwen3next",
        "step35",
    }
)


def describe_head(file: GGUFFile) -> dict[str, object]:
    """What `specdec info` and `check` say of a model's own drafting head: the method,
    how many heads, which target layer's output each reads, and why it cannot draft."""
    n_heads, n_blocks = file.n_nextn, file.n_layers or 0
    trunk = n_blocks - n_heads
    return {
        "method": "mtp" if n_heads else None,
        "heads": n_heads,
        # Each MTP block reads the trunk's last layer, after the final norm (h_nextn).
        "reads_layer": trunk - 1 if n_heads else None,
        "blocks": list(range(trunk, n_blocks)),
        "problem": head_problem(file) if n_heads else None,
    }


def head_summary(head: dict[str, object]) -> str:
    """describe_head in one line."""
    if not head["heads"]:
        return "none"
    blocks = ", ".join(str(b) for b in head["blocks"])  # type: ignore[attr-defined]
    line = (
        f"MTP, {head['heads']} block(s) ({blocks}), reading the output of layer "
        f"{head['reads_layer']} after the final norm"
    )
    if head["problem"]:
        return f"{line}; cannot draft: {head['problem']}"
    return f"{line}; drafts by default (-d mtp)"


def head_problem(file: GGUFFile) -> str | None:
    """Why this model cannot draft for itself with its MTP head (None: it can)."""
    name, arch, n_heads = file.path.name, file.architecture, file.n_nextn
    if not n_heads:
        return f"{name} has no MTP layers to draft with"
    if arch not in MTP_ARCHITECTURES:
        return f"llama.cpp cannot run the MTP layers of a {arch} model as a draft"
    if n_heads > 1:
        # step35, hy_v3 and mimo2 chain one head a draft step (llama_set_nextn_layer_offset).
        return f"{name} has {n_heads} chained MTP heads; specdec drives single heads so far"
    return None
