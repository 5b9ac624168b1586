"""Images through libmtmd, at llama.cpp's level (llamacpp/mtmd.py): on test models whose
answer depends on the image (mtmdgen), a red image and a blue one give their own texts,
positions after an image are llama.cpp's (M-RoPE's differ from the token count), llama.cpp's
own llama-mtmd-cli writes the same text, and bad media and projectors are refused in one
line before libmtmd sees them."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import subprocess
import wave
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
import pytest
from llamatools import TOOL_MARGIN, llama_tool
from mtmdgen import CHATML, COLORS, VisionPair, png, write_mlp_projector, write_vision_pair

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.media import MAX_MEDIA_BYTES, Media, media_from_bytes, read_media
from specdec_cli.llamacpp.model import Model, apply_chat_template, init_backend
from specdec_cli.llamacpp.mtmd import EmbeddingBatch, OnBatch, Projector, Prompt
from specdec_cli.models.gguf_meta import read_gguf
from specdec_cli.models.mmproj import check_projector, read_projector

QUESTION = "What colour is it?"
N_PREDICT = 8
N_CTX = 512


@dataclass
class Loaded:
    """A pair loaded: the target, a context for it, its projector."""

    pair: VisionPair
    model: Model
    ctx: Context
    projector: Projector

    def prompt(self, colour: str | None) -> tuple[str, list[Media]]:
        """The chat prompt asking about an image of that colour (None: no image)."""
        marker = self.projector.marker if colour else ""
        text = apply_chat_template(CHATML, [("user", marker + QUESTION)], add_assistant=True)
        assert text is not None
        return text, [image(self.pair, colour)] if colour else []

    def fresh(self, seq: int = 0) -> None:
        llama_cpp.llama_memory_seq_rm(self.ctx.memory, seq, -1, -1)

    def pos_max(self, seq: int = 0) -> int:
        return llama_cpp.llama_memory_seq_pos_max(self.ctx.memory, seq)

    def last_logits(self) -> np.ndarray:
        row = llama_cpp.llama_get_logits_ith(self.ctx.ptr, -1)
        return np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).copy()


def image(pair: VisionPair, colour: str) -> Media:
    return media_from_bytes(png(pair.image_size, pair.image_size, COLORS[colour]), colour)


def load(pair: VisionPair) -> Iterator[Loaded]:
    init_backend()
    model = Model(pair.target)
    params = ContextParams(n_ctx=N_CTX, n_threads=1, flash_attn="off", n_seq_max=2)
    ctx = Context(model, params)
    projector = Projector(pair.mmproj, model, n_threads=1, flash_attn="off")
    yield Loaded(pair, model, ctx, projector)
    projector.close()
    ctx.close()
    model.close()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    yield from load(write_vision_pair(tmp_path_factory.mktemp("llava")))


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    yield from load(write_vision_pair(tmp_path_factory.mktemp("qwen2vl"), mrope=True))


@pytest.fixture(params=["llava", "qwen2vl"])
def loaded(request: pytest.FixtureRequest) -> Loaded:
    return request.getfixturevalue(request.param)


def decode_text(ctx: Context, tokens: tuple[int, ...], pos: int, seq: int = 0) -> None:
    """Tokens at pos, pos + 1, ... of sequence `seq`, logits for the last (one call)."""
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = seq, i == len(tokens) - 1
        assert llama_cpp.llama_decode(ctx.ptr, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)


def prefill(
    loaded: Loaded,
    prompt: Prompt,
    n_batch: int = N_CTX,
    on_batch: OnBatch | None = None,
    seq: int = 0,
) -> int:
    """The prompt into sequence `seq`, emptied first, through the binding: text chunks
    decoded here, media encoded and decoded by the projector. Returns the next position."""
    loaded.fresh(seq)
    pos = 0
    for chunk in prompt.chunks:
        if chunk.kind == "text":
            decode_text(loaded.ctx, chunk.tokens, pos, seq)
            pos += chunk.n_pos
        else:
            embeddings = loaded.projector.encode(chunk)
            pos = loaded.projector.decode(
                loaded.ctx.ptr, chunk, embeddings, pos, seq, n_batch, on_batch
            )
    return pos


def greedy(loaded: Loaded, pos: int, n: int) -> list[int]:
    """n tokens by argmax, each decoded at the next position."""
    out: list[int] = []
    while len(out) < n:
        out.append(int(np.argmax(loaded.last_logits())))
        decode_text(loaded.ctx, (out[-1],), pos + len(out) - 1)
    return out


def answer(loaded: Loaded, colour: str | None) -> list[int]:
    text, media = loaded.prompt(colour)
    with loaded.projector.tokenize(text, media) as prompt:
        return greedy(loaded, prefill(loaded, prompt), N_PREDICT)


@pytest.mark.parametrize("colour", ["red", "blue", "green", None])
def test_the_image_decides_the_answer(loaded: Loaded, colour: str | None) -> None:
    """Red is answered "red" and blue "blue", then each word's successors; an image of no
    known colour, or none, leaves the default. The test models' tables say which."""
    assert answer(loaded, colour) == loaded.pair.greedy(colour, N_PREDICT)


