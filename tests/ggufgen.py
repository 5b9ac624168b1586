"""Write tiny, runnable llama-architecture GGUF models from numpy arrays.

Tests build their own models with this (nothing is downloaded), and
benchmarks/make_wide_target.py imports it for the same two jobs: making random
llama layers and writing a GGUF file from metadata plus tensors.

Tensor arrays use numpy's row-major shapes, the reverse of ggml's `ne` order:
a weight that maps n_embd -> n_ff is stored with shape (n_ff, n_embd).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValue, GGUFValueType, GGUFWriter, TokenType

# The ids every SentencePiece llama vocabulary here uses (same as stories260K).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_SPECIAL = 3  # <unk>, <s>, </s>
N_BYTES = 256  # <0x00>..<0xFF>, so any text tokenizes
FIRST_PIECE_ID = N_SPECIAL + N_BYTES

# Small words, TinyStories flavour. Each becomes a "▁word" piece; the vocabulary
# builder adds every prefix of each piece too, because SentencePiece's merge
# tokenizer only reaches a piece through pieces one character shorter.
WORDS = (  # space-separated
    "the a and to was he she it in of on his her they said one day with for you "
    "that big little girl boy mom dad happy sad saw went play ran not had is be "
    "very so but all at up are what Once upon time there named The She He They "
    "cat dog tree ball sun park friend friends like wanted help fun"
)
SUFFIXES = ("s", "ed", "ing", "er", "ly")
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()"


@dataclass(frozen=True)
class Vocab:
    """A SentencePiece ("llama") vocabulary: one entry per token id."""

    tokens: list[str]
    scores: list[float]
    types: list[int]

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class HParams:
    """Llama hyper-parameters (head size = n_embd // n_head)."""

    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 256


def spm_vocab(words: str = WORDS, rot13: bool = False) -> Vocab:
    """Specials, the 256 byte tokens, then single characters, suffixes and "▁word" pieces.

    Normal pieces get falling scores in list order, like a real SentencePiece model
    (score = log frequency), so shorter, earlier pieces merge first. rot13=True
    gives a vocabulary of the same size whose piece texts differ (a foreign
    vocabulary for mismatch tests).
    """
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(N_BYTES)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * N_BYTES
    pieces = ["▁", *CHARS]
    for piece in (*SUFFIXES, *("▁" + word for word in words.split())):
        pieces += [piece[:end] for end in range(2, len(piece) + 1)]
    pieces = list(dict.fromkeys(pieces))  # drop repeats, keep first-seen order
    if rot13:
        pieces = [_rot13(piece) for piece in pieces]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * FIRST_PIECE_ID + [-float(i) for i in range(len(pieces))]
    return Vocab(tokens, scores, [int(t) for t in types])


def _rot13(text: str) -> str:
    rot = str.maketrans(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "nopqrstuvwxyzabcdefghijklmNOPQRSTUVWXYZABCDEFGHIJKLM",
    )
    return text.translate(rot)


def padded(vocab: Vocab, n_pad: int) -> Vocab:
    """The same vocabulary plus n_pad unused "[PADi]" tokens at the end (as HF models pad)."""
    return Vocab(
        vocab.tokens + [f"[PAD{i}]" for i in range(n_pad)],
        vocab.scores + [0.0] * n_pad,
        vocab.types + [int(TokenType.UNUSED)] * n_pad,
    )


def random_matrix(rng: np.random.Generator, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """Normal weights times scale/sqrt(cols): unit-size inputs give unit-size outputs."""
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    return w * np.float32(scale / np.sqrt(cols))


def ffn_weights(
    rng: np.random.Generator, n_embd: int, n_ff: int, out_scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random (ffn_gate, ffn_up, ffn_down) for n_ff units; out_scale shrinks ffn_down."""
    gate = random_matrix(rng, n_ff, n_embd)
    up = random_matrix(rng, n_ff, n_embd)
    return gate, up, random_matrix(rng, n_embd, n_ff, out_scale)


def llama_block(
    rng: np.random.Generator,
    layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    out_scale: float = 1.0,
) -> dict[str, np.ndarray]:
    """One random llama layer. out_scale shrinks what it adds to the residual stream.

    Scaling only attn_output and ffn_down keeps the layer's inner activations
    normal but makes its contribution small, so the model stays close to the one
    without this layer: that is how a draft is made to agree with a target.
    """
    n_embd_kv = n_head_kv * (n_embd // n_head)
    prefix = f"blk.{layer}."
    attention = {
        prefix + "attn_norm.weight": np.ones(n_embd, dtype=np.float32),
        prefix + "attn_q.weight": random_matrix(rng, n_embd, n_embd),
        prefix + "attn_k.weight": random_matrix(rng, n_embd_kv, n_embd),
        prefix + "attn_v.weight": random_matrix(rng, n_embd_kv, n_embd),
        prefix + "attn_output.weight": random_matrix(rng, n_embd, n_embd, out_scale),
    }
    gate, up, down = ffn_weights(rng, n_embd, n_ff, out_scale)
    return attention | {
        prefix + "ffn_norm.weight": np.ones(n_embd, dtype=np.float32),
        prefix + "ffn_gate.weight": gate,
        prefix + "ffn_up.weight": up,
        prefix + "ffn_down.weight": down,
    }


def llama_tensors(
    hp: HParams,
    vocab: Vocab,
    seed: int,
    weak_layers: int = 0,
    weak_scale: float = 1.0,
    logit_scale: float = 4.0,
) -> dict[str, np.ndarray]:
    """Random weights for a whole model; the last weak_layers layers get out_scale=weak_scale.

    Output rows of special and byte tokens are zero (logit 0, far below the
    winners), so greedy generation yields word pieces and never the default EOS.
    logit_scale sets the spread of the logits: about 4 makes the greedy choice
    clear (top-1 probability often above 0.3) without being one-hot.
    """
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab)
    output = rng.standard_normal((n_vocab, hp.n_embd), dtype=np.float32)
    output *= np.float32(logit_scale / np.sqrt(hp.n_embd))
    output[:FIRST_PIECE_ID] = 0.0
    tensors = {
        "token_embd.weight": rng.standard_normal((n_vocab, hp.n_embd), dtype=np.float32),
        "output_norm.weight": np.ones(hp.n_embd, dtype=np.float32),
        "output.weight": output,
    }
    for layer in range(hp.n_layer):
        weak = layer >= hp.n_layer - weak_layers
        tensors |= llama_block(
            rng,
            layer,
            hp.n_embd,
            hp.n_head,
            hp.n_head_kv,
            hp.n_ff,
            out_scale=weak_scale if weak else 1.0,
        )
    return tensors


def first_layers(tensors: Mapping[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """The same model cut after n_layer layers (a cheaper draft of it)."""
    return {
        name: w
        for name, w in tensors.items()
        if not name.startswith("blk.") or int(name.split(".")[1]) < n_layer
    }


def pad_rows(tensors: Mapping[str, np.ndarray], n_pad: int) -> dict[str, np.ndarray]:
    """Zero rows for n_pad extra tokens in the embedding and output matrices."""
    out = dict(tensors)
    for name in ("token_embd.weight", "output.weight"):
        w = tensors[name]
        out[name] = np.concatenate([w, np.zeros((n_pad, w.shape[1]), dtype=w.dtype)])
    return out


def llama_metadata(hp: HParams, vocab: Vocab, eos_token_id: int = EOS_ID) -> dict[str, GGUFValue]:
    """The GGUF key/values llama.cpp needs to load a llama model with this vocabulary."""

    def u32(value: int) -> GGUFValue:
        return GGUFValue(value, GGUFValueType.UINT32)

    def array(values: list[Any], item_type: GGUFValueType) -> GGUFValue:
        return GGUFValue(values, GGUFValueType.ARRAY, item_type)

    return {
        "general.architecture": GGUFValue("llama", GGUFValueType.STRING),
        "general.name": GGUFValue("specdec-test", GGUFValueType.STRING),
        "general.file_type": u32(0),  # all F32
        "llama.context_length": u32(hp.n_ctx_train),
        "llama.embedding_length": u32(hp.n_embd),
        "llama.block_count": u32(hp.n_layer),
        "llama.feed_forward_length": u32(hp.n_ff),
        "llama.attention.head_count": u32(hp.n_head),
        "llama.attention.head_count_kv": u32(hp.n_head_kv),
        "llama.rope.dimension_count": u32(hp.n_embd // hp.n_head),
        "llama.attention.layer_norm_rms_epsilon": GGUFValue(1e-5, GGUFValueType.FLOAT32),
        "tokenizer.ggml.model": GGUFValue("llama", GGUFValueType.STRING),
        "tokenizer.ggml.tokens": array(vocab.tokens, GGUFValueType.STRING),
        "tokenizer.ggml.scores": array(vocab.scores, GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": array(vocab.types, GGUFValueType.INT32),
        "tokenizer.ggml.unknown_token_id": u32(UNK_ID),
        "tokenizer.ggml.bos_token_id": u32(BOS_ID),
        "tokenizer.ggml.eos_token_id": u32(eos_token_id),
        "tokenizer.ggml.add_bos_token": GGUFValue(True, GGUFValueType.BOOL),
        "tokenizer.ggml.add_eos_token": GGUFValue(False, GGUFValueType.BOOL),
    }


def write_gguf(
    path: Path, metadata: Mapping[str, GGUFValue], tensors: Mapping[str, np.ndarray]
) -> Path:
    """Write one GGUF file: metadata (must name general.architecture), then tensors in order."""
    fields = dict(metadata)
    arch = fields.pop("general.architecture").value  # GGUFWriter writes this one itself
    writer = GGUFWriter(path, arch)
    for key, field in fields.items():
        writer.add_key_value(key, field.value, field.type, field.sub_type)
    for name, w in tensors.items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_model(
    path: Path,
    vocab: Vocab,
    hp: HParams,
    seed: int,
    eos_token_id: int = EOS_ID,
    weak_layers: int = 0,
    weak_scale: float = 1.0,
) -> Path:
    """A whole random F32 llama model in one call."""
    tensors = llama_tensors(hp, vocab, seed, weak_layers, weak_scale)
    return write_gguf(path, llama_metadata(hp, vocab, eos_token_id), tensors)
