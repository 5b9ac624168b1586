"""Which pairings a drafting head can draft for, read from the files' headers before
anything loads (llama.cpp aborts the process on a graph it cannot build): a target's own
MTP ("nextn") head, and an EAGLE-3, DFlash or Gemma 4 assistant file for a target."""

from __future__ import annotations

from specdec_cli.models.gguf_meta import GGUFFile, TensorInfo, tensor_values

EAGLE3 = "eagle3"
DFLASH = "dflash"
ASSISTANT = "gemma4-assistant"
# The files that draft through a target's layer inputs: their architectures.
LAYER_READERS = (EAGLE3, DFLASH)
# The -d files that are heads, not models of their own: their architectures.
HEAD_FILES = (*LAYER_READERS, ASSISTANT)
DFLASH_BLOCK_SIZE = 16  # llama.cpp's default where a file does not say (dflash.block_size)
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


# Those whose MTP graph takes one of several blocks a call (llama_set_nextn_layer_offset):
# they chain, one block a draft step.
CHAINED_MTP_ARCHITECTURES = frozenset(
    {"bailingmoe3", "deepseek32", "deepseek4", "glm-dsa", "glm4moe", "hy_v3", "mimo2", "step35"}
)


def describe_head(file: GGUFFile) -> dict[str, object]:
    """What `specdec info` and `check` say of a model's own drafting head, or of an
    EAGLE-3 file: the method, how many heads, which target layers' outputs (MTP) or
    inputs (EAGLE-3) each reads, and why it cannot draft."""
    if file.architecture == ASSISTANT:
        return {
            "method": ASSISTANT,
            "heads": file.n_layers or 0,
            "reads_layers": [],  # the target's last two, whichever they are
            "target_hidden_size": file.metadata.get(f"{ASSISTANT}.embedding_length_out"),
            "blocks": [],
            "problem": None,
        }
    if file.architecture in LAYER_READERS:
        return {
            "method": file.architecture,
            "heads": 1,
            "reads_layers": target_layers(file),
            "target_hidden_size": file.metadata.get(f"{EAGLE3}.target_hidden_size")
            or file.embedding_length,
            "blocks": [],
            "problem": None,
        }
    n_heads, n_blocks = file.n_nextn, file.n_layers or 0
    trunk = n_blocks - n_heads
    return {
        "method": "mtp" if n_heads else None,
        "heads": n_heads,
        # Each MTP block reads the trunk's last layer, after the final norm (h_nextn).
        "reads_layers": [trunk - 1] if n_heads else [],
        "blocks": list(range(trunk, n_blocks)),
        "problem": head_problem(file) if n_heads else None,
    }


def head_summary(head: dict[str, object]) -> str:
    """describe_head in one line."""
    if not head["heads"]:
        return "none"
    if head["method"] == EAGLE3:
        return (
            f"an EAGLE-3 head: reads the inputs of target layers {head['reads_layers']} "
            f"(n_layer: the final state) of a {head['target_hidden_size']}-wide target; "
            "drafts with -d THIS_FILE"
        )
    if head["method"] == ASSISTANT:
        return (
            f"a Gemma 4 assistant ({head['heads']} layers): reads the final hidden state of a "
            f"{head['target_hidden_size']}-wide Gemma 4 target, and the keys and values of its "
            "last sliding-window and last full layers; drafts with -d THIS_FILE"
        )
    if head["method"] == DFLASH:
        return (
            f"a DFlash block drafter: reads the inputs of target layers {head['reads_layers']} "
            f"of a {head['target_hidden_size']}-wide target; drafts with -d THIS_FILE"
        )
    blocks = ", ".join(str(b) for b in head["blocks"])  # type: ignore[attr-defined]
    chained = " chained, one a draft step," if head["heads"] > 1 else ""  # type: ignore[operator]
    line = (
        f"MTP, {head['heads']} block(s) ({blocks}),{chained} reading the output of layer "
        f"{head['reads_layers'][0]} after the final norm"  # type: ignore[index]
    )
    if head["problem"]:
        return f"{line}; cannot draft: {head['problem']}"
    return f"{line}; drafts by default (-d mtp)"


