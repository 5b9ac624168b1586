"""Tiny multimodal test models, written with `gguf`: a target whose answer depends on the
image, and the projector (mmproj) libmtmd loads for it.

The projector reads an image's colour: its encoder turns each patch into the patch's mean
red, green and blue (one CLIP layer, its output zeroed, so the residual passes through),
and its MLP writes, in the target's embedding width, a marker dimension (every image
token has it) and one colour dimension: red where the patch's red exceeds its blue, blue
where its blue exceeds its red, none for a grey or green patch.

The target (one-hot token embeddings, like ggufgen's known-answer targets) reads it back:

- its first layer's attention looks, from every position, for image tokens (keys made from
  the marker) and copies their colour dimensions into the residual at half the weight of
  a token; before any image it averages over text, whose values are zero, and adds
  nothing. Queries and keys sit in the slowest-turning rotary pair, with a rope base so
  large that it does not turn: attention to the image does not depend on distance;
- its output maps a text piece t to succ(t), a cycle through the text pieces (weight 1),
  every other token (bytes such as "\\n", control tokens) to `default` (weight 1/4), and
  a colour dimension to that colour's word ("▁red", "▁blue"; weight 1).

So greedy text after an image and a prompt ending in a non-piece token (a chat template's
"\\n" after the assistant's header) is the image's colour word, then its successors; the
colour's half weight never beats a text piece's successor. A wrong image changes every
token. A second layer, random and weak, makes logits depend on positions (relative ones,
through rotary attention) without changing any argmax: a decode at the wrong position
shows in the logits.

`echo=True` makes the colour words lead to a newline (a non-piece token), after which the
image decides again: the answer repeats the colour, "red\\nred\\n...". A draft that does not
see the image misses every colour word but the first (which the target itself writes).

`mrope=True` writes the Qwen2-VL pair instead: a `qwen2vl` target (M-RoPE: an image's
tokens share one temporal position and take rows and columns in the others, so an image
advances positions by max(rows, columns), not by its token count) and a
`qwen2vl_merger` projector (two patch convolutions, a 2x2 patch merge before the MLP).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValue, GGUFValueType, TokenType
from ggufgen import (
    WORDS,
    HParams,
    Vocab,
    _u32,
    llama_block,
    llama_metadata,
    random_matrix,
    spm_vocab,
    successor_cycle,
    with_architecture,
    write_gguf,
)

COLORS = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 255, 0)}
CONTROLS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
# ChatML, as Qwen ships it: llama.cpp recognises it by "<|im_start|>" and writes it itself.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
COLOR_WEIGHT = 0.5  # a colour's vote, against 1 for a text piece's successor
DEFAULT_WEIGHT = 0.25  # what a non-piece token votes for `default`
ROPE_BASE = 1e12  # the slowest rotary pair then turns ~1e-12 radians a position
SCORE = 40.0  # attention logit from any position to an image token
JITTER = 0.01  # the weak layer's share of the residual: logits move, argmaxes stay
IMAGE_MEAN = 0.5  # pixels x/255 are normalised to (x/255 - mean) / std, in [-1, 1]
IMAGE_STD = 0.5
N_VISION = 8  # the encoder's width: patch mean red, green, blue in its first three dims
N_VISION_FF = 16
N_HIDDEN = 8  # the projector MLP's hidden units
GAIN = 4.0  # the MLP's first layer: red - blue = +-2 becomes +-8, where GELU is 8 or 0


@dataclass(frozen=True)
class ImageDims:
    """Where a projector writes, in the target's embedding: the marker every image token
    carries, the red and blue dimensions; and the embedding's width."""

    mark: int
    red: int
    blue: int
    n_embd: int


@dataclass(frozen=True)
class VisionPair:
    """A target, its projector and what they answer (see the module's docstring)."""

    target: Path
    mmproj: Path
    vocab: Vocab
    succ: np.ndarray  # the target's next token after each text piece
    default: int  # the next token after any other token, when no colour outvotes it
    answer: dict[str, int]  # the token an image of each colour is answered with
    dims: ImageDims
    image_size: int  # pixels a side of the images the tests send
    n_image_tokens: int  # embeddings of one such image
    n_image_pos: int  # positions one such image advances by
    newline: int | None = None  # with `echo`: the colour words' successor

    def greedy(self, colour: str | None, n: int) -> list[int]:
        """The first n tokens the target writes after a prompt that ends in a non-piece
        token, with an image of that colour before it (None: no image)."""
        first = self.answer.get(colour or "", self.default)
        out = [first]
        while len(out) < n:
            out.append(first if out[-1] == self.newline else int(self.succ[out[-1]]))
        return out


