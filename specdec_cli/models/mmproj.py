"""A multimodal projector's header: what it takes (images, audio), its type, the width of
the embeddings it writes; and whether a target can take them, checked before either loads.

llama.cpp's libmtmd compares the widths only once both are loaded (and older builds
aborted); a projector made for another model is the common mistake, so it is named here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.media import Media, not_taken
from specdec_cli.models.gguf_meta import GGUFFile, read_gguf

# The tensor, and which of its ggml dimensions, that holds the width of the embeddings each
# projector type writes (tools/mtmd/clip.cpp, clip_n_mmproj_embd). Types not listed are
# left to libmtmd's own check when the projector loads.
OUTPUT_WIDTH = {
    "mlp": ("mm.2.weight", 1),  # LLaVA; with mm.3 it is LLaVA's "mlp_norm", see _width_tensor
    "qwen2vl_merger": ("mm.2.bias", 0),
    "qwen2.5vl_merger": ("mm.2.bias", 0),
    "qwen3vl_merger": ("mm.2.bias", 0),  # its main path's (see target_input_width)
    "gemma3": ("mm.input_projection.weight", 0),
    "gemma4v": ("mm.input_projection.weight", 1),
    "idefics3": ("mm.model.fc.weight", 1),
    "pixtral": ("mm.2.weight", 1),
    "lfm2": ("mm.2.weight", 1),
}


@dataclass(frozen=True)
class ProjectorInfo:
    path: Path
    projector_type: str  # clip.projector_type, or the vision one of a mixed file
    vision: bool
    audio: bool
    n_embd: int | None  # the width of the embeddings it writes; None: a type not known here


def read_projector(path: Path) -> ProjectorInfo:
    """A projector file's header; a GGUF that is not a projector is a UserError."""
    return projector_of(read_gguf(path))


def projector_of(gguf: GGUFFile) -> ProjectorInfo:
    """A read header's projector facts (see read_projector)."""
    path = gguf.path
    if gguf.architecture != "clip":
        raise UserError(
            f"{path} is not a multimodal projector (its architecture is {gguf.architecture}); "
            "pass the model's mmproj-*.gguf file"
        )
    meta = gguf.metadata
    vision = bool(meta.get("clip.has_vision_encoder"))
    kind = meta.get("clip.projector_type") or meta.get(
        "clip.vision.projector_type" if vision else "clip.audio.projector_type", "unknown"
    )
    return ProjectorInfo(
        path, str(kind), vision, bool(meta.get("clip.has_audio_encoder")), _width(gguf, kind)
    )


def _width(gguf: GGUFFile, kind: str) -> int | None:
    shapes = {tensor.name: tensor.shape for tensor in gguf.tensors}
    if kind == "mlp" and "mm.3.weight" in shapes:  # LLaVA with LayerNorms
        name, dim = "mm.3.bias", 0
    elif kind in OUTPUT_WIDTH:
        name, dim = OUTPUT_WIDTH[kind]
    else:
        return None
    if name not in shapes:
        raise UserError(f"{gguf.path} is a {kind} projector without its {name} tensor")
    return shapes[name][dim]


def check_projector(projector: ProjectorInfo, target: GGUFFile) -> None:
    """A UserError if the projector writes embeddings the target cannot read (see
    projector_problem)."""
    problem = projector_problem(projector, target)
    if problem:
        raise UserError(problem)


def projector_problem(projector: ProjectorInfo, target: GGUFFile) -> str | None:
    """Why the target cannot read the projector's embeddings; None where it can, or where
    the projector's width is not known here. Qwen3-VL's deepstack layers widen both by the
    same factor (llama.cpp's n_embd_inp): the main path's width is compared, with the
    target's embedding length."""
    wanted = target.embedding_length
    if projector.n_embd is None or wanted is None or projector.n_embd == wanted:
        return None
    return (
        f"the projector {projector.path.name} writes embeddings {projector.n_embd} wide, but "
        f"{target.path.name} reads {wanted}: it was made for another model; pass the "
        f"mmproj file that came with {target.path.name}"
    )


def check_media(projector: ProjectorInfo, media: Sequence[Media]) -> None:
    """A UserError for the first of `media` the projector cannot take (audio for one that
    takes images only, or the other way), from its header: before anything loads."""
    for item in media:
        refusal = not_taken(item, projector.path.name, projector.vision, projector.audio)
        if refusal:
            raise UserError(refusal)


def takes(vision: bool, audio: bool) -> str:
    """What a projector takes, in words."""
    kinds = [kind for kind, yes in (("images", vision), ("audio", audio)) if yes]
    return " and ".join(kinds) or "nothing"