def is_mtp_sidecar(file: GGUFFile) -> bool:
    """An MTP sidecar: a file of a model's MTP block(s) alone, without the trunk (which
    llama.cpp then loads as optional: its first layer's tensors are absent)."""
    names = {t.name for t in file.tensors}
    return bool(file.n_nextn) and "blk.0.attn_norm.weight" not in names


def sidecar_problem(target: GGUFFile, head: GGUFFile) -> str | None:
    """Why an MTP sidecar cannot draft for this target (None: it can)."""
    problem = head_problem(head) or sidecar_blocks_problem(head)
    if problem:
        return problem
    name, target_name = head.path.name, target.path.name
    if head.architecture != target.architecture:
        return f"{name} is a {head.architecture} head, {target_name} a {target.architecture} model"
    if head.embedding_length != target.embedding_length:
        return (
            f"{head.path.name} reads a hidden state of {head.embedding_length}, "
            f"{target.path.name}'s is {target.embedding_length}"
        )
    if len(head.tokens) != len(target.tokens):
        return f"{name} has {len(head.tokens)} tokens, {target_name} {len(target.tokens)}"
    trunk, target_trunk = _trunk(head), _trunk(target)
    if trunk != target_trunk:
        return f"{name} is the MTP of a model of {trunk} layers, {target_name} has {target_trunk}"
    return None


def _trunk(file: GGUFFile) -> int:
    """A model's layers before its MTP blocks."""
    return (file.n_layers or 0) - file.n_nextn


def sidecar_blocks_problem(head: GGUFFile) -> str | None:
    """Why an MTP sidecar's blocks are not those its header names, the last
    nextn_predict_layers of block_count (None: they are). llama.cpp fails to load a
    block it misses, or (MiMo-V2's, where the first is missing) takes them all for
    optional and aborts the process at the first draft."""
    name, names = head.path.name, {t.name for t in head.tensors}
    blocks = range(_trunk(head), head.n_layers or 0)
    said = f"its header says {blocks.start}-{blocks.stop - 1}"
    for block in blocks:
        if f"blk.{block}.nextn.eh_proj.weight" not in names:
            return f"{name} has no MTP block {block} (blk.{block}.nextn.eh_proj.weight); {said}"
    stray = sorted({int(n.split(".")[1]) for n in names if n.startswith("blk.")} - set(blocks))
    if stray:
        return f"{name} has tensors of blocks {stray} beside its MTP blocks ({said})"
    return None


def head_problem(file: GGUFFile) -> str | None:
    """Why this model cannot draft for itself with its MTP head (None: it can)."""
    name, arch, n_heads = file.path.name, file.architecture, file.n_nextn
    if not n_heads:
        return f"{name} has no MTP layers to draft with"
    if arch not in MTP_ARCHITECTURES:
        return f"llama.cpp cannot run the MTP layers of a {arch} model as a draft"
    if n_heads > 1 and arch not in CHAINED_MTP_ARCHITECTURES:
        return f"llama.cpp runs one MTP block of a {arch} model, and {name} has {n_heads}"
    return None


# The architectures whose graphs expose their layers' inputs (llama.cpp's t_layer_inp, in
# src/models), which an EAGLE-3 head reads; by their GGUF names.
LAYER_INPUT_ARCHITECTURES = frozenset(
    {
        "bailingmoe3",
        "deepseek4",
        "gemma4",
        "gpt-oss",
        "hunyuan_vl",
        "lfm2",
        "llama",
        "mimo2",
        "minimax-01",
        "minimax-m2",
        "muse-glimmer",
        "nanbeige",
        "nemotron_h",
        "qwen3",
        "qwen35",
        "qwen35moe",
        "qwen3moe",
        "qwen3next",
        "qwen4exp",
    }
)


