"""Read a GGUF file's header (metadata and tensor list) without loading any weights.

llama.cpp aborts or prints pages of log on a bad file, so specdec reads models here
first: every problem becomes one UserError line that names the file and says what to do.
Format reference: ggml/include/gguf.h in llama.cpp.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from specdec_cli.errors import UserError

GGUF_MAGIC = b"GGUF"
# Version 1 used 32-bit counts and llama.cpp dropped it; 2 and 3 share one layout.
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_STRING = 8
_ARRAY = 9
# struct formats of the fixed-size GGUF value types, by type id (gguf.h: enum gguf_type).
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
# Smallest possible encodings, to reject absurd counts before looping over them:
# key (8-byte length + 1 char) + type + 1-byte value; name + n_dims + type + offset.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8
_HEADER = struct.Struct("<4sIQQ")
_MAX_DIMS = 4  # GGML_MAX_DIMS; llama.cpp rejects more

# ggml tensor types (ggml.h: enum ggml_type): name, elements per block, bytes per block.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
    42: ("Q2_0", 64, 18),
}

# llama.cpp's whole-file quantisation labels (llama.h: enum llama_ftype, general.file_type).
LLAMA_FTYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int = 0  # where its data starts, in bytes from the start of the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.ggml_type)
        return known[0] if known else f"type {self.ggml_type}"


@dataclass
class GGUFFile:
    path: Path
    file_size: int
    version: int
    metadata: dict[str, object]
    tensors: list[TensorInfo]

    def _arch_value(self, name: str) -> object:
        # Model hyperparameters are stored under the architecture's prefix: llama.block_count.
        return self.metadata.get(f"{self.architecture}.{name}")

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def context_length(self) -> int | None:
        """The context length the model was trained with."""
        return self._arch_value("context_length")

    @property
    def n_layers(self) -> int | None:
        return self._arch_value("block_count")

    @property
    def n_nextn(self) -> int:
        """MTP ("nextn") blocks: the model's own drafting heads, after its layers."""
        return int(self._arch_value("nextn_predict_layers") or 0)

    @property
    def embedding_length(self) -> int | None:
        return self._arch_value("embedding_length")

    @property
    def n_params(self) -> int:
        """Parameters stored in this file (one shard only, for a split model)."""
        return sum(t.n_elements for t in self.tensors)

    @property
    def quantization(self) -> str | None:
        """The file's quantisation label (Q4_K_M, F16...), else its most common tensor type;
        None without weights."""
        if self.vocab_only:
            return None
        label = LLAMA_FTYPES.get(self.metadata.get("general.file_type"))
        if label is not None:
            return label
        per_type: dict[str, int] = {}
        for tensor in self.tensors:
            per_type[tensor.type_name] = per_type.get(tensor.type_name, 0) + tensor.n_elements
        return max(per_type, key=per_type.__getitem__) if per_type else None

    @property
    def vocab_type(self) -> str | None:
        """tokenizer.ggml.model: 'llama' (SentencePiece), 'gpt2' (BPE), 'bert', 't5'..."""
        return self.metadata.get("tokenizer.ggml.model")

    @property
    def tokens(self) -> list[str]:
        return self.metadata.get("tokenizer.ggml.tokens", [])

    @property
    def token_types(self) -> list[int]:
        return self.metadata.get("tokenizer.ggml.token_type", [])

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def split_count(self) -> int:
        """How many files the model is split into (gguf-split); 1 for a single file."""
        return self.metadata.get("split.count", 1)

    @property
    def vocab_only(self) -> bool:
        """A tokenizer without weights (like llama.cpp's models/ggml-vocab-*.gguf): no
        tensors, and not the first file of a split model (which may hold none)."""
        return not self.tensors and self.split_count == 1 and bool(self.tokens)


# Arrays nothing here reads: a BPE vocabulary's merges are 150k-500k strings, and
# decoding them costs a pair's start-up tenths of a second.
UNREAD_ARRAYS = frozenset({"tokenizer.ggml.merges"})


