"""Images and audio through libmtmd, llama.cpp's multimodal library, from ctypes.

A projector (an `mmproj-*.gguf` file) is loaded for the target model it was made for. It
turns a prompt with media markers, and the media, into chunks: runs of text tokens, and
media chunks, each a run of embeddings of the target's input width that stand where tokens
would. A media chunk is encoded (the projector's encoder runs) and its embeddings decoded
into the target's context, at the positions after the text before it.

Positions: a chunk usually advances them by its token count. Under M-RoPE (Qwen2-VL and
later, `Projector.mrope`) an image's embeddings share one temporal position and take rows
and columns in the other sections; the image advances positions by max(rows, columns)
(`Chunk.n_pos`), and the text after it goes on from there. Right after such an image the
memory's last position is its temporal one, not the next position: count with n_pos.

Check a projector against its target with models.mmproj before loading it, and media with
media.py before they come here: libmtmd would only say that it failed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import FLASH_ATTN
from specdec_cli.llamacpp.media import Media, not_taken
from specdec_cli.llamacpp.model import Model

MARKER = mtmd.mtmd_default_marker().decode()  # where each image or clip goes in a prompt
CHUNK_KINDS = {
    mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT: "text",
    mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE: "image",
    mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO: "audio",
}


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


@dataclass(frozen=True)
class Chunk:
    """A run of a tokenized prompt: text tokens, or one image's or audio clip's
    embeddings. Valid while the Prompt it came from is open."""

    kind: str  # "text", "image" or "audio"
    tokens: tuple[int, ...]  # a text chunk's tokens; () for media
    n_tokens: int  # tokens, or embeddings, it puts in the context
    n_pos: int  # positions it advances by (see the module's docstring)
    id: str | None  # media: the SHA-256 of the file's bytes, libmtmd's key for it
    ptr: int


class Prompt:
    """A prompt tokenized with its media: its chunks, in order. Owns libmtmd's copy of
    them (the media preprocessed), freed by close."""

    def __init__(self, ptr: int) -> None:
        self.ptr: int | None = ptr
        n = mtmd.mtmd_input_chunks_size(ptr)
        self.chunks = [_chunk(mtmd.mtmd_input_chunks_get(ptr, i)) for i in range(n)]

    @property
    def n_pos(self) -> int:
        """Positions the whole prompt advances by."""
        return sum(chunk.n_pos for chunk in self.chunks)

    def close(self) -> None:
        if self.ptr:
            mtmd.mtmd_input_chunks_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Prompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunk(ptr: int) -> Chunk:
    kind = CHUNK_KINDS[mtmd.mtmd_input_chunk_get_type(ptr)]
    tokens: tuple[int, ...] = ()
    if kind == "text":
        n = ctypes.c_size_t()
        data = mtmd.mtmd_input_chunk_get_tokens_text(ptr, ctypes.byref(n))
        tokens = tuple(data[: n.value])
    media_id = mtmd.mtmd_input_chunk_get_id(ptr)
    return Chunk(
        kind,
        tokens,
        mtmd.mtmd_input_chunk_get_n_tokens(ptr),
        mtmd.mtmd_input_chunk_get_n_pos(ptr),
        media_id.decode() if media_id else None,
        ptr,
    )


@dataclass(frozen=True)
class EmbeddingBatch:
    """One decode call of a media chunk's embeddings, as libmtmd made it: the rows and the
    positions of each (`pos[s, i]`: section s of row i; one section, or M-RoPE's four:
    time, row, column, unused). Views into libmtmd's buffers: copy what must outlive the
    callback they are passed to."""

    embeddings: np.ndarray  # [n_tokens, n_embd] float32
    pos: np.ndarray  # [n_sections, n_tokens] int32
    seq_id: int


OnBatch = Callable[[EmbeddingBatch], None]


class Projector:
    """A multimodal projector loaded for `model` (its embeddings go into that model's
    contexts). `use_gpu`: run the encoder on the first GPU where the build has one."""

    def __init__(
        self,
        path: Path,
        model: Model,
        n_threads: int,
        use_gpu: bool = False,
        flash_attn: str = "auto",
        verbose: bool = False,
    ) -> None:
        if not verbose:
            mtmd.mtmd_helper_log_set(_quiet_log, None)  # libmtmd's and its helpers' logs
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = verbose
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        self.path = path
        self.model = model
        self.ptr = mtmd.mtmd_init_from_file(str(path).encode(), model.ptr, params)
        if not self.ptr:
            raise UserError(
                f"libmtmd could not load the projector {path} for {model.path.name}; check "
                "that it is the mmproj file made for this model (rerun with --verbose to see "
                "llama.cpp's own messages)"
            )
        self.vision: bool = mtmd.mtmd_support_vision(self.ptr)
        self.audio: bool = mtmd.mtmd_support_audio(self.ptr)
        self.mrope: bool = mtmd.mtmd_decode_use_mrope(self.ptr)
        self.n_embd: int = llama_cpp.llama_model_n_embd_inp(model.ptr)
        self.marker: str = MARKER

    def close(self) -> None:
        if self.ptr:
            mtmd.mtmd_free(self.ptr)
            self.ptr = None

    def tokenize(
        self,
        text: str,
        media: Sequence[Media],
        add_special: bool = True,
        parse_special: bool = True,
    ) -> Prompt:
        """`text` with one `marker` for each of `media`, in order, as chunks. The caller
        closes the Prompt."""
        n_markers = text.count(self.marker)
        if n_markers != len(media):
            raise UserError(
                f"the prompt has {n_markers} media markers ({self.marker}) for {len(media)} "
                "images or audio clips; put one marker where each goes"
            )
        bitmaps: list[int] = []
        try:
            bitmaps.extend(self._bitmap(item) for item in media)
            data = text.encode()
            text_in = mtmd.mtmd_input_text(data, len(data), add_special, parse_special)
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            chunks = mtmd.mtmd_input_chunks_init()
            status = mtmd.mtmd_tokenize(
                self.ptr, chunks, ctypes.byref(text_in), array, len(bitmaps)
            )
        finally:
            for bitmap in bitmaps:  # the chunks hold what they need of them
                mtmd.mtmd_bitmap_free(bitmap)
        prompt = Prompt(chunks)
        if status != 0:
            prompt.close()
            raise UserError(
                f"libmtmd could not prepare the prompt's media (status {status}) for "
                f"{self.path.name}; rerun with --verbose to see why"
            )
        return prompt

    def takes(self, item: Media) -> bool:
        """Whether it takes this kind of media (an image, audio)."""
        return not_taken(item, self.path.name, self.vision, self.audio) is None

    def _bitmap(self, item: Media) -> int:
        refusal = not_taken(item, self.path.name, self.vision, self.audio)
        if refusal:
            raise UserError(refusal)
        buf = (ctypes.c_uint8 * len(item.data)).from_buffer_copy(item.data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ptr, buf, len(item.data), False)
        if not bitmap:
            raise UserError(f"libmtmd could not decode {item.name} as {item.kind}; is it damaged?")
        return bitmap

    def encode(self, chunk: Chunk) -> np.ndarray:
        """A media chunk's embeddings, [n_tokens, n_embd]: the encoder's output, copied
        (kept, it is decoded again without encoding: a prompt cache's entry)."""
        if chunk.kind == "text":
            raise ValueError("only a media chunk has embeddings to encode")
        if mtmd.mtmd_encode_chunk(self.ptr, chunk.ptr) != 0:
            raise RuntimeError(f"libmtmd could not encode {chunk.kind} {chunk.id}")
        out = mtmd.mtmd_get_output_embd(self.ptr)
        return np.ctypeslib.as_array(out, shape=(chunk.n_tokens, self.n_embd)).copy()

    def decode(
        self,
        ctx: llama_cpp.llama_context_p,
        chunk: Chunk,
        embeddings: np.ndarray,
        n_past: int,
        seq_id: int,
        n_batch: int,
        on_batch: OnBatch | None = None,
    ) -> int:
        """Decode a media chunk's `embeddings` into sequence `seq_id` of `ctx` from
        position n_past on, n_batch rows a call (with the attention and positions its model
        needs: non-causal for Gemma 3, M-RoPE's sections), no logits; `on_batch` sees each
        call's rows after it. Returns the next position: n_past + chunk.n_pos."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.shape != (chunk.n_tokens, self.n_embd):
            raise ValueError(f"{chunk.kind} {chunk.id} takes {chunk.n_tokens} embeddings")
        failure: list[BaseException] = []
        callback = mtmd.mtmd_helper_post_decode_callback()  # NULL: nobody to tell
        if on_batch is not None:
            callback = _relay(on_batch, failure)
        new_n_past = llama_cpp.llama_pos(n_past)
        status = mtmd.mtmd_helper_decode_image_chunk(
            self.ptr,
            ctx,
            chunk.ptr,
            embeddings.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n_past,
            seq_id,
            n_batch,
            ctypes.byref(new_n_past),
            callback,
            None,
        )
        if failure:
            raise failure[0]
        if status != 0:
            raise RuntimeError(f"llama.cpp could not decode {chunk.kind} {chunk.id} ({status})")
        return new_n_past.value

    def eval_chunks(
        self,
        ctx: llama_cpp.llama_context_p,
        prompt: Prompt,
        n_past: int,
        seq_id: int,
        n_batch: int,
        logits_last: bool = True,
    ) -> int:
        """llama.cpp's own way through a whole prompt (mtmd_helper_eval_chunks): text
        decoded, media encoded and decoded, logits for the last token if asked. Returns
        the next position."""
        new_n_past = llama_cpp.llama_pos(n_past)
        status = mtmd.mtmd_helper_eval_chunks(
            self.ptr,
            ctx,
            prompt.ptr,
            n_past,
            seq_id,
            n_batch,
            logits_last,
            ctypes.byref(new_n_past),
        )
        if status != 0:
            raise RuntimeError(f"llama.cpp could not evaluate the prompt ({status})")
        return new_n_past.value


def _relay(on_batch: OnBatch, failure: list[BaseException]) -> ctypes._CFuncPtr:
    """libmtmd's post-decode callback calling on_batch; what on_batch raises is kept in
    `failure` (an exception cannot cross C) and ends the decode."""

    @mtmd.mtmd_helper_post_decode_callback
    def relay(batch: ctypes._Pointer, user_data: ctypes.c_void_p) -> int:
        try:
            on_batch(_embedding_batch(batch.contents))
        except BaseException as err:
            failure.append(err)
            return 1
        return 0

    return relay


def _embedding_batch(batch: mtmd.mtmd_helper_embd_batch) -> EmbeddingBatch:
    n = batch.n_tokens
    return EmbeddingBatch(
        np.ctypeslib.as_array(batch.embd, shape=(n, batch.n_embd)),
        np.ctypeslib.as_array(batch.pos, shape=(batch.n_pos, n)),
        batch.seq_id,
    )
