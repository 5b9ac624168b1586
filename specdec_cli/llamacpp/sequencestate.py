"""A sequence's state in host memory: a recurrent state's checkpoint, which a rewind
goes back to, and a whole sequence saved for the prompt cache."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp.llama_cpp as llama_cpp


@dataclass(frozen=True)
class MediaRun:
    """Media a sequence holds: its cells' places in Context.tokens, start to end, and
    the positions it saves, n_tokens - n_pos (the text after it sits that much lower)."""

    start: int
    end: int
    saved: int


@dataclass(frozen=True)
class SavedState:
    """A sequence's state in host memory (see Context.save_state)."""

    tokens: tuple[int, ...]
    data: ctypes.Array
    runs: int  # of cells it was copied from (see Context.runs)
    media: tuple[MediaRun, ...]  # the media among its tokens

    @property
    def nbytes(self) -> int:
        return len(self.data)


class Checkpoint:
    """A copy of a sequence's recurrent state, in a buffer reused from call to call.

    PARTIAL_ONLY saves only what cannot be cut back (the recurrent state, not a
    hybrid's attention cache), which keeps the copy small.
    """

    FLAGS = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

    def __init__(self) -> None:
        self.n_tokens: int | None = None  # the sequence length it was taken at
        self._buffer = (ctypes.c_uint8 * 0)()
        self._size = 0

    def save(self, ctx: llama_cpp.llama_context_p, seq: int, n_tokens: int) -> None:
        size = llama_cpp.llama_state_seq_get_size_ext(ctx, seq, self.FLAGS)
        if size > len(self._buffer):
            self._buffer = (ctypes.c_uint8 * size)()
        self._size = llama_cpp.llama_state_seq_get_data_ext(
            ctx, self._buffer, size, seq, self.FLAGS
        )
        if self._size == 0:
            raise RuntimeError("llama.cpp could not save the recurrent state")
        self.n_tokens = n_tokens

    def restore(self, ctx: llama_cpp.llama_context_p, seq: int, n_keep: int, name: str) -> int:
        """Put the saved state back, if it was taken at or before n_keep; its length."""
        if self.n_tokens is None or self.n_tokens > n_keep:
            raise RuntimeError(
                f"{name} is recurrent and has no checkpoint at or before position {n_keep} "
                "to return to"
            )
        if not llama_cpp.llama_state_seq_set_data_ext(
            ctx, self._buffer, self._size, seq, self.FLAGS
        ):
            raise RuntimeError(f"llama.cpp could not restore the recurrent state of {name}")
        return self.n_tokens

    def forget_after(self, n_tokens: int) -> None:
        """The sequence was cut before this copy was taken: it no longer applies."""
        if self.n_tokens is not None and self.n_tokens > n_tokens:
            self.n_tokens = None