def target_layers(head: GGUFFile) -> list[int]:
    """The target layers whose inputs an EAGLE-3 or DFlash file reads (n_layer: the
    final state); none where it names them otherwise than as whole numbers (see
    target_layers_problem)."""
    value = head.metadata.get(f"{head.architecture}.target_layers")
    if isinstance(value, list) and all(_is_whole(i) for i in value):
        return value
    return []


def target_layers_problem(head: GGUFFile) -> str | None:
    """Why an EAGLE-3 or DFlash file's target layers cannot be read (None: they can)."""
    key = f"{head.architecture}.target_layers"
    value = head.metadata.get(key)
    if not value:
        return f"{head.path.name} names no target layers ({key})"
    if not target_layers(head):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        return f"{head.path.name}'s {key} is {shown}, not a list of layer numbers"
    return None


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_file_problem(target: GGUFFile, head: GGUFFile) -> str | None:
    """Why a head file (one of HEAD_FILES) cannot draft for this target (None: it can)."""
    if head.architecture == ASSISTANT:
        return assistant_problem(target, head)
    return layer_reader_problem(target, head)


def assistant_problem(target: GGUFFile, head: GGUFFile) -> str | None:
    """Why a Gemma 4 assistant cannot draft for this target (None: it can). It reads the
    target's token embeddings, its final state, and the cache of its last two layers
    (the last sliding-window one, then the last full one, with their head shapes):
    llama.cpp asserts, or reads the wrong cache, where they differ."""
    name, target_name = head.path.name, target.path.name
    if target.architecture != "gemma4":
        return f"{name} drafts for Gemma 4 models, {target_name} is a {target.architecture} model"
    width = head.metadata.get(f"{ASSISTANT}.embedding_length_out")
    if width != target.embedding_length:
        return f"{name} was made for a hidden size of {width}, {target_name}'s is " + str(
            target.embedding_length
        )
    if len(head.tokens) != len(target.tokens):
        return f"{name} has {len(head.tokens)} tokens, {target_name} {len(target.tokens)}"
    pattern = target.metadata.get("gemma4.attention.sliding_window_pattern") or []
    if len(pattern) < 2 or not pattern[-2] or pattern[-1]:
        return f"{target_name} does not end with a sliding-window layer and a full one"
    for key in ("key_length", "key_length_swa"):
        theirs = target.metadata.get(f"gemma4.attention.{key}")
        ours = head.metadata.get(f"{ASSISTANT}.attention.{key}")
        if theirs != ours:
            return f"{name} reads attention.{key} {ours}, {target_name} has {theirs}"
    # Each of its layers reads the target's last layer of its kind (llama.cpp's `share`).
    n_head_layers = head.n_layers or 0
    theirs = _per_layer(target.metadata.get("gemma4.attention.head_count_kv"), len(pattern))
    ours = _per_layer(head.metadata.get(f"{ASSISTANT}.attention.head_count_kv"), n_head_layers)
    sliding = head.metadata.get(f"{ASSISTANT}.attention.sliding_window_pattern") or []
    for layer, (n_kv, is_swa) in enumerate(zip(ours, sliding, strict=False)):
        shared = theirs[-2 if is_swa else -1]
        if n_kv != shared:
            return f"{name}'s layer {layer} reads {n_kv} KV heads, {target_name}'s {shared}"
    return None


def _per_layer(value: object, n_layers: int) -> list[object]:
    """A key that is one value for every layer, or an array of one a layer."""
    return list(value) if isinstance(value, list) else [value] * n_layers


