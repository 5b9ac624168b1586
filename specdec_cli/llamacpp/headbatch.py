"""What the slots of a drafting head's context share: the llama.cpp context, and the
extended batch (llama.cpp's llama_batch_ext) of its next decode call, which holds every
slot's rows. A row is a token at a position in a sequence, beside a hidden state
(`Rows`); a DFlash or EAGLE-3 file also takes feature rows (the target's layer inputs,
`features`).

Positions are the target's. At those an image or audio clip spans, a row's token is its
placeholder (negative): llama.cpp's head graphs take a token beside a state, never an
embedding beside one (a row of an embedding alone reads it as both), so such a row reads
a stand-in token (`stand_in`) beside the target's state there. Leaving such rows out
would leave a gap in the head's positions, which llama.cpp refuses except under M-RoPE
(llama_batch_allocr wants a sequence's positions to follow on), and keep from the head
what the target made of the media.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from specdec_cli.llamacpp.floatviews import FloatViews, address_of, nextn_states_at

if TYPE_CHECKING:
    from specdec_cli.llamacpp.heads import HeadContext


class RowPointer:
    """A llama_embd for one row of a float32 array, passed by value: one struct whose data
    pointer is rewritten in place for each row (a ctypes.cast and a struct a row cost
    more than the call that takes them)."""

    def __init__(self, width: int) -> None:
        self.embd = llama_cpp.llama_embd(None, 1, width)
        self._data = ctypes.c_size_t.from_buffer(self.embd)  # the pointer, at offset 0

    def at(self, address: int) -> llama_cpp.llama_embd:
        """The row at `address` (an array's address, read once a batch: numpy's
        `ctypes.data` makes an object each time, plus a stride a row)."""
        self._data.value = address
        return self.embd


class Rows(NamedTuple):
    """Token rows for a head: token i at positions[i], beside hidden[i] (None: token rows
    alone, reading no state), in sequence seqs[i] counted from the slot's own (None: the
    slot's own)."""

    tokens: Sequence[int]
    positions: Sequence[int]
    hidden: np.ndarray | None
    seqs: Sequence[int] | None = None

    def part(self, rows: slice) -> Rows:
        seqs = self.seqs[rows] if self.seqs is not None else None
        hidden = self.hidden[rows] if self.hidden is not None else None
        return Rows(self.tokens[rows], self.positions[rows], hidden, seqs)


def rows_after(pos: int, tokens: Sequence[int], hidden: np.ndarray | None) -> Rows:
    """`tokens` at positions pos, pos + 1, ... in the slot's own sequence."""
    if hidden is not None:
        hidden = np.ascontiguousarray(hidden, np.float32)
    return Rows(tokens, range(pos, pos + len(tokens)), hidden)


