"""gguf_meta: read GGUF headers written by the reference `gguf` package, reject bad files."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import VOCAB_FAMILIES
from gguf import GGUFValue, GGUFValueType, TokenType
from ggufgen import HParams, Vocab, llama_metadata, spm_vocab, write_gguf

from specdec_cli.errors import UserError
from specdec_cli.models import gguf_meta
from specdec_cli.models.gguf_meta import GGUFFile, Skipped, check_gguf, read_gguf

TINY = HParams(n_embd=8, n_layer=2, n_ctx_train=128)


def u32(value: int) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.UINT32)


def string(value: str) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.STRING)


def flag(value: bool) -> GGUFValue:
    return GGUFValue(value, GGUFValueType.BOOL)


def tiny_model(
    path: Path,
    vocab: Vocab | None = None,
    changes: dict[str, GGUFValue | None] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A GGUF with llama metadata and a vocabulary but no runnable weights (unless given).

    changes overrides metadata keys; a None value removes the key.
    """
    metadata = llama_metadata(TINY, vocab or spm_vocab())
    for key, value in (changes or {}).items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return write_gguf(path, metadata, tensors or {})


def read_error(path: Path) -> str:
    """The UserError message read_gguf gives for path (failing if it gives none)."""
    with pytest.raises(UserError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message
    return message


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    return tiny_model(
        tmp_path / "good.gguf",
        changes={
            "general.file_type": None,
            "tokenizer.chat_template": string("{{ messages }}"),
            "split.count": GGUFValue(3, GGUFValueType.UINT16),
        },
        tensors={
            "token_embd.weight": np.zeros((16, 8), np.float16),
            "output_norm.weight": np.ones(8, np.float32),
        },
    )


def test_reads_metadata_and_tensors(good_file: Path) -> None:
    vocab = spm_vocab()
    model = read_gguf(good_file)
    assert isinstance(model, GGUFFile)
    assert model.version == 3
    assert model.file_size == good_file.stat().st_size
    assert model.architecture == "llama"
    assert (model.n_layers, model.context_length, model.embedding_length) == (2, 128, 8)
    assert model.vocab_type == "llama"
    assert model.tokens == vocab.tokens
    assert model.token_types == vocab.types
    assert model.metadata["tokenizer.ggml.scores"][-1] == vocab.scores[-1]
    assert model.chat_template == "{{ messages }}"
    assert model.split_count == 3
    assert [(t.name, t.shape, t.type_name) for t in model.tensors] == [
        ("token_embd.weight", (8, 16), "F16"),  # GGUF lists dimensions innermost first
        ("output_norm.weight", (8,), "F32"),
    ]
    assert model.n_params == 16 * 8 + 8
    assert model.quantization == "F16"  # no general.file_type: the type of most parameters


def test_file_type_key_names_the_quantization(tmp_path: Path) -> None:
    weights = {"w": np.zeros(8, np.float32)}  # without weights, a file has no quantization
    path = tiny_model(tmp_path / "m.gguf", changes={"general.file_type": u32(15)}, tensors=weights)
    assert read_gguf(path).quantization == "Q4_K_M"


def test_optional_keys_missing(tmp_path: Path) -> None:
    model = read_gguf(tiny_model(tmp_path / "m.gguf"))
    assert model.chat_template is None
    assert model.split_count == 1


def test_vocabulary_only_file(tmp_path: Path) -> None:
    """A tokenizer and no tensors: no weights, so no quantization either (whatever
    general.file_type says)."""
    model = read_gguf(tiny_model(tmp_path / "vocab.gguf", changes={"general.file_type": u32(1)}))
    assert model.vocab_only
    assert (model.n_params, model.quantization) == (0, None)
    weights = {"w": np.zeros(8, np.float32)}
    assert not read_gguf(tiny_model(tmp_path / "model.gguf", tensors=weights)).vocab_only
    # The first file of a split model may hold metadata only (gguf-split --no-tensor-first-split).
    split = {"split.count": GGUFValue(2, GGUFValueType.UINT16)}
    assert not read_gguf(tiny_model(tmp_path / "split.gguf", changes=split)).vocab_only


@pytest.mark.parametrize("family", VOCAB_FAMILIES)
def test_real_vocabulary_only_files_are_recognised(
    family: str, vocab_file: Callable[[str], Path]
) -> None:
    model = read_gguf(vocab_file(family))
    assert model.vocab_only and model.quantization is None


def test_file_without_vocabulary_or_tensors(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    write_gguf(path, {"general.architecture": string("llama")}, {})
    model = read_gguf(path)
    assert model.tokens == [] and model.token_types == [] and model.vocab_type is None
    assert model.n_layers is None
    assert model.n_params == 0 and model.quantization is None
    assert not model.vocab_only


def test_invalid_utf8_tokens_stay_distinct(tmp_path: Path) -> None:
    tokens = [b"<unk>", b"<s>", b"</s>", b"\xff", b"\xfe"]
    vocab = Vocab(tokens, [0.0] * 5, [int(TokenType.NORMAL)] * 5)
    model = read_gguf(tiny_model(tmp_path / "m.gguf", vocab))
    assert model.tokens[3] != model.tokens[4]
    assert model.tokens[3].encode("utf-8", "surrogateescape") == b"\xff"


def test_large_vocabulary_is_read_and_merges_skipped(tmp_path: Path) -> None:
    n = 150_000
    vocab = Vocab([f"token{i}" for i in range(n)], [0.0] * n, [int(TokenType.NORMAL)] * n)
    merges = GGUFValue([f"a{i} b{i}" for i in range(n)], GGUFValueType.ARRAY, GGUFValueType.STRING)
    after = GGUFValue("after the merges", GGUFValueType.STRING)
    extra = {"tokenizer.ggml.merges": merges, "test.next_key": after}
    path = tiny_model(tmp_path / "big.gguf", vocab, extra)
    model = read_gguf(path)
    assert len(model.tokens) == n and model.tokens[-1] == f"token{n - 1}"
    # Nothing reads the merges: stepped over (their count kept), and what follows is intact.
    assert model.metadata["tokenizer.ggml.merges"] == Skipped(n)
    assert model.metadata["test.next_key"] == "after the merges"


def test_stories260k(stories260k: Path) -> None:
    model = read_gguf(stories260k)
    assert model.architecture == "llama"
    assert (model.n_layers, model.context_length, model.embedding_length) == (5, 2048, 64)
    assert model.vocab_type == "llama" and len(model.tokens) == 512
    assert model.tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert model.quantization == "F32"
    assert model.n_params == 292_800
    check_gguf(stories260k)


# --- bad files: one UserError line naming the file and the fix ---


def test_missing_file(tmp_path: Path) -> None:
    assert "not found" in read_error(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in read_error(tmp_path)


def test_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: chmod does not stop root, and the tests may run as root.
    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    path = tiny_model(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_meta, "open", denied, raising=False)
    assert "permission denied" in read_error(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "is empty" in read_error(path)


@pytest.mark.parametrize(
    ("content", "shown"),
    [(b"PK\x03\x04" + bytes(60), "b'PK\\x03\\x04'"), (b"hello world\n", "b'hell'")],
)
def test_not_gguf(tmp_path: Path, content: bytes, shown: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    message = read_error(path)
    assert f"is not a GGUF file (it starts with {shown})" in message
    assert "pass a .gguf model file" in message


def patched(source: Path, dest: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(source.read_bytes())
    raw[offset : offset + len(data)] = data
    dest.write_bytes(bytes(raw))
    return dest


@pytest.mark.parametrize(("version", "phrase"), [(1, "GGUF version 1"), (99, "GGUF version 99")])
def test_unsupported_version(good_file: Path, tmp_path: Path, version: int, phrase: str) -> None:
    path = patched(good_file, tmp_path / "v.gguf", 4, struct.pack("<I", version))
    assert phrase in read_error(path)
    with pytest.raises(UserError, match=phrase):
        check_gguf(path)


def test_big_endian(tmp_path: Path) -> None:
    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert "big-endian" in read_error(path)


def test_truncated_header(good_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    raw = good_file.read_bytes()
    path.write_bytes(raw[: raw.index("▁happy".encode()) + 2])  # inside a vocabulary token
    assert "truncated or corrupt (it ends at byte" in read_error(path)
    check_gguf(path)  # the cheap check only looks at magic, version and counts


def test_file_shorter_than_header(good_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_file.read_bytes()[:10])
    assert "truncated" in read_error(path)
    with pytest.raises(UserError, match="truncated"):
        check_gguf(path)


def test_truncated_tensor_data(good_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_file.read_bytes()[:-16])
    assert "is truncated: its tensors need" in read_error(path)


def test_absurd_counts(good_file: Path, tmp_path: Path) -> None:
    path = patched(good_file, tmp_path / "n.gguf", 8, struct.pack("<Q", 2**60))
    assert "more than a" in read_error(path)
    with pytest.raises(UserError, match="truncated or corrupt"):
        check_gguf(path)


def test_unknown_value_type(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    key = b"general.name"
    header = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)
    path.write_bytes(header + struct.pack("<Q", len(key)) + key + struct.pack("<I", 77) + bytes(8))
    assert "unknown value type 77" in read_error(path)