def test_a_wrong_image_changes_every_token(loaded: Loaded) -> None:
    red, blue = answer(loaded, "red"), answer(loaded, "blue")
    assert all(r != b for r, b in zip(red, blue, strict=True))


def test_two_sequences_hold_their_own_images(loaded: Loaded) -> None:
    """Slots: a red image in sequence 0 and a blue one in sequence 1 of one context, each
    answered by its own, a token of each in turn."""
    ends, texts = [], []
    for seq, colour in enumerate(["red", "blue"]):
        text, media = loaded.prompt(colour)
        with loaded.projector.tokenize(text, media) as prompt:
            ends.append(prefill(loaded, prompt, seq=seq))
        texts.append([int(np.argmax(loaded.last_logits()))])
    for i in range(N_PREDICT - 1):
        for seq, tokens in enumerate(texts):
            decode_text(loaded.ctx, (tokens[-1],), ends[seq] + i, seq)
            tokens.append(int(np.argmax(loaded.last_logits())))
    assert texts == [loaded.pair.greedy("red", N_PREDICT), loaded.pair.greedy("blue", N_PREDICT)]


def test_an_error_in_on_batch_comes_out_of_decode(llava: Loaded) -> None:
    """What the callback raises (a drafter that failed) is raised by decode, not lost in C."""
    text, media = llava.prompt("red")

    def fail(batch: EmbeddingBatch) -> None:
        raise ValueError("the drafter failed")

    with (
        llava.projector.tokenize(text, media) as prompt,
        pytest.raises(ValueError, match="the drafter failed"),
    ):
        prefill(llava, prompt, on_batch=fail)


def test_llama_cpps_helper_decodes_the_same(loaded: Loaded) -> None:
    """mtmd_helper_eval_chunks (llama.cpp's way through a whole prompt) ends at the same
    position with the same logits as the binding's encode and decode."""
    text, media = loaded.prompt("blue")
    with loaded.projector.tokenize(text, media) as prompt:
        ours = prefill(loaded, prompt)
        our_logits = loaded.last_logits()
        loaded.fresh()
        theirs = loaded.projector.eval_chunks(loaded.ctx.ptr, prompt, 0, 0, N_CTX)
    assert ours == theirs
    np.testing.assert_allclose(loaded.last_logits(), our_logits, rtol=0, atol=1e-5)


def test_chunks_carry_the_text_tokens_and_the_image(loaded: Loaded) -> None:
    """Text, the image (its id the SHA-256 of the file: a cache's key), text; the text
    after the image is the model's own tokenization of it."""
    text, media = loaded.prompt("red")
    with loaded.projector.tokenize(text, media) as prompt:
        kinds = [chunk.kind for chunk in prompt.chunks]
        first, picture, rest = prompt.chunks
    assert kinds == ["text", "image", "text"]
    assert picture.id == hashlib.sha256(media[0].data).hexdigest()
    assert (picture.n_tokens, picture.n_pos) == (
        loaded.pair.n_image_tokens,
        loaded.pair.n_image_pos,
    )
    after = text.split(loaded.projector.marker)[1]
    if loaded.projector.mrope:  # Qwen2-VL's projector closes an image with its own token
        after = "<|vision_end|>" + after
    assert list(rest.tokens) == loaded.model.tokenize(after, add_special=False)
    assert first.tokens[0] == loaded.model.bos


def test_positions_after_an_image_are_llama_cpps(loaded: Loaded) -> None:
    """After the prompt, the next position is llama_memory_seq_pos_max + 1, the sum of the
    chunks' n_pos: under M-RoPE the image's 16 tokens take 4 positions, so it is 12 less
    than the token count. Right after such an image the memory's last position is the
    image's temporal one: only n_pos says where the text goes on."""
    text, media = loaded.prompt("red")
    with loaded.projector.tokenize(text, media) as prompt:
        first, picture, _ = prompt.chunks
        end = prefill(loaded, prompt)
        assert end == prompt.n_pos == loaded.pos_max() + 1
        n_tokens = sum(chunk.n_tokens for chunk in prompt.chunks)
        assert n_tokens - end == picture.n_tokens - picture.n_pos
        loaded.fresh()
        decode_text(loaded.ctx, first.tokens, 0)
        after_image = loaded.projector.decode(
            loaded.ctx.ptr, picture, loaded.projector.encode(picture), first.n_pos, 0, N_CTX
        )
    assert after_image == first.n_pos + picture.n_pos
    last_image_pos = first.n_pos if loaded.projector.mrope else after_image - 1
    assert loaded.pos_max() == last_image_pos


