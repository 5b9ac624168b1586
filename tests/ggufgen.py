"""Write tiny, runnable llama-architecture GGUF models from numpy arrays.

Tests build their own models with this (nothing is downloaded), and
benchmarks/make_wide_target.py imports it for the same two jobs: making random
llama layers and writing a GGUF file from metadata plus tensors. A model can also
carry a real family's tokenizer: read_real_vocab takes the `tokenizer.*` records of
another GGUF file (a vocabulary-only one will do) and write_gguf copies them as they are.

Tensor arrays use numpy's row-major shapes, the reverse of ggml's `ne` order:
a weight that maps n_embd -> n_ff is stored with shape (n_ff, n_embd).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
from gguf import (
    GGMLQuantizationType,
    GGUFReader,
    GGUFValue,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from gguf.quants import quantize

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


class Tokenizer(Protocol):
    """What the weights need to know of a vocabulary: its size and each token's type."""

    @property
    def types(self) -> Any: ...  # a TokenType per token id (a list or an int32 array)

    def __len__(self) -> int: ...


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
    vocab: Tokenizer,
    seed: int,
    weak_layers: int = 0,
    weak_scale: float = 1.0,
    logit_scale: float = 4.0,
) -> dict[str, np.ndarray]:
    """Random weights for a whole model; the last weak_layers layers get out_scale=weak_scale.

    Output rows of tokens that are not normal text pieces (special, byte, unused) are
    zero (logit 0, far below the winners), so greedy generation yields text pieces and
    never an end-of-generation token. logit_scale sets the spread of the logits: about
    4 makes the greedy choice clear (top-1 probability often above 0.3) without being
    one-hot.
    """
    rng = np.random.default_rng(seed)
    tensors = _embeddings(rng, vocab, hp.n_embd, "output_norm.weight", logit_scale)
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


def _u32(value: int) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.UINT32)