def vision_vocab() -> Vocab:
    """The synthetic SentencePiece vocabulary with the colour words, ChatML's and Qwen2-VL's
    control tokens."""
    base = spm_vocab(WORDS + " red blue")
    return Vocab(
        base.tokens + list(CONTROLS),
        base.scores + [0.0] * len(CONTROLS),
        base.types + [int(TokenType.CONTROL)] * len(CONTROLS),
    )


def write_vision_pair(
    folder: Path, mrope: bool = False, seed: int = 0, echo: bool = False, n_ff: int = 64
) -> VisionPair:
    """The target (`target.gguf`) and projector (`mmproj.gguf`) in `folder` (see the
    module's docstring for `mrope` and `echo`; `n_ff`: the layers' feed-forward width,
    which sets what a pass costs and changes no argmax)."""
    rng = np.random.default_rng(seed)
    vocab = vision_vocab()
    n_vocab = len(vocab)
    n_embd = -(-(n_vocab + 3) // 64) * 64
    dims = ImageDims(n_vocab, n_vocab + 1, n_vocab + 2, n_embd)  # dimensions no token uses
    hp = HParams(n_embd=n_embd, n_layer=2, n_head=1, n_head_kv=1, n_ff=n_ff, n_ctx_train=2048)
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    answer = {"red": ids["▁red"], "blue": ids["▁blue"]}
    succ = successor_cycle(vocab, rng)
    default = int(succ[0])  # where every non-piece token leads: the cycle's start
    newline = ids["<0x0A>"] if echo else None
    if newline is not None:
        succ[[answer["red"], answer["blue"]]] = newline

    tensors = _target_tensors(rng, vocab, hp, succ, default, [answer["red"], answer["blue"]])
    tensors |= _image_reader(dims)
    metadata = llama_metadata(hp, vocab) | {
        "tokenizer.chat_template": GGUFValue(CHATML, GGUFValueType.STRING)
    }
    metadata["llama.rope.freq_base"] = GGUFValue(ROPE_BASE, GGUFValueType.FLOAT32)
    if mrope:
        keys = {k.removeprefix("llama."): v for k, v in metadata.items() if k.startswith("llama.")}
        quarter = n_embd // 8  # sections of rotary pairs: time, rows, columns (n_embd / 2)
        keys["rope.dimension_sections"] = GGUFValue(
            [2 * quarter, quarter, quarter, 0], GGUFValueType.ARRAY, GGUFValueType.INT32
        )
        metadata = with_architecture(metadata, "qwen2vl", keys)
    target = write_gguf(folder / "target.gguf", metadata, tensors)

    write = write_qwen2vl_projector if mrope else write_mlp_projector
    mmproj, size, n_tokens, n_pos = write(folder / "mmproj.gguf", dims, seed)
    return VisionPair(
        target, mmproj, vocab, succ, default, answer, dims, size, n_tokens, n_pos, newline
    )


def _target_tensors(
    rng: np.random.Generator,
    vocab: Vocab,
    hp: HParams,
    succ: np.ndarray,
    default: int,
    colour_words: list[int],
) -> dict[str, np.ndarray]:
    """Embeddings and output (the tables) and the weak second layer; layer 0's block is
    llama_block's, its attention replaced by _image_reader."""
    n_vocab, n_embd = len(vocab), hp.n_embd
    normal = np.asarray(vocab.types) == TokenType.NORMAL
    output = np.zeros((n_vocab, n_embd), np.float32)
    ids = np.arange(n_vocab)
    output[succ[normal], ids[normal]] = 1.0
    output[default, ids[~normal]] = DEFAULT_WEIGHT
    for dim, word in enumerate(colour_words, start=n_vocab + 1):
        output[word, dim] = 1.0
    tensors = {
        "token_embd.weight": np.eye(n_vocab, n_embd, dtype=np.float32),
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
    }
    tensors |= llama_block(rng, 0, n_embd, 1, 1, hp.n_ff, out_scale=0.0)
    tensors |= llama_block(rng, 1, n_embd, 1, 1, hp.n_ff, out_scale=JITTER)
    return tensors


def _image_reader(dims: ImageDims) -> dict[str, np.ndarray]:
    """Layer 0's attention (one head as wide as the model): queries from every token, keys
    from the marker, in the last dimension, the slowest rotary pair under both llama's and
    M-RoPE's layouts; values and output copy the colour dimensions at COLOR_WEIGHT.

    attn_norm scales a one-hot token to sqrt(n) in its dimension, an image embedding
    (marker and colour) to sqrt(n / 2) in each; llama divides scores by sqrt(n)."""
    n_embd, last = dims.n_embd, dims.n_embd - 1
    root = np.sqrt(n_embd)
    q = np.zeros((n_embd, n_embd), np.float32)
    k = np.zeros((n_embd, n_embd), np.float32)
    v = np.zeros((n_embd, n_embd), np.float32)
    o = np.zeros((n_embd, n_embd), np.float32)
    q[last, :] = 1.0 / root  # a token asks with 1
    k[last, dims.mark] = SCORE * np.sqrt(2.0)  # the key SCORE * sqrt(n), scaled by 1/sqrt(n)
    for dim in (dims.red, dims.blue):
        v[dim, dim] = 1.0
        o[dim, dim] = COLOR_WEIGHT / np.sqrt(n_embd / 2)
    return {
        "blk.0.attn_q.weight": q,
        "blk.0.attn_k.weight": k,
        "blk.0.attn_v.weight": v,
        "blk.0.attn_output.weight": o,
    }


def _clip_keys(
    projector: str, image_size: int, patch_size: int, n_embd_out: int, n_layer: int
) -> dict[str, GGUFValue]:
    def floats(values: list[float]) -> GGUFValue:
        return GGUFValue(values, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)

    return {
        "general.architecture": GGUFValue("clip", GGUFValueType.STRING),
        "general.name": GGUFValue("specdec-test-mmproj", GGUFValueType.STRING),
        "clip.projector_type": GGUFValue(projector, GGUFValueType.STRING),
        "clip.has_vision_encoder": GGUFValue(True, GGUFValueType.BOOL),
        "clip.vision.embedding_length": _u32(N_VISION),
        "clip.vision.feed_forward_length": _u32(N_VISION_FF),
        "clip.vision.block_count": _u32(n_layer),
        "clip.vision.projection_dim": _u32(n_embd_out),
        "clip.vision.attention.head_count": _u32(1),
        "clip.vision.attention.layer_norm_epsilon": GGUFValue(1e-6, GGUFValueType.FLOAT32),
        "clip.vision.image_size": _u32(image_size),
        "clip.vision.patch_size": _u32(patch_size),
        "clip.vision.image_mean": floats([IMAGE_MEAN] * 3),
        "clip.vision.image_std": floats([IMAGE_STD] * 3),
    }


def _patch_means(patch_size: int, share: float = 1.0) -> np.ndarray:
    """A patch convolution (ggml: [p, p, 3, N_VISION]) whose output channel c is `share`
    of the mean of input channel c over the patch."""
    w = np.zeros((N_VISION, 3, patch_size, patch_size), np.float32)
    for c in range(3):
        w[c, c] = share / patch_size**2
    return w


def _vision_layer(rng: np.random.Generator, layer: int, biases: bool) -> dict[str, np.ndarray]:
    """A CLIP encoder layer (LayerNorms, attention, GELU FFN) that adds nothing: its
    attention output and FFN down projection are zero, so a patch leaves it as it came."""
    prefix = f"v.blk.{layer}."
    n, n_ff = N_VISION, N_VISION_FF
    tensors = {
        prefix + "ln1.weight": np.ones(n, np.float32),
        prefix + "ln1.bias": np.zeros(n, np.float32),
        prefix + "ln2.weight": np.ones(n, np.float32),
        prefix + "ln2.bias": np.zeros(n, np.float32),
        prefix + "attn_q.weight": random_matrix(rng, n, n),
        prefix + "attn_k.weight": random_matrix(rng, n, n),
        prefix + "attn_v.weight": random_matrix(rng, n, n),
        prefix + "attn_out.weight": np.zeros((n, n), np.float32),
        prefix + "ffn_up.weight": random_matrix(rng, n_ff, n),
        prefix + "ffn_down.weight": np.zeros((n, n_ff), np.float32),
    }
    if biases:
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[prefix + name + ".bias"] = np.zeros(n, np.float32)
        tensors[prefix + "ffn_up.bias"] = np.zeros(n_ff, np.float32)
        tensors[prefix + "ffn_down.bias"] = np.zeros(n, np.float32)
    return tensors


def _colour_mlp(n_in: int, dims: ImageDims) -> dict[str, np.ndarray]:
    """mm.0 -> GELU -> mm.2: from inputs whose dims (0, 1, 2) + N_VISION * j hold patch j's
    mean colour (n_in // N_VISION patches), the marker (bias 1) and the colour dimensions
    (1 for the colour, about 0 for the other)."""
    n_patches = n_in // N_VISION
    mm0 = np.zeros((N_HIDDEN, n_in), np.float32)
    for j in range(n_patches):
        r, b = N_VISION * j, N_VISION * j + 2
        mm0[0, r], mm0[0, b] = GAIN / n_patches, -GAIN / n_patches  # red - blue
        mm0[1, r], mm0[1, b] = -GAIN / n_patches, GAIN / n_patches  # blue - red
    mm2 = np.zeros((dims.n_embd, N_HIDDEN), np.float32)
    mm2[dims.red, 0] = mm2[dims.blue, 1] = 1.0 / (2 * GAIN)  # GELU(2 * GAIN) is 2 * GAIN
    bias = np.zeros(dims.n_embd, np.float32)
    bias[dims.mark] = 1.0
    return {
        "mm.0.weight": mm0,
        "mm.0.bias": np.zeros(N_HIDDEN, np.float32),
        "mm.2.weight": mm2,
        "mm.2.bias": bias,
    }


def write_mlp_projector(path: Path, dims: ImageDims, seed: int = 0) -> tuple[Path, int, int, int]:
    """A LLaVA-1.5 style projector ("mlp"): 16x16 images, 8x8 patches, a position embedding
    (zero), two encoder layers of which LLaVA runs all but the last: 4 tokens, 4 positions.
    Returns the file, the images' side, their tokens and positions."""
    rng = np.random.default_rng(seed)
    image_size, patch_size = 16, 8
    n_patches = (image_size // patch_size) ** 2
    tensors = {
        "v.patch_embd.weight": _patch_means(patch_size),
        "v.position_embd.weight": np.zeros((n_patches, N_VISION), np.float32),
    }
    for layer in range(2):
        tensors |= _vision_layer(rng, layer, biases=False)
    tensors |= _colour_mlp(N_VISION, dims)
    metadata = _clip_keys("mlp", image_size, patch_size, dims.n_embd, n_layer=2)
    return write_gguf(path, metadata, tensors), image_size, n_patches, n_patches


def write_qwen2vl_projector(
    path: Path, dims: ImageDims, seed: int = 0
) -> tuple[Path, int, int, int]:
    """A Qwen2-VL projector ("qwen2vl_merger"): 2x2 patches, merged 2x2 into each token
    (its MLP reads four patches at once). A 16x16 image: 64 patches, 16 tokens on a 4x4
    grid, 4 positions."""
    rng = np.random.default_rng(seed)
    image_size, patch_size = 16, 2
    # Two convolutions (a video's two frames; an image feeds both): half the mean each.
    tensors = {
        "v.patch_embd.weight": _patch_means(patch_size, 0.5),
        "v.patch_embd.weight.1": _patch_means(patch_size, 0.5),
    }
    tensors |= _vision_layer(rng, 0, biases=True)
    tensors |= _colour_mlp(4 * N_VISION, dims)
    metadata = _clip_keys("qwen2vl_merger", image_size, patch_size, dims.n_embd, n_layer=1)
    side = image_size // patch_size // 2
    return write_gguf(path, metadata, tensors), image_size, side * side, side


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour (8-bit RGB, no filter, one IDAT)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width  # filter type 0, then the pixels
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )
