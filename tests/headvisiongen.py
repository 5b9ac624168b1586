"""Drafting heads whose targets read images: each head generator's known-answer target
and head (ggufgen, mimo2gen, gemma4gen) with a projector for the target (mtmdgen's), in
mtmdgen's vocabulary.

The projector writes an image's marker and colour in dimensions no token uses. Those
targets' blocks add nothing, so their answers ignore the image: the text after a prompt
is the same with an image in it or without, and so are the head's drafts, if it reads
the target's states where they are. That is what a head beside an image is tested by:
positions or states taken from a token count, not the target's positions, read another
token's state, and the tables' decoys win. The EAGLE-3 pair is mtmdgen's own target,
whose answer the image decides (a red image is answered "red"), with a head of the same
tables.

Kinds: "mtp" (Qwen3.5 and its MTP block, with a Qwen2-VL projector: M-RoPE, an image
spanning fewer positions than it has cells), "chained" (MiMo-V2's three MTP blocks),
"eagle3", "dflash" (llama targets), "assistant" (Gemma 4 and its assistant).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gemma4gen import write_assistant_known_answer
from ggufgen import (
    Eagle3KnownAnswer,
    HParams,
    write_dflash_known_answer,
    write_eagle3_head,
    write_mtp_known_answer,
)
from mimo2gen import write_chained_known_answer
from mtmdgen import (
    ImageDims,
    VisionPair,
    vision_vocab,
    write_mlp_projector,
    write_qwen2vl_projector,
    write_vision_pair,
)

KINDS = ("mtp", "chained", "eagle3", "dflash", "assistant")


@dataclass(frozen=True)
class HeadVision:
    """A target, its drafting head (a file, or None: the target's own MTP blocks), and
    the target's projector; `pair`: mtmdgen's tables, where the target is its own."""

    kind: str
    target: Path
    head: Path | None
    mmproj: Path
    pair: VisionPair | None = None


def write_head_vision(folder: Path, kind: str, seed: int = 0) -> HeadVision:
    """The models of `kind` (see the module's docstring) in `folder`."""
    vocab = vision_vocab()
    half = -(-len(vocab) // 64) * 64  # the generators' one-hot block, its width rounded up
    target, head = folder / "target.gguf", folder / f"{kind}.gguf"
    if kind == "eagle3":
        return _eagle3_on_vision_target(folder, seed)
    if kind == "mtp":
        n_embd = write_mtp_known_answer(target, vocab, seed).n_embd
        mmproj, *_ = write_qwen2vl_projector(folder / "mmproj.gguf", image_dims(n_embd), seed)
        return HeadVision(kind, target, None, mmproj)
    if kind == "chained":
        write_chained_known_answer(target, vocab, seed)
        return HeadVision(kind, target, None, _mlp_projector(folder, 2 * half, seed))
    if kind == "dflash":
        target, head, _ = write_dflash_known_answer(folder, vocab, seed)
        n_embd = 2 * half
    elif kind == "assistant":
        write_assistant_known_answer(target, head, vocab, seed)
        n_embd = half
    else:
        raise ValueError(f"no such kind: {kind}")
    return HeadVision(kind, target, head, _mlp_projector(folder, n_embd, seed))


def image_dims(n_embd: int) -> ImageDims:
    """Where the projectors write in a target `n_embd` wide: the marker and colour
    dimensions are the first past the vocabulary's one-hot ones."""
    n_vocab = len(vision_vocab())
    return ImageDims(n_vocab, n_vocab + 1, n_vocab + 2, n_embd)


def _mlp_projector(folder: Path, n_embd: int, seed: int) -> Path:
    """A LLaVA-style projector for a target `n_embd` wide (4 cells, 4 positions)."""
    return write_mlp_projector(folder / "mmproj.gguf", image_dims(n_embd), seed)[0]


def _eagle3_on_vision_target(folder: Path, seed: int) -> HeadVision:
    """mtmdgen's target and projector, and an EAGLE-3 head of its tables: a good token a
    drafts succ(succ(a)) (see ggufgen.write_eagle3_head). Its layer 0 reads the one-hot
    token, and at an image's cells the image's embedding."""
    pair = write_vision_pair(folder, seed=seed)
    rng = np.random.default_rng(seed + 1)
    succ = pair.succ
    good = rng.random(len(succ)) < 0.75
    answer = np.where(good, succ[succ], succ[succ[succ]])
    hp = HParams(n_embd=pair.dims.n_embd, n_layer=2, n_head=1, n_head_kv=1, n_ctx_train=2048)
    head = write_eagle3_head(
        folder / "eagle3.gguf", pair.vocab, hp, Eagle3KnownAnswer(succ, answer), rng
    )
    return HeadVision("eagle3", pair.target, head, pair.mmproj, pair)