def llama_keys(
    hp: HParams, file_type: LlamaFileType = LlamaFileType.ALL_F32
) -> dict[str, GGUFValue]:
    """The architecture's GGUF key/values: what llama.cpp needs to build a llama model of
    this shape (the tokenizer's keys come on top)."""
    return {
        "general.architecture": GGUFValue("llama", GGUFValueType.STRING),
        "general.name": GGUFValue("specdec-test", GGUFValueType.STRING),
        "general.file_type": _u32(file_type),
        "llama.context_length": _u32(hp.n_ctx_train),
        "llama.embedding_length": _u32(hp.n_embd),
        "llama.block_count": _u32(hp.n_layer),
        "llama.feed_forward_length": _u32(hp.n_ff),
        "llama.attention.head_count": _u32(hp.n_head),
        "llama.attention.head_count_kv": _u32(hp.n_head_kv),
        "llama.rope.dimension_count": _u32(hp.n_embd // hp.n_head),
        "llama.attention.layer_norm_rms_epsilon": GGUFValue(1e-5, GGUFValueType.FLOAT32),
    }


def llama_metadata(
    hp: HParams,
    vocab: Vocab,
    eos_token_id: int = EOS_ID,
    file_type: LlamaFileType = LlamaFileType.ALL_F32,
) -> dict[str, GGUFValue]:
    """The GGUF key/values llama.cpp needs to load a llama model with this vocabulary."""

    def array(values: list[Any], item_type: GGUFValueType) -> GGUFValue:
        return GGUFValue(values, GGUFValueType.ARRAY, item_type)

    return llama_keys(hp, file_type) | {
        "tokenizer.ggml.model": GGUFValue("llama", GGUFValueType.STRING),
        "tokenizer.ggml.tokens": array(vocab.tokens, GGUFValueType.STRING),
        "tokenizer.ggml.scores": array(vocab.scores, GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": array(vocab.types, GGUFValueType.INT32),
        "tokenizer.ggml.unknown_token_id": _u32(UNK_ID),
        "tokenizer.ggml.bos_token_id": _u32(BOS_ID),
        "tokenizer.ggml.eos_token_id": _u32(eos_token_id),
        "tokenizer.ggml.add_bos_token": GGUFValue(True, GGUFValueType.BOOL),
        "tokenizer.ggml.add_eos_token": GGUFValue(False, GGUFValueType.BOOL),
    }


class RawRecords(NamedTuple):
    """GGUF key/value records exactly as a file stores them, and how many there are."""

    data: bytes
    count: int


NO_RECORDS = RawRecords(b"", 0)


@dataclass(frozen=True)
class RealVocab:
    """A real model family's tokenizer, read from a GGUF file (a vocabulary-only one will
    do): its `tokenizer.*` records (vocabulary, merges or scores, token types, special
    tokens, flags, pre-tokenizer, chat template), copied byte for byte into the models
    written with it, and the token types their weights need."""

    records: RawRecords
    types: np.ndarray  # int32 TokenType per token id

    def __len__(self) -> int:
        return len(self.types)


# GGUF value types (gguf.GGUFValueType) of a fixed size, in bytes.
_FIXED_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# A GGUF file starts: magic (u32), version (u32), tensor count (u64), key/value count (u64).
_KV_COUNT_OFFSET = 16
_FIRST_RECORD = 24


def read_real_vocab(path: Path) -> RealVocab:
    """The `tokenizer.*` records of a GGUF file, found by walking the records' lengths.

    Not gguf.GGUFReader: it makes Python objects for every element of every array, far
    too slow for 262k tokens and half a million merges. This reads one length per string.
    """
    data = path.read_bytes()
    kept, types = [], None
    for key, _, start, value_start, end in _records(data):
        if key.startswith("tokenizer."):
            kept.append(data[start:end])
        if key == "tokenizer.ggml.token_type":  # an array: item type, length, items
            n_tokens = _U64.unpack_from(data, value_start + 4)[0]
            types = np.frombuffer(data, np.int32, n_tokens, value_start + 12).copy()
    if types is None:
        raise ValueError(f"{path} has no tokenizer.ggml.token_type")
    return RealVocab(RawRecords(b"".join(kept), len(kept)), types)


def set_u32(path: Path, key: str, value: int) -> None:
    """Overwrite the uint32 value of record `key` in a GGUF file, in place (a real
    model's end-of-sequence id, say: GGUFReader takes 20 s over 262k token strings)."""
    for name, value_type, _, value_start, _ in _records(path.read_bytes()):
        if name == key:
            if value_type != GGUFValueType.UINT32:
                raise ValueError(f"{key} is of GGUF type {value_type}, not uint32")
            with path.open("r+b") as file:
                file.seek(value_start)
                file.write(_U32.pack(value))
            return
    raise KeyError(f"{path} has no {key}")


def _records(data: bytes) -> Iterator[tuple[str, int, int, int, int]]:
    """Each key/value record of a GGUF file's bytes, in order: its key, its value's
    type, where the record starts, where its value starts, and where it ends."""
    offset = _FIRST_RECORD
    for _ in range(_U64.unpack_from(data, _KV_COUNT_OFFSET)[0]):
        start = offset
        key_length = _U64.unpack_from(data, offset)[0]
        key = data[offset + 8 : offset + 8 + key_length].decode()
        value_type = _U32.unpack_from(data, offset + 8 + key_length)[0]
        value_start = offset + 12 + key_length
        offset = _skip_value(data, value_start, value_type)
        yield key, value_type, start, value_start, offset


def _skip_value(data: bytes, offset: int, value_type: int) -> int:
    """The offset just after the value of this type that starts at `offset`."""
    if value_type in _FIXED_SIZES:
        return offset + _FIXED_SIZES[value_type]
    if value_type == GGUFValueType.STRING:
        return offset + 8 + _U64.unpack_from(data, offset)[0]
    if value_type != GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type} at byte {offset}")
    item_type, n = _U32.unpack_from(data, offset)[0], _U64.unpack_from(data, offset + 4)[0]
    offset += 12
    if item_type in _FIXED_SIZES:
        return offset + n * _FIXED_SIZES[item_type]
    if item_type != GGUFValueType.STRING:
        raise ValueError(f"unexpected array of GGUF type {item_type} at byte {offset}")
    for _ in range(n):  # each string: its length (u64), then its bytes
        offset += 8 + _U64.unpack_from(data, offset)[0]
    return offset


class Quantized(NamedTuple):
    """A weight in a quantized ggml type: the bytes gguf.quants.quantize makes of it."""

    data: np.ndarray
    qtype: GGMLQuantizationType


def quantized(
    tensors: Mapping[str, np.ndarray], qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0
) -> dict[str, np.ndarray | Quantized]:
    """Every matrix quantized to qtype; the norms' vectors stay F32, as llama-quantize
    leaves them."""
    return {
        name: Quantized(quantize(w, qtype), qtype) if w.ndim == 2 else w
        for name, w in tensors.items()
    }


VOCAB_MATRICES = ("token_embd.weight", "output.weight")


def f16_vocab_matrices(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The vocabulary-sized matrices stored as F16: half the bytes to write and load."""
    return {
        name: w.astype(np.float16) if name in VOCAB_MATRICES else w for name, w in tensors.items()
    }


def read_f32_model(path: Path) -> tuple[dict[str, GGUFValue], dict[str, np.ndarray]]:
    """All metadata (minus the GGUF header counts) and all tensors of an F32 GGUF file."""
    reader = GGUFReader(path)
    metadata: dict[str, GGUFValue] = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):  # version and counts: the writer makes its own
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
        metadata[field.name] = GGUFValue(field.contents(), main_type, sub_type)
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {tensor.name} is {tensor.tensor_type.name}, not F32")
        tensors[tensor.name] = np.array(tensor.data)
    return metadata, tensors


def write_gguf(
    path: Path,
    metadata: Mapping[str, GGUFValue],
    tensors: Mapping[str, np.ndarray | Quantized],
    copied: RawRecords = NO_RECORDS,
) -> Path:
    """Write one GGUF file: metadata (must name general.architecture), the `copied`
    records (another file's, byte for byte), then tensors in order."""
    fields = dict(metadata)
    arch = fields.pop("general.architecture").value  # GGUFWriter writes this one itself
    writer = GGUFWriter(path, arch)
    for key, field in fields.items():
        writer.add_key_value(key, field.value, field.type, field.sub_type)
    for name, w in tensors.items():
        if isinstance(w, Quantized):
            writer.add_tensor(name, w.data, raw_dtype=w.qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if copied.count:
        _append_records(writer, copied)
    writer.write_tensors_to_file()  # pads to the data alignment from wherever it is
    writer.close()
    return path


def _append_records(writer: GGUFWriter, records: RawRecords) -> None:
    """Write records after the writer's own key/values, and count them in the header."""
    (out,) = writer.fout
    out.write(records.data)
    end = out.tell()
    out.seek(_KV_COUNT_OFFSET)
    out.write(_U64.pack(len(writer.kv_data[0]) + records.count))
    out.seek(end)


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


def with_architecture(
    metadata: Mapping[str, GGUFValue], arch: str, keys: Mapping[str, GGUFValue]
) -> dict[str, GGUFValue]:
    """A llama model's tokenizer metadata, moved to another architecture's keys."""
    kept = {k: v for k, v in metadata.items() if not k.startswith("llama.")}
    return (
        kept
        | {"general.architecture": GGUFValue(arch, GGUFValueType.STRING)}
        | {f"{arch}.{key}": value for key, value in keys.items()}
    )


@dataclass(frozen=True)
class MambaParams:
    """Mamba-1 hyper-parameters: all layers recurrent (a selective state space)."""

    n_embd: int = 64
    n_layer: int = 3
    d_inner: int = 128
    d_state: int = 8
    d_conv: int = 4
    dt_rank: int = 8
    n_ctx_train: int = 256


def mamba_block(
    rng: np.random.Generator, layer: int, mp: MambaParams, out_scale: float = 1.0
) -> dict[str, np.ndarray]:
    """One random Mamba layer; out_scale shrinks what it adds to the residual stream."""
    prefix = f"blk.{layer}."
    # A = -exp(A_log) < 0 keeps the state decaying: a stable recurrence.
    a = -np.tile(np.arange(1, mp.d_state + 1, dtype=np.float32), (mp.d_inner, 1))
    return {
        prefix + "attn_norm.weight": np.ones(mp.n_embd, dtype=np.float32),
        prefix + "ssm_in.weight": random_matrix(rng, 2 * mp.d_inner, mp.n_embd),
        prefix + "ssm_conv1d.weight": random_matrix(rng, mp.d_inner, mp.d_conv),
        prefix + "ssm_conv1d.bias": np.zeros(mp.d_inner, dtype=np.float32),
        prefix + "ssm_x.weight": random_matrix(rng, mp.dt_rank + 2 * mp.d_state, mp.d_inner),
        prefix + "ssm_dt.weight": random_matrix(rng, mp.d_inner, mp.dt_rank),
        prefix + "ssm_dt.bias": np.full(mp.d_inner, -2.0, dtype=np.float32),
        prefix + "ssm_a": a,
        prefix + "ssm_d": np.ones(mp.d_inner, dtype=np.float32),
        prefix + "ssm_out.weight": random_matrix(rng, mp.n_embd, mp.d_inner, out_scale),
    }


def mamba_keys(mp: MambaParams, n_layer: int) -> dict[str, GGUFValue]:
    return {
        "context_length": _u32(mp.n_ctx_train),
        "embedding_length": _u32(mp.n_embd),
        "block_count": _u32(n_layer),
        "feed_forward_length": _u32(0),
        "attention.head_count": _u32(0),
        "attention.layer_norm_rms_epsilon": GGUFValue(1e-5, GGUFValueType.FLOAT32),
        "ssm.conv_kernel": _u32(mp.d_conv),
        "ssm.inner_size": _u32(mp.d_inner),
        "ssm.state_size": _u32(mp.d_state),
        "ssm.time_step_rank": _u32(mp.dt_rank),
    }


@dataclass(frozen=True)
class Lfm2Params:
    """LFM2 hyper-parameters: short-convolution (recurrent) layers, and attention
    layers at the positions in `attention_layers`."""

    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    l_cache: int = 3
    attention_layers: tuple[int, ...] = (1, 3)
    n_ctx_train: int = 256


def lfm2_block(
    rng: np.random.Generator, layer: int, lp: Lfm2Params, out_scale: float = 1.0
) -> dict[str, np.ndarray]:
    prefix = f"blk.{layer}."
    head = lp.n_embd // lp.n_head
    if layer in lp.attention_layers:
        mixer = llama_block(rng, layer, lp.n_embd, lp.n_head, lp.n_head_kv, lp.n_ff, out_scale)
        mixer = {k: v for k, v in mixer.items() if "attn_" in k}
        mixer[prefix + "attn_q_norm.weight"] = np.ones(head, dtype=np.float32)
        mixer[prefix + "attn_k_norm.weight"] = np.ones(head, dtype=np.float32)
    else:
        mixer = {
            prefix + "attn_norm.weight": np.ones(lp.n_embd, dtype=np.float32),
            prefix + "shortconv.conv.weight": random_matrix(rng, lp.n_embd, lp.l_cache),
            prefix + "shortconv.in_proj.weight": random_matrix(rng, 3 * lp.n_embd, lp.n_embd),
            prefix + "shortconv.out_proj.weight": random_matrix(
                rng, lp.n_embd, lp.n_embd, out_scale
            ),
        }
    gate, up, down = ffn_weights(rng, lp.n_embd, lp.n_ff, out_scale)
    return mixer | {
        prefix + "ffn_norm.weight": np.ones(lp.n_embd, dtype=np.float32),
        prefix + "ffn_gate.weight": gate,
        prefix + "ffn_up.weight": up,
        prefix + "ffn_down.weight": down,
    }


def lfm2_keys(lp: Lfm2Params, n_layer: int) -> dict[str, GGUFValue]:
    kv_heads = [lp.n_head_kv if i in lp.attention_layers else 0 for i in range(n_layer)]
    return {
        "context_length": _u32(lp.n_ctx_train),
        "embedding_length": _u32(lp.n_embd),
        "block_count": _u32(n_layer),
        "feed_forward_length": _u32(lp.n_ff),
        "attention.head_count": _u32(lp.n_head),
        "attention.head_count_kv": GGUFValue(kv_heads, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "rope.freq_base": GGUFValue(10000.0, GGUFValueType.FLOAT32),
        "attention.layer_norm_rms_epsilon": GGUFValue(1e-5, GGUFValueType.FLOAT32),
        "shortconv.l_cache": _u32(lp.l_cache),
    }


@dataclass(frozen=True)
class Family:
    """How to write one architecture's random model: its name in GGUF, one layer's
    tensors, its metadata keys, and its final norm's tensor name."""

    arch: str
    block: Callable[[np.random.Generator, int, Any, float], dict[str, np.ndarray]]
    keys: Callable[[Any, int], dict[str, GGUFValue]]
    output_norm: str = "output_norm.weight"


MAMBA = Family("mamba", mamba_block, mamba_keys)
LFM2 = Family("lfm2", lfm2_block, lfm2_keys, output_norm="token_embd_norm.weight")


def write_family_model(
    path: Path,
    family: Family,
    vocab: Vocab,
    params: MambaParams | Lfm2Params,
    seed: int,
    weak_layers: int = 0,
    weak_scale: float = 1.0,
    n_layer: int | None = None,
) -> Path:
    """A random F32 model of `family`; its last weak_layers layers add only weak_scale of
    a normal layer's output, and `n_layer` cuts it after that many layers (a draft)."""
    rng = np.random.default_rng(seed)
    tensors = _embeddings(rng, vocab, params.n_embd, family.output_norm)
    for layer in range(params.n_layer):
        weak = layer >= params.n_layer - weak_layers
        tensors |= family.block(rng, layer, params, weak_scale if weak else 1.0)
    n_layer = params.n_layer if n_layer is None else n_layer
    metadata = with_architecture(
        llama_metadata(HParams(), vocab), family.arch, family.keys(params, n_layer)
    )
    return write_gguf(path, metadata, first_layers(tensors, n_layer))


def _embeddings(
    rng: np.random.Generator, vocab: Tokenizer, n_embd: int, norm: str, logit_scale: float = 4.0
) -> dict[str, np.ndarray]:
    """Token embeddings, the final norm and the output matrix, whose rows of tokens that
    are not normal text pieces are zero."""
    output = rng.standard_normal((len(vocab), n_embd), dtype=np.float32)
    output *= np.float32(logit_scale / np.sqrt(n_embd))
    output[np.asarray(vocab.types) != TokenType.NORMAL] = 0.0
    return {
        "token_embd.weight": rng.standard_normal((len(vocab), n_embd), dtype=np.float32),
        norm: np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
    }


def scripted_model(
    path: Path,
    pieces: Sequence[str],
    script: Mapping[str, str],
    template: str,
    controls: Sequence[str] = (),
) -> Path:
    """A model that says what it is told: its next token depends on the current one
    only (one-hot embeddings; attention and feed-forward add nothing), as `script` maps
    a token's text to the next one's; every other token is followed by EOS. `pieces`
    join the synthetic vocabulary as user-defined tokens, read and written whole, and
    `controls` as control tokens (which llama.cpp writes as nothing unless asked);
    `template` is its chat template. F32: its greedy text does not depend on batches."""
    base = spm_vocab()
    kinds = [TokenType.CONTROL if p in controls else TokenType.USER_DEFINED for p in pieces]
    vocab = Vocab(
        base.tokens + list(pieces),
        base.scores + [0.0] * len(pieces),
        base.types + [int(kind) for kind in kinds],
    )
    n_embd = -(-len(vocab) // 64) * 64  # a dimension of its own for every token
    hp = HParams(n_embd=n_embd, n_layer=1, n_head=4, n_head_kv=4, n_ff=64, n_ctx_train=1024)
    tensors = llama_tensors(hp, vocab, seed=0)
    tensors["token_embd.weight"] = np.eye(len(vocab), n_embd, dtype=np.float32)
    tensors["blk.0.attn_output.weight"] = np.zeros((n_embd, n_embd), dtype=np.float32)
    tensors["blk.0.ffn_down.weight"] = np.zeros((n_embd, hp.n_ff), dtype=np.float32)
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    output = np.zeros((len(vocab), n_embd), dtype=np.float32)
    for token in range(len(vocab)):
        following = script.get(vocab.tokens[token])
        output[ids[following] if following else EOS_ID, token] = 1.0
    tensors["output.weight"] = output
    metadata = llama_metadata(hp, vocab) | {
        "tokenizer.chat_template": GGUFValue(template, GGUFValueType.STRING)
    }
    return write_gguf(path, metadata, tensors)


@dataclass(frozen=True)
class Qwen35Params:
    """Qwen3.5 hyper-parameters: gated-delta-net (recurrent) layers with a full-attention
    layer every `full_attention_interval`-th, then `n_nextn` MTP ("nextn") blocks, each a
    full-attention block that reads a token and the trunk's hidden state."""

    n_embd: int = 64
    n_layer: int = 2  # the trunk; the nextn blocks come after it
    n_nextn: int = 1
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    full_attention_interval: int = 2  # layer 1 attends, layer 0 is recurrent
    d_state: int = 16  # each delta-net head's key and value size
    n_group: int = 2  # key heads
    dt_rank: int = 4  # value heads
    d_conv: int = 4
    n_ctx_train: int = 1024


def qwen35_attention(
    rng: np.random.Generator, prefix: str, qp: Qwen35Params, out_scale: float
) -> dict[str, np.ndarray]:
    """A Qwen3.5 full-attention layer: q carries a gate beside each head's query."""
    q_size, kv_size = qp.n_head * qp.head_dim, qp.n_head_kv * qp.head_dim
    return {
        prefix + "attn_q.weight": random_matrix(rng, 2 * q_size, qp.n_embd),
        prefix + "attn_k.weight": random_matrix(rng, kv_size, qp.n_embd),
        prefix + "attn_v.weight": random_matrix(rng, kv_size, qp.n_embd),
        prefix + "attn_output.weight": random_matrix(rng, qp.n_embd, q_size, out_scale),
        prefix + "attn_q_norm.weight": np.ones(qp.head_dim, dtype=np.float32),
        prefix + "attn_k_norm.weight": np.ones(qp.head_dim, dtype=np.float32),
    }


def qwen35_delta_net(
    rng: np.random.Generator, prefix: str, qp: Qwen35Params, out_scale: float
) -> dict[str, np.ndarray]:
    """A gated-delta-net layer (the recurrent kind)."""
    key_dim, value_dim = qp.d_state * qp.n_group, qp.d_state * qp.dt_rank
    conv_dim = 2 * key_dim + value_dim
    return {
        prefix + "attn_qkv.weight": random_matrix(rng, conv_dim, qp.n_embd),
        prefix + "attn_gate.weight": random_matrix(rng, value_dim, qp.n_embd),
        prefix + "ssm_conv1d.weight": random_matrix(rng, conv_dim, qp.d_conv),
        prefix + "ssm_dt.bias": np.zeros(qp.dt_rank, dtype=np.float32),
        prefix + "ssm_a": -np.ones(qp.dt_rank, dtype=np.float32),  # a decaying state
        prefix + "ssm_beta.weight": random_matrix(rng, qp.dt_rank, qp.n_embd),
        prefix + "ssm_alpha.weight": random_matrix(rng, qp.dt_rank, qp.n_embd),
        prefix + "ssm_norm.weight": np.ones(qp.d_state, dtype=np.float32),
        prefix + "ssm_out.weight": random_matrix(rng, qp.n_embd, value_dim, out_scale),
    }


def qwen35_block(
    rng: np.random.Generator, layer: int, qp: Qwen35Params, out_scale: float = 1.0
) -> dict[str, np.ndarray]:
    """One trunk layer, or past the trunk a nextn block (attention, plus the projection of
    its [token embedding, hidden state] input and their norms)."""
    prefix = f"blk.{layer}."
    nextn = layer >= qp.n_layer
    recurrent = not nextn and (layer + 1) % qp.full_attention_interval != 0
    mixer = (qwen35_delta_net if recurrent else qwen35_attention)(rng, prefix, qp, out_scale)
    gate, up, down = ffn_weights(rng, qp.n_embd, qp.n_ff, out_scale)
    tensors = mixer | {
        prefix + "attn_norm.weight": np.ones(qp.n_embd, dtype=np.float32),
        prefix + "post_attention_norm.weight": np.ones(qp.n_embd, dtype=np.float32),
        prefix + "ffn_gate.weight": gate,
        prefix + "ffn_up.weight": up,
        prefix + "ffn_down.weight": down,
    }
    if nextn:
        tensors |= {
            prefix + "nextn.eh_proj.weight": random_matrix(rng, qp.n_embd, 2 * qp.n_embd),
            prefix + "nextn.enorm.weight": np.ones(qp.n_embd, dtype=np.float32),
            prefix + "nextn.hnorm.weight": np.ones(qp.n_embd, dtype=np.float32),
        }
    return tensors


def qwen35_keys(qp: Qwen35Params, n_layer: int) -> dict[str, GGUFValue]:
    """`n_layer`: the trunk's layers (fewer than qp's cuts the model, as for a draft)."""
    n_nextn = qp.n_nextn if n_layer == qp.n_layer else 0
    half_rot = qp.head_dim // 2
    return {
        "context_length": _u32(qp.n_ctx_train),
        "embedding_length": _u32(qp.n_embd),
        "block_count": _u32(n_layer + n_nextn),
        "nextn_predict_layers": _u32(n_nextn),
        "feed_forward_length": _u32(qp.n_ff),
        "attention.head_count": _u32(qp.n_head),
        "attention.head_count_kv": _u32(qp.n_head_kv),
        "attention.key_length": _u32(qp.head_dim),
        "attention.value_length": _u32(qp.head_dim),
        "attention.layer_norm_rms_epsilon": GGUFValue(1e-6, GGUFValueType.FLOAT32),
        "rope.freq_base": GGUFValue(10000.0, GGUFValueType.FLOAT32),
        "rope.dimension_count": _u32(qp.head_dim),
        "rope.dimension_sections": GGUFValue(
            [half_rot, 0, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32
        ),
        "full_attention_interval": _u32(qp.full_attention_interval),
        "ssm.conv_kernel": _u32(qp.d_conv),
        "ssm.inner_size": _u32(qp.d_state * qp.dt_rank),
        "ssm.state_size": _u32(qp.d_state),
        "ssm.time_step_rank": _u32(qp.dt_rank),
        "ssm.group_count": _u32(qp.n_group),
    }


QWEN35 = Family("qwen35", qwen35_block, qwen35_keys)


def write_qwen35_model(
    path: Path,
    vocab: Vocab,
    qp: Qwen35Params,
    seed: int,
    weak_scale: float = 1.0,
    h_scale: float = 0.3,
) -> Path:
    """A random F32 Qwen3.5 model with qp.n_nextn MTP blocks. With a small `weak_scale`
    every block adds little to what it reads, so the trunk is nearly a table of the next
    token given the current one, and so is an MTP block whose input projection passes
    the token's embedding on: it then drafts what the target says, most of the time.
    The projection also mixes in `h_scale` of the hidden state, so a wrong or missing
    hidden state drafts differently."""
    rng = np.random.default_rng(seed)
    tensors = _embeddings(rng, vocab, qp.n_embd, QWEN35.output_norm)
    for layer in range(qp.n_layer + qp.n_nextn):
        tensors |= qwen35_block(rng, layer, qp, weak_scale)
    for layer in range(qp.n_layer, qp.n_layer + qp.n_nextn):
        mix = random_matrix(rng, qp.n_embd, qp.n_embd, h_scale)
        eye = np.eye(qp.n_embd, dtype=np.float32)
        tensors[f"blk.{layer}.nextn.eh_proj.weight"] = np.concatenate([eye, mix], axis=1)
    metadata = with_architecture(
        llama_metadata(HParams(), vocab), QWEN35.arch, qwen35_keys(qp, qp.n_layer)
    )
    return write_gguf(path, metadata, tensors)


def successor_cycle(
    vocab: Tokenizer, rng: np.random.Generator, length: int | None = None
) -> np.ndarray:
    """succ(t) for every token: a random cycle through the text pieces (the NORMAL
    tokens; `length` of them), every other token leading into it. A known-answer target
    writes it."""
    normal = np.flatnonzero(np.asarray(vocab.types) == TokenType.NORMAL)
    cycle = rng.permutation(normal)[:length]
    succ = np.full(len(vocab), cycle[0])
    succ[cycle] = np.roll(cycle, -1)
    return succ


@dataclass(frozen=True)
class KnownAnswer:
    """The tables of a model whose greedy text and MTP drafts are known in advance (see
    write_mtp_known_answer): the target's successor of each token, and the tokens whose
    successor's successor the head knows."""

    succ: np.ndarray  # the target's next token after each token
    good: np.ndarray  # bool per token: the head predicts succ(succ(t)) reading t's state
    n_embd: int
    token_embd: np.ndarray
    eh_proj: np.ndarray
    head: np.ndarray


def write_mtp_known_answer(
    path: Path,
    vocab: Vocab,
    seed: int,
    good_fraction: float = 0.75,
    n_layer: int = 2,
    n_ff: int = 128,
) -> KnownAnswer:
    """A Qwen3.5 model with one MTP block, every block adding nothing (their output
    matrices zero), so that its answers follow from tables:

    - the trunk: one-hot embeddings (token t in dimension t), so its hidden state after a
      token is that token (scaled by the final norm), and an output layer that maps t to
      succ(t), a cycle through the text pieces: greedy, it writes the cycle;
    - the head reads [its token x_p, the hidden state h of x_{p-1}]. Its input projection
      puts x_p in the upper half of its state, and in the lower half the token h stands
      for (the trunk's: x_{p-1}, in the lower half of h; the head's own: the upper half,
      at three times the weight, so the latest token dominates). Its output reads the
      lower half: a good token a votes for succ(succ(a)), the right answer, a bad one for
      succ(succ(succ(a))); the upper half votes at half weight for succ(succ(x_p)), a
      decoy. Without the right hidden state the decoy wins: nothing is accepted.

    `n_layer` and `n_ff` make the trunk as costly as a real model's (its blocks add nothing,
    but are computed all the same), for benchmarks. The head's block is as wide as the
    trunk's (llama.cpp's Qwen3.5 loader gives it the first layer's width).
    """
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab)
    half = -(-n_vocab // 64) * 64
    n_embd = 2 * half
    qp = Qwen35Params(n_embd=n_embd, n_layer=n_layer, n_ff=n_ff)
    succ = successor_cycle(vocab, rng)
    good = rng.random(n_vocab) < good_fraction
    ids = np.arange(n_vocab)
    token_embd = np.eye(n_vocab, n_embd, dtype=np.float32)
    output = np.zeros((n_vocab, n_embd), np.float32)
    output[succ, ids] = 1.0
    eh_proj = np.zeros((n_embd, 2 * n_embd), np.float32)
    eh_proj[half + ids, ids] = 1.0  # the token -> upper half
    eh_proj[ids, n_embd + ids] = 1.0  # the trunk's state (lower half) -> lower half
    eh_proj[ids, n_embd + half + ids] = 3.0  # the head's own (upper half) -> lower half
    head = np.zeros((n_vocab, n_embd), np.float32)
    answer = np.where(good, succ[succ], succ[succ[succ]])
    head[answer, ids] += 1.0
    head[succ[succ], half + ids] += 0.5
    tensors = {
        "token_embd.weight": token_embd,
        QWEN35.output_norm: np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
    }
    for layer in range(qp.n_layer + qp.n_nextn):
        tensors |= qwen35_block(rng, layer, qp, out_scale=0.0)
    nextn = f"blk.{qp.n_layer}.nextn."
    tensors[nextn + "eh_proj.weight"] = eh_proj
    tensors[nextn + "shared_head_head.weight"] = head
    tensors[nextn + "shared_head_norm.weight"] = np.ones(n_embd, dtype=np.float32)
    metadata = with_architecture(
        llama_metadata(HParams(), vocab), QWEN35.arch, qwen35_keys(qp, qp.n_layer)
    )
    write_gguf(path, metadata, tensors)
    return KnownAnswer(succ, good, n_embd, token_embd, eh_proj, head)


@dataclass(frozen=True)
class Eagle3KnownAnswer:
    """The tables of a target and EAGLE-3 head pair whose drafts are known in advance (see
    write_eagle3_known_answer)."""

    succ: np.ndarray  # the target's next token after each token
    answer: np.ndarray  # what the head drafts after reading token t's state


def _cycle_target(
    folder: Path,
    vocab: Vocab,
    hp: HParams,
    rng: np.random.Generator,
    good_fraction: float,
    temper: float = 0.0,
    cycle: int | None = None,
) -> tuple[Path, Eagle3KnownAnswer]:
    """A llama target of shape `hp` whose every layer's input at a position is that
    position's token: one-hot embeddings (token t in dimension t) and blocks that add
    nothing. Its output maps t to succ(t), a cycle through the text pieces (`cycle` of
    them; see _answers for `temper`): greedy, it writes the cycle. With it, the answers a
    head gives: for a good token a, succ(succ(a)); for the rest succ(succ(succ(a)))."""
    n_vocab = len(vocab)
    normal = np.flatnonzero(np.asarray(vocab.types) == TokenType.NORMAL)
    succ = successor_cycle(vocab, rng, cycle)
    good = rng.random(n_vocab) < good_fraction
    answer = np.where(good, succ[succ], succ[succ[succ]])
    target = llama_tensors(hp, vocab, int(rng.integers(1 << 30)))
    target["token_embd.weight"] = np.eye(n_vocab, hp.n_embd, dtype=np.float32)
    for layer in range(hp.n_layer):
        target[f"blk.{layer}.attn_output.weight"][:] = 0.0
        target[f"blk.{layer}.ffn_down.weight"][:] = 0.0
    target["output.weight"] = np.zeros((n_vocab, hp.n_embd), np.float32)
    target["output.weight"][:, :n_vocab] = _answers(rng, succ, normal, temper, hp.n_embd)
    path = write_gguf(folder / "target.gguf", llama_metadata(hp, vocab), target)
    return path, Eagle3KnownAnswer(succ, answer)


def write_eagle3_known_answer(
    folder: Path,
    vocab: Vocab,
    seed: int,
    good_fraction: float = 0.75,
    temper: float = 0.0,
    block_scale: float = 0.0,
    second: float = 0.0,
    n_layer: int = 2,
    n_ff: int = 64,
) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """A llama target and an EAGLE-3 head for it whose answers follow from tables:

    - the target writes a cycle, every layer's input the token (see _cycle_target);
    - the head: see write_eagle3_head.

    `temper` > 0 softens both outputs for sampling (see _answers). `n_layer` and `n_ff`
    make the target as costly as a real model's, for benchmarks.
    """
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab)
    n_embd = -(-n_vocab // 64) * 64
    hp = HParams(n_embd=n_embd, n_layer=n_layer, n_head=4, n_head_kv=4, n_ff=n_ff, n_ctx_train=1024)
    target_path, ka = _cycle_target(folder, vocab, hp, rng, good_fraction, temper)
    head_path = write_eagle3_head(
        folder / "eagle3.gguf", vocab, hp, ka, rng, temper, block_scale, second
    )
    return target_path, head_path, ka


def write_eagle3_head(
    path: Path,
    vocab: Vocab,
    hp: HParams,
    ka: Eagle3KnownAnswer,
    rng: np.random.Generator,
    temper: float = 0.0,
    block_scale: float = 0.0,
    second: float = 0.0,
) -> Path:
    """An EAGLE-3 head for a llama target of shape `hp` whose layer 0 reads the one-hot
    token (token t in dimension t), answering from tables: target_layers 0, 1 and 2 (the
    last the final state); its encoder passes layer 0's input on, so at position p its
    state is the token x_p; its block adds nothing, and its output maps a token a to
    ka.answer[a] (the token after the one that follows, succ(succ(a)), for a good one;
    its row at p reads x_{p+1}). Its next step reads its own state, the same x_p, and
    drafts the same token again: a round's first draft is right where x_p is good, its
    later ones never. Without the target's states it drafts token 0. Its embeddings are
    the target's (ctx_other).

    `temper` > 0 softens its output for sampling (see _answers). `block_scale` > 0 lets
    its block add that much of a random layer's output to its state: its states, and so
    its logits, then differ with every token it reads, its drafts hardly. `second` > 0:
    where its answer is wrong, its second choice is right, at that share of the first's
    logit (a tree's alternative then finds what its chain misses).
    """
    n_vocab, n_embd = len(vocab), hp.n_embd
    answer = ka.answer
    normal = np.flatnonzero(np.asarray(vocab.types) == TokenType.NORMAL)
    fc = np.zeros((n_embd, 3 * n_embd), np.float32)
    fc[:, :n_embd] = np.eye(n_embd, dtype=np.float32)  # layer 0's input passed on
    block = llama_block(rng, 0, n_embd, 4, 4, 64, out_scale=block_scale)
    block = {name: w for name, w in block.items() if "attn_" in name or "ffn_" in name}
    block["blk.0.attn_norm_2.weight"] = np.ones(n_embd, dtype=np.float32)
    for name in ("attn_q", "attn_k", "attn_v"):  # they read [embedding, state]
        w = block[f"blk.0.{name}.weight"]
        block[f"blk.0.{name}.weight"] = np.concatenate([w, w], axis=1)
    output = np.zeros((n_vocab, n_embd), np.float32)
    output[:, :n_vocab] = _answers(rng, answer, normal, temper, n_embd)
    if second:
        bad = np.flatnonzero(answer != ka.succ[ka.succ])
        output[ka.succ[ka.succ[bad]], bad] = second * output[answer[bad], bad]
    head = {
        "fc.weight": fc,
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
        **block,
    }
    keys = llama_keys(HParams(n_embd=n_embd, n_layer=1, n_head=4, n_head_kv=4, n_ff=64))
    keys = {k.removeprefix("llama."): v for k, v in keys.items() if k.startswith("llama.")}
    keys["target_layers"] = GGUFValue([0, 1, 2], GGUFValueType.ARRAY, GGUFValueType.INT32)
    keys["target_hidden_size"] = _u32(n_embd)
    metadata = with_architecture(llama_metadata(hp, vocab), "eagle3", keys)
    return write_gguf(path, metadata, head)


def write_mtp_sidecar(path: Path, model: Path) -> Path:
    """The MTP block of an F32 Qwen3.5 model alone, as an `mtp-*.gguf` sidecar: its
    metadata, the token embeddings, output layer and final norm, and the nextn blocks."""
    metadata, tensors = read_f32_model(model)
    arch = metadata["general.architecture"].value
    n_trunk = int(metadata[f"{arch}.block_count"].value) - int(
        metadata[f"{arch}.nextn_predict_layers"].value
    )
    kept = {
        name: w
        for name, w in tensors.items()
        if not name.startswith("blk.") or int(name.split(".")[1]) >= n_trunk
    }
    return write_gguf(path, metadata, kept)


def write_dflash_known_answer(
    folder: Path,
    vocab: Vocab,
    seed: int,
    good_fraction: float = 0.75,
    block_size: int = 16,
    temper: float = 0.0,
    n_layer: int = 2,
    n_ff: int = 64,
    cycle: int | None = None,
) -> tuple[Path, Path, Eagle3KnownAnswer]:
    """A llama target and a DFlash drafter for it whose drafts follow from tables. DFlash
    decodes a block [last token, mask, mask, ...] at the positions after the text, with
    attention that sees both ways, into a cache that holds, at each position the target
    has decoded, keys and values made from the target's layer inputs there: the answer
    must come through attention. Here, one head as wide as the model, the decision in
    its last dimension (unrotated), the token's identity in the dimensions from `half`:

    - the target writes a cycle, every layer's input the token (see _cycle_target);
    - the drafter (target_layers 0 and 1) fuses them into t at half + t. Its first layer
      is a sliding window of 2: the block's first row (the last token) sees the position
      before it alone, and takes its token t from there, where tokens score high and the
      block's rows low. Its second layer sees everything: the masks look for the first
      row (real tokens score high, the mask low, fused positions nothing) and copy t.
      Its output maps a good t to succ(succ(t)), the token after the last, a bad one to
      succ(succ(succ(t))): every row drafts the same, so a round's first draft is right
      where t is good, its later ones never. Without the target's states the masks
      copy nothing and draft token 0. Its embeddings are the target's (ctx_other).

    `temper` > 0 softens both outputs for sampling (see _answers). `n_layer` and `n_ff`
    make the target as costly as a real model's, for benchmarks. `cycle`: the cycle's
    length; with 1 the target repeats one token, the successor of every token, and every
    row drafts it: right at any depth.
    """
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab)
    half = -(-n_vocab // 64) * 64
    n_embd = 2 * half
    hp = HParams(n_embd=n_embd, n_layer=n_layer, n_head=4, n_head_kv=4, n_ff=n_ff, n_ctx_train=1024)
    target_path, ka = _cycle_target(folder, vocab, hp, rng, good_fraction, temper, cycle)
    normal = np.flatnonzero(np.asarray(vocab.types) == TokenType.NORMAL)
    ids, tokens, fused = np.arange(n_vocab), slice(0, n_vocab), slice(half, half + n_vocab)

    decision = n_embd - 1  # the head's dimension that queries and keys meet in
    carry = np.zeros((n_embd, n_embd), np.float32)
    carry[fused, fused] = np.eye(n_vocab, dtype=np.float32)  # t at half + t, passed on
    fc = np.zeros((n_embd, 2 * n_embd), np.float32)
    fc[half + ids, ids] = 1.0  # layer 0's input, t, to half + t
    drafter: dict[str, np.ndarray] = {}
    for layer in range(2):
        block = llama_block(rng, layer, n_embd, 1, 1, 64, out_scale=0.0)
        q, k = np.zeros((n_embd, n_embd), np.float32), np.zeros((n_embd, n_embd), np.float32)
        q[decision, tokens] = 1.0  # every row asks
        if layer == 0:
            k[decision, fused], k[decision, tokens] = 1.0, -1.0  # fused high, block low
        else:
            k[decision, tokens] = 1.0  # the real token high, the mask low, fused nothing
            k[decision, UNK_ID] = -1.0  # the mask token
        prefix = f"blk.{layer}."
        block |= {
            prefix + "attn_q.weight": q,
            prefix + "attn_k.weight": k,
            prefix + "attn_v.weight": carry,
            prefix + "attn_output.weight": carry,
            prefix + "attn_q_norm.weight": np.ones(n_embd, dtype=np.float32),
            prefix + "attn_k_norm.weight": np.ones(n_embd, dtype=np.float32),
        }
        drafter |= block
    output = np.zeros((n_vocab, n_embd), np.float32)
    output[:, fused] = _answers(rng, ka.answer, normal, temper, n_embd)
    drafter |= {
        "fc.weight": fc,
        "enc.output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output.weight": output,
    }
    keys = llama_keys(HParams(n_embd=n_embd, n_layer=2, n_head=1, n_head_kv=1, n_ff=64))
    keys = {k.removeprefix("llama."): v for k, v in keys.items() if k.startswith("llama.")}
    keys["rope.dimension_count"] = _u32(64)
    keys["target_layers"] = GGUFValue([0, 1], GGUFValueType.ARRAY, GGUFValueType.INT32)
    keys["block_size"] = _u32(block_size)
    keys["attention.sliding_window"] = _u32(2)
    keys["attention.sliding_window_pattern"] = GGUFValue(
        [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL
    )
    metadata = with_architecture(llama_metadata(hp, vocab), "dflash", keys)
    metadata["tokenizer.ggml.mask_token_id"] = _u32(UNK_ID)
    head_path = write_gguf(folder / "dflash.gguf", metadata, drafter)
    return target_path, head_path, ka


def _answers(
    rng: np.random.Generator, answer: np.ndarray, normal: np.ndarray, temper: float, n_embd: int
) -> np.ndarray:
    """An output layer's columns for one-hot inputs t (scaled to sqrt(n_embd) by the final
    norm): answer[t] wins. One-hot where `temper` is 0; else the winner's logit is temper
    over standard normal noise on the text pieces."""
    n_vocab = len(answer)
    columns = np.zeros((n_vocab, n_vocab), np.float32)
    if temper:
        columns[normal] = rng.standard_normal((len(normal), n_vocab)) / np.sqrt(n_embd)
        columns[answer, np.arange(n_vocab)] = temper / np.sqrt(n_embd)
    else:
        columns[answer, np.arange(n_vocab)] = 1.0
    return columns


def write_random_dflash(
    path: Path, vocab: Vocab, hp: HParams, layers: list[int], seed: int, n_layer: int = 1
) -> Path:
    """A DFlash drafter of random weights for a target of shape `hp`, reading the inputs
    of its `layers`; the embeddings and output are the target's (through ctx_other)."""
    rng = np.random.default_rng(seed)
    n_embd, head_dim = hp.n_embd, hp.n_embd // hp.n_head
    tensors: dict[str, np.ndarray] = {
        "fc.weight": random_matrix(rng, n_embd, len(layers) * n_embd),
        "enc.output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
    }
    for layer in range(n_layer):
        tensors |= llama_block(rng, layer, n_embd, hp.n_head, hp.n_head_kv, hp.n_ff)
        tensors[f"blk.{layer}.attn_q_norm.weight"] = np.ones(head_dim, dtype=np.float32)
        tensors[f"blk.{layer}.attn_k_norm.weight"] = np.ones(head_dim, dtype=np.float32)
    keys = llama_keys(replace(hp, n_layer=n_layer))
    keys = {k.removeprefix("llama."): v for k, v in keys.items() if k.startswith("llama.")}
    keys["target_layers"] = GGUFValue(layers, GGUFValueType.ARRAY, GGUFValueType.INT32)
    keys["block_size"] = _u32(16)
    metadata = with_architecture(llama_metadata(hp, vocab), "dflash", keys)
    metadata["tokenizer.ggml.mask_token_id"] = _u32(UNK_ID)
    return write_gguf(path, metadata, tensors)