@dataclass(frozen=True)
class Skipped:
    """An array read past, not decoded: how many entries it has."""

    count: int


class _Corrupt(Exception):
    """Raised inside the parser; read_gguf turns it into a UserError naming the file."""


class _Cursor:
    """Reads little-endian GGUF values from a buffer, keeping the position."""

    def __init__(self, buf: mmap.mmap | bytes, start: int) -> None:
        self.buf = buf
        self.pos = start

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _Corrupt(f"it ends at byte {len(self.buf)} while reading up to byte {end}")
        data = self.buf[self.pos : end]
        self.pos = end
        return data

    def scalar(self, fmt: str) -> int | float | bool:
        fmt = "<" + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        # "replace": names and templates are for display, a bad byte must not stop the read.
        return self.take(self.scalar("Q")).decode("utf-8", "replace")

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALAR_FORMATS:
            raise _Corrupt(f"unknown value type {vtype}")
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> list:
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype == _STRING:
            return self.string_array(count)
        if etype not in _SCALAR_FORMATS:
            # Arrays of arrays included: llama.cpp refuses them too.
            raise _Corrupt(f"unsupported array element type {etype}")
        dtype = np.dtype("<" + _SCALAR_FORMATS[etype])
        # One bulk conversion: a 150k-entry scores or token_type array costs milliseconds.
        return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()

    def skip_array(self) -> Skipped:
        """Step over an array of strings without decoding it: only its length is kept."""
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype != _STRING:
            raise _Corrupt(f"an array of strings has element type {etype}")
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack_len = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack_len(buf, pos)
            pos += 8 + n
            if pos > size:
                raise _Corrupt(f"it ends at byte {size} while reading up to byte {pos}")
        self.pos = pos
        return Skipped(count)

    def string_array(self, count: int) -> list[str]:
        # The vocabulary and merges are 100k+ strings: keep this loop free of method calls.
        buf, pos, size = self.buf, self.pos, len(self.buf)
        if pos + 8 * count > size:
            raise _Corrupt(f"a string array claims {count} entries, more than the file holds")
        unpack_len = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            (n,) = unpack_len(buf, pos)
            pos += 8
            if pos + n > size:
                raise _Corrupt(f"it ends at byte {size} while reading up to byte {pos + n}")
            # surrogateescape keeps invalid UTF-8 byte-exact, so token texts compare exactly.
            append(buf[pos : pos + n].decode("utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out


def _open(path: Path) -> tuple[BinaryIO, int]:
    """Open a model file for binary reading, turning OS errors into UserErrors."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise UserError(f"model file not found: {path}; check the path") from None
    except IsADirectoryError:
        raise UserError(
            f"{path} is a directory, not a model file; pass the .gguf file inside it"
        ) from None
    except PermissionError:
        raise UserError(
            f"cannot read {path}: permission denied; check the file's permissions"
        ) from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    info = os.fstat(handle.fileno())
    if not stat.S_ISREG(info.st_mode):
        handle.close()
        raise UserError(f"{path} is not a regular file; pass a .gguf model file")
    return handle, info.st_size


def _check_header(head: bytes, path: Path, size: int) -> tuple[int, int, int]:
    """Validate magic, version and counts; return (version, n_tensors, n_kv)."""
    if size == 0:
        raise UserError(f"{path} is empty (0 bytes); download or convert the model again")
    if head[:4] != GGUF_MAGIC:
        raise UserError(
            f"{path} is not a GGUF file (it starts with {head[:4]!r}); pass a .gguf model file"
        )
    if len(head) < _HEADER.size:
        raise UserError(
            f"{path} is truncated: only {size} bytes, too short for a GGUF header; "
            "download or convert the model again"
        )
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            # A little-endian read of a big-endian 3 gives 0x03000000.
            raise UserError(
                f"{path} is a big-endian GGUF file, which specdec cannot read; "
                "use the little-endian build of the model"
            )
        raise UserError(
            f"{path} is GGUF version {version}, but specdec reads versions 2 and 3; "
            "convert the model again with a current llama.cpp"
        )
    room = size - _HEADER.size
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise UserError(
            f"{path} is truncated or corrupt: its header lists {n_tensors} tensors and {n_kv} "
            f"metadata entries, more than a {size}-byte file can hold; "
            "download or convert the model again"
        )
    return version, n_tensors, n_kv


def check_gguf(path: str | os.PathLike[str]) -> None:
    """Cheaply check that path is a readable GGUF file (magic, version, counts).

    Run before handing a file to llama.cpp, which aborts or floods the log on bad files.
    """
    path = Path(path)
    handle, size = _open(path)
    with handle:
        _check_header(handle.read(_HEADER.size), path, size)


def _read_tensor_infos(cursor: _Cursor, n_tensors: int) -> tuple[list[TensorInfo], list[int]]:
    tensors, offsets = [], []
    for _ in range(n_tensors):
        name = cursor.string()
        n_dims = cursor.scalar("I")
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} claims {n_dims} dimensions")
        shape = tuple(cursor.scalar("Q") for _ in range(n_dims))
        tensors.append(TensorInfo(name, shape, cursor.scalar("I")))
        offsets.append(cursor.scalar("Q"))
    return tensors, offsets


def _tensor_data_end(tensors: list[TensorInfo], offsets: list[int], data_start: int) -> int:
    """Byte where the last tensor's data ends: 0 without tensors; unknown types are skipped."""
    end = 0
    for tensor, offset in zip(tensors, offsets, strict=True):
        if tensor.ggml_type in GGML_TYPES:
            _, block_elements, block_bytes = GGML_TYPES[tensor.ggml_type]
            nbytes = tensor.n_elements // block_elements * block_bytes
            end = max(end, data_start + offset + nbytes)
    return end


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Read the metadata and tensor list of a GGUF file (not the weights)."""
    path = Path(path)
    handle, size = _open(path)
    with handle:
        version, n_tensors, n_kv = _check_header(handle.read(_HEADER.size), path, size)
        # mmap: the header can be tens of MB of vocabulary; read it without copying the file.
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cursor = _Cursor(buf, _HEADER.size)
            try:
                metadata: dict[str, object] = {}
                for _ in range(n_kv):
                    key = cursor.string()
                    vtype = cursor.scalar("I")
                    if key in UNREAD_ARRAYS and vtype == _ARRAY:
                        metadata[key] = cursor.skip_array()
                    else:
                        metadata[key] = cursor.value(vtype)
                tensors, offsets = _read_tensor_infos(cursor, n_tensors)
            except _Corrupt as err:
                raise UserError(
                    f"{path} is truncated or corrupt ({err}); download or convert the model again"
                ) from None
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = DEFAULT_ALIGNMENT
    data_start = -(-cursor.pos // alignment) * alignment
    data_end = _tensor_data_end(tensors, offsets, data_start)
    if data_end > size:
        raise UserError(
            f"{path} is truncated: its tensors need {data_end} bytes but the file has {size}; "
            "the download or conversion was interrupted, fetch the file again"
        )
    tensors = [replace(t, offset=data_start + o) for t, o in zip(tensors, offsets, strict=True)]
    return GGUFFile(path, size, version, metadata, tensors)


# numpy's types of the ggml types stored one element a value (not in quantized blocks).
_PLAIN_TYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def tensor_values(file: GGUFFile, tensor: TensorInfo) -> np.ndarray:
    """The values of one of the file's tensors of a plain type (not quantized), flat:
    for small tensors a header check reads (a head file's vocabulary map)."""
    dtype = np.dtype(_PLAIN_TYPES[tensor.type_name]).newbyteorder("<")
    return np.fromfile(file.path, dtype, tensor.n_elements, offset=tensor.offset)