def test_every_decode_call_of_an_image_is_seen_with_its_positions(loaded: Loaded) -> None:
    """on_batch sees the image's rows in calls of n_batch, in order, with the positions
    llama.cpp gave them: one section counting on; or, under M-RoPE, the image's temporal
    position, its row and its column (from where it starts), and an unused fourth. The
    logits after the prompt are those of decoding the image in one call."""
    text, media = loaded.prompt("red")
    seen: list[EmbeddingBatch] = []

    def keep(batch: EmbeddingBatch) -> None:
        seen.append(EmbeddingBatch(batch.embeddings.copy(), batch.pos.copy(), batch.seq_id))

    with loaded.projector.tokenize(text, media) as prompt:
        first, picture, _ = prompt.chunks
        prefill(loaded, prompt, n_batch=3, on_batch=keep)
        in_small_calls = loaded.last_logits()
        prefill(loaded, prompt)
        np.testing.assert_allclose(loaded.last_logits(), in_small_calls, rtol=0, atol=1e-5)
        embeddings = loaded.projector.encode(picture)
    n = picture.n_tokens
    assert [len(batch.embeddings) for batch in seen] == [3] * (n // 3) + [n % 3] * (n % 3 > 0)
    assert np.array_equal(np.concatenate([batch.embeddings for batch in seen]), embeddings)
    assert {batch.seq_id for batch in seen} == {0}
    pos = np.concatenate([batch.pos for batch in seen], axis=1)
    i, start = np.arange(n), first.n_pos
    if loaded.projector.mrope:
        side = picture.n_pos
        expected = [np.full(n, start), start + i // side, start + i % side, np.zeros(n)]
    else:
        expected = [start + i]
    assert np.array_equal(pos, np.array(expected))


def test_a_wrong_position_shows_in_the_logits(qwen2vl: Loaded) -> None:
    """The text after an M-RoPE image put at the token count's positions, not n_pos's:
    the same argmax (the tables), other logits. Exactness tests can see such a mistake."""
    text, media = qwen2vl.prompt("red")
    with qwen2vl.projector.tokenize(text, media) as prompt:
        first, picture, rest = prompt.chunks
        prefill(qwen2vl, prompt)
        right = qwen2vl.last_logits()
        qwen2vl.fresh()
        decode_text(qwen2vl.ctx, first.tokens, 0)
        embeddings = qwen2vl.projector.encode(picture)
        qwen2vl.projector.decode(qwen2vl.ctx.ptr, picture, embeddings, first.n_pos, 0, N_CTX)
        decode_text(qwen2vl.ctx, rest.tokens, first.n_pos + picture.n_tokens)
        wrong = qwen2vl.last_logits()
    assert np.argmax(wrong) == np.argmax(right) == qwen2vl.pair.answer["red"]
    assert np.abs(wrong - right).max() > 1e-3


@pytest.mark.parametrize("colour", ["red", "blue"])
def test_llama_mtmd_cli_writes_the_same_text(loaded: Loaded, colour: str, tmp_path: Path) -> None:
    """llama.cpp's own llama-mtmd-cli (the model's chat template, greedy) on the same files
    and the same image writes what the binding's greedy decoding writes."""
    tool = llama_tool("llama-mtmd-cli")
    path = tmp_path / f"{colour}.png"
    path.write_bytes(image(loaded.pair, colour).data)
    marker = "--- specdec: the answer follows ---"
    command = [str(tool), "-m", str(loaded.pair.target), "--mmproj", str(loaded.pair.mmproj)]
    command += ["--image", str(path), "-p", loaded.projector.marker + QUESTION]
    # Tokens past ours: llama.cpp's logger, through which the tool prints, may lose its last
    # lines at exit (it is leaked, never flushed: common/log.cpp, llama.cpp issue #22142).
    n = N_PREDICT + TOOL_MARGIN
    command += ["-n", str(n), "--temp", "0", "-t", "1", "-fa", "off", "-c", str(N_CTX)]
    env = os.environ | {"MTMD_TEST_RESPONSE_MARKER": marker}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = result.stdout.split(marker, 1)[1].strip()
    ours = b"".join(loaded.model.piece(t) for t in answer(loaded, colour)).decode()
    assert theirs.startswith(ours.strip())


# Bad input: refused in one line that names it, before libmtmd sees it.


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR chunk, claiming that size (no pixels follow)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + b"\0\0\0\0"


def wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(16000)
        file.writeframes(b"\0\0" * 1600)
    return out.getvalue()


def one_line(err: pytest.ExceptionInfo[UserError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "is empty"),
        (b"Hello, world\n", "is not an image (PNG, JPEG, GIF or BMP) or audio"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "WebP"),
        (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDX", "header is damaged"),
        (png_header(0, 16), "header is damaged"),
        (png_header(10000, 10000), "10000x10000 pixels, more than the 67,108,864"),
        (b"GIF89a" + struct.pack("<HH", 9000, 9000), "9000x9000 pixels"),
    ],
)
def test_what_is_not_an_image_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(UserError) as err:
        media_from_bytes(data, "photo.png")
    assert "photo.png" in one_line(err)
    assert says in str(err.value)


@pytest.mark.parametrize(
    ("data", "size"),
    [
        (png(3, 2, (0, 0, 0)), (3, 2)),
        (b"GIF89a" + struct.pack("<HH", 640, 480), (640, 480)),
        (b"BM" + bytes(12) + struct.pack("<Iii", 40, 800, -600), (800, 600)),  # top-down
        (b"\xff\xd8\xff\xe0\0\x04ab\xff\xc0\0\x11\x08\x01\xe0\x02\x80", (640, 480)),
    ],
)
def test_an_image_is_read_with_its_size(data: bytes, size: tuple[int, int]) -> None:
    media = media_from_bytes(data, "picture")
    assert (media.kind, media.width, media.height) == ("image", *size)


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.png"
    with path.open("wb") as file:
        file.truncate(MAX_MEDIA_BYTES + 1)  # sparse: no bytes written
    with pytest.raises(UserError) as err:
        read_media(path)
    assert "huge.png is 20.0 MiB, more than the 20 MiB" in one_line(err)


def test_an_image_libmtmd_cannot_decode_is_refused(llava: Loaded) -> None:
    """A PNG header over pixels that are not there: libmtmd's decoder fails, in one line."""
    text, _ = llava.prompt("red")
    with pytest.raises(UserError) as err:
        llava.projector.tokenize(text, [media_from_bytes(png_header(16, 16), "broken.png")])
    assert "could not decode broken.png as image" in one_line(err)


def test_audio_to_a_projector_for_images_only_is_refused(llava: Loaded) -> None:
    text, _ = llava.prompt("red")
    clip = media_from_bytes(wav(), "speech.wav")
    assert clip.kind == "audio"
    with pytest.raises(UserError) as err:
        llava.projector.tokenize(text, [clip])
    assert "speech.wav is audio, but the projector mmproj.gguf takes images only" in one_line(err)


def test_markers_and_media_must_match(llava: Loaded) -> None:
    text, media = llava.prompt("red")
    with pytest.raises(UserError) as err:
        llava.projector.tokenize(text + llava.projector.marker, media)
    assert "2 media markers (<__media__>) for 1 images" in one_line(err)


def test_a_projector_for_another_model_is_refused_from_the_headers(
    loaded: Loaded, tmp_path: Path
) -> None:
    """Its width against the target's, read from both headers (nothing loads); libmtmd,
    loading it, would refuse it too, without saying why."""
    target = read_gguf(loaded.pair.target)
    check_projector(read_projector(loaded.pair.mmproj), target)  # its own: taken
    wider = replace(loaded.pair.dims, n_embd=loaded.pair.dims.n_embd + 64)
    other, *_ = write_mlp_projector(tmp_path / "mmproj-other.gguf", wider)
    with pytest.raises(UserError) as err:
        check_projector(read_projector(other), target)
    width = loaded.pair.dims.n_embd
    assert (
        f"the projector mmproj-other.gguf writes embeddings {width + 64} wide, but "
        f"target.gguf reads {width}: it was made for another model"
    ) in one_line(err)
    with pytest.raises(UserError, match="libmtmd could not load the projector"):
        Projector(other, loaded.model, n_threads=1)


def test_a_model_is_not_a_projector(llava: Loaded) -> None:
    with pytest.raises(UserError) as err:
        read_projector(llava.pair.target)
    assert "is not a multimodal projector (its architecture is llama)" in one_line(err)


def test_the_projectors_say_what_they_take(loaded: Loaded) -> None:
    info = read_projector(loaded.pair.mmproj)
    mrope = loaded.projector.mrope
    assert info.projector_type == ("qwen2vl_merger" if mrope else "mlp")
    assert (info.vision, info.audio, info.n_embd) == (True, False, loaded.pair.dims.n_embd)
    assert (loaded.projector.vision, loaded.projector.audio) == (True, False)
    assert loaded.projector.n_embd == loaded.pair.dims.n_embd


def test_quiet_unless_verbose(llava: Loaded, capfd: pytest.CaptureFixture[str]) -> None:
    """libmtmd logs every image it encodes; the binding silences it."""
    answer(llava, "red")
    assert capfd.readouterr().err == ""