def layer_reader_problem(target: GGUFFile, head: GGUFFile) -> str | None:
    """Why an EAGLE-3 or DFlash file cannot draft for this target (None: it can)."""
    name, layers = head.path.name, target_layers(head)
    n_layer, width = target.n_layers or 0, target.embedding_length
    if target.architecture not in LAYER_INPUT_ARCHITECTURES:
        return f"llama.cpp exposes no layer inputs of a {target.architecture} model to {name}"
    problem = target_layers_problem(head)
    if problem:
        return problem
    if head.architecture == EAGLE3 and len(layers) != 3:
        return f"{name} names {len(layers)} target layers ({EAGLE3}.target_layers), not 3"
    if max(layers) > n_layer or min(layers) < 0:
        return f"{name} reads layers {layers}, but {target.path.name} has {n_layer}"
    # DFlash reads the layers side by side at its own width (llama.cpp: n_embd_inp_enc).
    is_eagle3 = head.architecture == EAGLE3
    wanted = (
        head.metadata.get(f"{EAGLE3}.target_hidden_size") if is_eagle3 else head.embedding_length
    )
    if wanted != width:
        return f"{name} was made for a hidden size of {wanted}, {target.path.name}'s is {width}"
    output, d2t = _tensor(head, "output.weight"), _tensor(head, "d2t")
    if output is not None and d2t is None and output.shape[-1] != len(target.tokens):
        return (
            f"{name} predicts {output.shape[-1]} tokens without a map (d2t) to "
            f"{target.path.name}'s {len(target.tokens)}"
        )
    problem = d2t_problem(target, head, d2t, output) if d2t is not None else None
    if problem or head.architecture != DFLASH:
        return problem
    return dflash_problem(head)


def _tensor(file: GGUFFile, name: str) -> TensorInfo | None:
    return next((t for t in file.tensors if t.name == name), None)


def d2t_problem(
    target: GGUFFile, head: GGUFFile, d2t: TensorInfo, output: TensorInfo | None
) -> str | None:
    """Why a head file's d2t, the target token of each token it predicts, cannot map its
    output to the target's vocabulary (None: it can). llama.cpp asserts its type and
    length (aborting the process), and writes each row at the id it names, past the
    target's vocabulary where that is out of range."""
    name, n_vocab = head.path.name, len(target.tokens)
    # What it maps: its own output's rows, or without one the target's, borrowed.
    rows = output.shape[-1] if output is not None else n_vocab
    if d2t.type_name != "I64" or d2t.shape != (rows,):
        return (
            f"{name}'s d2t is {d2t.type_name} of shape {list(d2t.shape)}; llama.cpp takes "
            f"one token id (I64) for each of the {rows} tokens it predicts"
        )
    ids = tensor_values(head, d2t)
    outside = (ids < 0) | (ids >= n_vocab)
    if outside.any():
        row = int(outside.argmax())
        return (
            f"{name}'s d2t maps its token {row} to id {ids[row]}, outside "
            f"{target.path.name}'s {n_vocab} tokens"
        )
    return None


def dflash_problem(head: GGUFFile) -> str | None:
    """What in a DFlash file specdec does not drive (None: nothing): its variants with
    more than a block's logits to read, and a file without the mask token its block is
    made of (llama.cpp would decode token -1)."""
    name, names = head.path.name, {t.name for t in head.tensors}
    if "markov_w1.weight" in names or head.metadata.get(f"{DFLASH}.hyper_connection_count"):
        return f"{name} is a DSpark drafter; specdec drives plain DFlash files so far"
    if "selector_hidden.weight" in names:
        return f"{name} is a DFlash2 drafter (a selector lattice); specdec drives plain DFlash"
    if head.metadata.get("tokenizer.ggml.mask_token_id") is None:
        return f"{name} has no mask token (tokenizer.ggml.mask_token_id) to draft a block with"
    if dflash_block_size(head) < 2:
        return f"{name} has a block of {dflash_block_size(head)}: nothing to draft"
    return None


def dflash_block_size(head: GGUFFile) -> int:
    """The block a DFlash file was trained on: its last token and up to this less one
    drafts."""
    return int(head.metadata.get(f"{DFLASH}.block_size", DFLASH_BLOCK_SIZE))