class HeadBatch:
    """A head's llama.cpp context, shared by its slots, and the batch of its next call."""

    def __init__(
        self,
        ptr: llama_cpp.llama_context_p,
        n_vocab: int,
        n_embd: int,
        n_ubatch: int,
        stand_in: int,
    ) -> None:
        """`stand_in`: the token of rows at media positions."""
        self.ptr: llama_cpp.llama_context_p | None = ptr
        self.n_vocab, self.n_embd, self.n_ubatch = n_vocab, n_embd, n_ubatch
        self.stand_in = stand_in
        self.batch = llama_cpp.llama_batch_ext_init(ptr)
        self.now_batch = llama_cpp.llama_batch_ext_init(ptr)  # calls made at once
        self.encoded = FloatViews((n_ubatch, n_embd))  # EAGLE-3's encoder's output
        self.staged: list[HeadContext] = []
        self.n_staged = 0
        self._pos = (ctypes.c_int32 * 4)()  # M-RoPE models read 4 (a token row: the first)
        # A feature row's: M-RoPE's three text positions, and 0 (as llama.cpp's driver).
        self._feature_pos = (ctypes.c_int32 * 4)()
        self.logit_rows = FloatViews((n_vocab,))  # views of its outputs (floatviews.py)
        self.state_rows = FloatViews((1, n_embd))
        self._state = RowPointer(n_embd)
        self._feature: RowPointer | None = None  # made at the first feature row (its width)
        # The MTP block the staged rows are for, and the one llama.cpp decodes with now.
        self.head, self._head_set = 0, 0

    def stage(self, slot: HeadContext, rows: Rows, every_row: bool = False, head: int = 0) -> None:
        """Add the slot's rows to the next call's batch (llama.cpp copies each row's hidden
        state now). The last row gives logits; `every_row`: every row. `head`: the MTP
        block they are for (chained blocks: one a call)."""
        if self.n_staged and head != self.head:
            raise RuntimeError(f"rows for MTP blocks {self.head} and {head} in one call")
        self.head = head
        logits_from = 0 if every_row or slot.logits_every_row else len(rows.tokens) - 1
        slot._first = self._add(self.batch, slot, rows, logits_from)
        slot._out = slot._first + len(rows.tokens) - 1
        self.staged.append(slot)
        self.n_staged += len(rows.tokens)

    def _add(
        self, batch: llama_cpp.llama_batch_ext_p, slot: HeadContext, rows: Rows, logits_from: int
    ) -> int:
        """Add token rows to `batch`, those from `logits_from` on with logits (a
        placeholder's read `stand_in`); return the first one's batch place."""
        place, idx, hidden = self._pos, -1, rows.hidden
        address, stride = (address_of(hidden), hidden.strides[0]) if hidden is not None else (0, 0)
        for i, token in enumerate(rows.tokens):
            seq = slot.seq if rows.seqs is None else slot.seq + rows.seqs[i]
            if token < 0:
                token = self.stand_in
            idx = llama_cpp.llama_batch_ext_add_token(batch, seq, token)
            if idx < 0:
                raise RuntimeError(f"the head's batch is full ({self.n_staged} rows)")
            place[0] = rows.positions[i]
            llama_cpp.llama_batch_ext_set_pos(batch, idx, place)
            if hidden is not None:
                state = self._state.at(address + i * stride)
                llama_cpp.llama_batch_ext_set_embd_token(batch, idx, state)
            if i >= logits_from:
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        return idx - len(rows.tokens) + 1  # a batch numbers its rows in order

    def decode_now(self, slot: HeadContext, rows: Rows, head: int = 0) -> None:
        """Decode the slot's rows now, without logits, in a batch apart (a ubatch a call),
        as llama.cpp's driver catches a head up: a text longer than a staged call holds.
        The staged rows wait for the next flush. Only before a round's first flush: the
        slots' outputs of a flush are read after it, and this call's would replace them."""
        self._use_head(head)
        batch = self.now_batch
        t0 = time.perf_counter()
        for start in range(0, len(rows.tokens), self.n_ubatch):
            part = rows.part(slice(start, start + self.n_ubatch))
            self._add(batch, slot, part, len(part.tokens))
            status = llama_cpp.llama_process(self.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
            llama_cpp.llama_batch_ext_clear(batch)
            if status != 0:
                raise RuntimeError(f"the drafting head's catch-up failed with status {status}")
            slot.decode_calls += 1
        llama_cpp.llama_synchronize(self.ptr)
        slot.decode_seconds += time.perf_counter() - t0

    def _use_head(self, head: int) -> None:
        """Decode the next call with MTP block `head` (chained blocks)."""
        if head != self._head_set:
            llama_cpp_ext.llama_set_nextn_layer_offset(self.ptr, head)
            self._head_set = head

    def features(
        self,
        seq: int,
        positions: Sequence[int],
        features: np.ndarray,
        out: np.ndarray | None = None,
    ) -> float:
        """Process rows of `features` at `positions` now, a ubatch a call, and return the
        seconds it took. With `out`: EAGLE-3's encoder, whose output for each row goes
        there (it reads no positions, but llama.cpp wants them to follow the sequence's
        memory); without: a DFlash decode that puts them into the cache, with no output
        (positions as llama.cpp's driver gives feature rows: M-RoPE's text three, and
        0)."""
        features = np.ascontiguousarray(features, np.float32)
        batch, place = self.now_batch, self._feature_pos
        encode = out is not None
        process = (
            llama_cpp.LLAMA_PROCESS_TYPE_ENCODE if encode else llama_cpp.LLAMA_PROCESS_TYPE_DECODE
        )
        if self._feature is None:
            self._feature = RowPointer(features.shape[1])
        address, stride = address_of(features), features.strides[0]
        t0 = time.perf_counter()
        for start in range(0, len(features), self.n_ubatch):
            stop = min(start + self.n_ubatch, len(features))
            for i in range(start, stop):
                row = self._feature.at(address + i * stride)
                idx = llama_cpp.llama_batch_ext_add_embd(batch, seq, row)
                place[0] = place[1] = place[2] = positions[i]
                llama_cpp.llama_batch_ext_set_pos(batch, idx, place)
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, encode)
            status = llama_cpp.llama_process(self.ptr, process, batch)
            llama_cpp.llama_batch_ext_clear(batch)
            if status != 0:
                raise RuntimeError(f"the drafting head's feature rows failed with status {status}")
            if encode:
                out[start:stop] = self.encoded.at(nextn_states_at(self.ptr))[: stop - start]
        llama_cpp.llama_synchronize(self.ptr)
        return time.perf_counter() - t0

    def flush(self, name: str) -> int:
        """Decode every slot's staged rows in one call: how many."""
        staged, n = self.staged, self.n_staged
        if not n:
            return 0
        self._use_head(self.head)
        t0 = time.perf_counter()
        status = llama_cpp.llama_process(self.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        llama_cpp.llama_synchronize(self.ptr)
        seconds = time.perf_counter() - t0
        llama_cpp.llama_batch_ext_clear(self.batch)
        self.staged, self.n_staged = [], 0
        if status != 0:
            raise RuntimeError(f"{name}: the drafting head's decode failed with status {status}")
        for slot in staged:
            slot.decode_seconds += seconds
            slot.decode_calls += 1
        return n

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_batch_ext_free(self.batch)
            llama_cpp.llama_batch_ext_free(self.now_batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
