"""Drafting heads inside the target: llama.cpp's MTP ("nextn") contexts, from ctypes.

An MTP head is a decoder block that reads two things at position p: the token there,
and the target's hidden state after position p - 1 (what the target's own output layer
reads to predict that token). From them it predicts the token after p, and gives a
hidden state of its own, which it reads at p + 1 to draft one more token, and so on.

So the target's context records its hidden state after every position it decodes
(`HiddenStates`, fed by the target Context's `on_decoded` hook), and the head's context
(`HeadContext`: a context of type LLAMA_CONTEXT_TYPE_MTP over the target's own model,
loaded with its nextn layers) is fed rows of (token, position, hidden state) through
llama.cpp's extended batches. As `common/speculative.cpp` does, the row at position 0
reads a zero hidden state. Slots split it as Context.split splits the target: one head
context serves every slot, and one call decodes every slot's staged rows.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import FLASH_ATTN, Context


def _floats(row_type: type[ctypes.Array], ptr: ctypes._Pointer) -> np.ndarray:
    """A numpy view of the floats at `ptr`, through a ctypes array type made once (making
    one a call, as np.ctypeslib.as_array does, costs tens of microseconds)."""
    return np.frombuffer(row_type.from_address(ctypes.addressof(ptr.contents)), np.float32)


class HiddenStates:
    """The target's hidden state after each position of one sequence, as far as it was
    decoded since the head last caught up (`forget_before`)."""

    def __init__(self, n_embd: int) -> None:
        self.n_embd = n_embd
        self.rows = np.zeros((64, n_embd), np.float32)
        self.start = 0  # the position of rows[0]
        self.end = 0  # one past the last position held

    def record(self, pos: int, rows: np.ndarray) -> None:
        """The states after positions pos, pos + 1, ...: a decode call's rows. A call
        that starts before what is held (a rewind, a replay) replaces it from there."""
        if not self.start <= pos <= self.end:
            self.start = self.end = pos  # what lay before is not needed again
        n = pos - self.start + len(rows)
        if n > len(self.rows):
            grown = np.zeros((max(n, 2 * len(self.rows)), self.n_embd), np.float32)
            grown[: pos - self.start] = self.rows[: pos - self.start]
            self.rows = grown
        self.rows[pos - self.start : n] = rows
        self.end = pos + len(rows)

    def before(self, first: int, last: int) -> np.ndarray:
        """The states after positions first - 1 .. last - 1: what the head reads beside
        the tokens at first .. last - 1. Zero where none is held (position 0, or a
        prefix the target took from a cache without decoding it): the head then drafts
        worse, never wrongly, since the target verifies every draft."""
        out = np.zeros((last - first, self.n_embd), np.float32)
        lo, hi = max(first - 1, self.start), min(last - 1, self.end)
        if lo < hi:
            out[lo - first + 1 : hi - first + 1] = self.rows[lo - self.start : hi - self.start]
        return out

    def forget_before(self, pos: int) -> None:
        """Keep only the states from position pos on."""
        if pos <= self.start:
            return
        keep = max(0, self.end - pos)
        self.rows[:keep] = self.rows[self.end - keep - self.start : self.end - self.start]
        self.start = self.end - keep


def record_hidden_states(target: Context) -> HiddenStates:
    """Make the target's decode calls keep every row's hidden state, and record this
    slot's in a HiddenStates. Call before the target's first decode."""
    llama_cpp_ext.llama_set_embeddings_nextn(target.ptr, True, False)
    n_embd = llama_cpp.llama_model_n_embd(target.model.ptr)
    states = HiddenStates(n_embd)
    # Unmasked, llama.cpp keeps a row for every place of a batch.
    whole_batch = ctypes.c_float * (llama_cpp.llama_n_batch(target.ptr) * n_embd)

    def decoded(pos: int, rows: slice) -> None:
        block = _floats(whole_batch, llama_cpp_ext.llama_get_embeddings_nextn(target.ptr))
        states.record(pos, block.reshape(-1, n_embd)[rows.start : rows.stop])

    target.on_decoded = decoded
    return states


class HeadContext:
    """A drafting head's context for one sequence (a slot), over a llama.cpp context of
    type MTP that may serve several slots. Like a draft model's Context, it holds a
    prefix of the accepted tokens (`tokens`), and `stage` + `flush` decode rows."""

    def __init__(self, target: Context, n_slots: int) -> None:
        """Over `target` (the whole target context, before it is split into slots), with
        its size, threads and flash attention."""
        model = target.model
        if not model.n_nextn:
            raise UserError(f"{model.path.name} has no MTP layers to draft with")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = llama_cpp.llama_n_ctx(target.ptr)
        cparams.n_batch = target.n_batch
        cparams.n_ubatch = min(target.n_batch, llama_cpp.llama_n_ubatch(target.ptr))
        cparams.n_seq_max = n_slots
        cparams.kv_unified = n_slots > 1
        cparams.n_threads = cparams.n_threads_batch = target.threads
        cparams.flash_attn_type = FLASH_ATTN[target.flash_attn]
        cparams.no_perf = False
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = target.ptr
        cparams.n_rs_seq = 0
        ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not ptr:
            raise UserError(f"llama.cpp could not create an MTP context for {model.path.name}")
        # Every row's hidden state, read by its batch place. Not "masked" (the rows with
        # logits only): llama.cpp then copies the first n_outputs rows of the graph's
        # state, which Qwen3.5's MTP graph computes for every row, so that a call whose
        # last row alone has logits hands back its first row's state.
        llama_cpp_ext.llama_set_embeddings_nextn(ptr, True, False)
        n_embd = llama_cpp.llama_model_n_embd(model.ptr)
        self._shared = _HeadShared(ptr, model.n_vocab, n_embd)
        self._owner = True
        self.model = model
        self.n_embd = n_embd
        self.n_ctx: int = target.n_ctx
        self.n_batch: int = target.n_batch
        self.threads = target.threads
        self._start(0)

    def _start(self, seq: int) -> None:
        self.seq = seq
        self.tokens: list[int] = []  # what the sequence holds, by position
        # The first `fed` of them were read beside the target's hidden states; the rest
        # beside the head's own (its drafts), which the next round must not keep.
        self.fed = 0
        self.decode_seconds = 0.0
        self.decode_calls = 0
        self._out = -1  # the batch place of this slot's row with logits, after a flush

    def split(self, n: int) -> list[HeadContext]:
        """n slots over this context (see Context.split)."""
        if n == 1:
            return [self]
        slots = []
        for i in range(n):
            slot = object.__new__(HeadContext)
            slot.__dict__.update(self.__dict__)
            slot._owner = False
            slot.n_ctx, slot.n_batch = self.n_ctx // n, self.n_batch // n
            slot._start(i)
            slots.append(slot)
        return slots

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        return self._shared.ptr

    def close(self) -> None:
        if self._owner:
            self._shared.close()

    def stage(
        self,
        tokens: Sequence[int],
        n_logits: int = 1,
        parents: Sequence[int] | None = None,
        hidden: np.ndarray | None = None,
    ) -> None:
        """Put `tokens` after the sequence into the next flush, each with its row of
        `hidden` (the hidden state before it; None: zeros, as costmodel's timing passes
        use); the last one gives logits and a hidden state. `n_logits` and `parents`
        are Context.stage's, for the cost measurements: only the last row has logits,
        and a head drafts chains."""
        assert parents is None, "a head drafts chains"
        pos = len(self.tokens)
        if hidden is None:
            hidden = np.zeros((len(tokens), self.n_embd), np.float32)
        self._shared.stage(self, tokens, pos, np.ascontiguousarray(hidden, np.float32))
        self.tokens.extend(tokens)

    def flush(self) -> int:
        return self._shared.flush(self.model.path.name)

    def decode(self, tokens: Sequence[int], pos: int, n_logits: int = 1) -> None:
        """Evaluate `tokens` at positions pos, pos + 1, ... with zero hidden states (the
        cost measurements' filler), a batch at a time."""
        assert pos == len(self.tokens)
        for start in range(0, len(tokens), self.n_batch):
            self.stage(tokens[start : start + self.n_batch])
            self.flush()

    def logits(self, i: int = -1) -> np.ndarray:
        """The last flush's logits for this slot's last staged token (a view)."""
        return _floats(self._shared.logit_row, llama_cpp.llama_get_logits_ith(self.ptr, self._out))

    def hidden(self) -> np.ndarray:
        """The head's own hidden state after that token: what it reads for the next."""
        ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ptr, self._out)
        return _floats(self._shared.state_row, ptr).reshape(1, -1).copy()

    def rewind(self, n_keep: int) -> int:
        """Forget every position >= n_keep (a head's memory is attention only)."""
        if n_keep < len(self.tokens):
            memory = llama_cpp.llama_get_memory(self.ptr)
            llama_cpp.llama_memory_seq_rm(memory, self.seq, n_keep, -1)
            del self.tokens[n_keep:]
        self.fed = min(self.fed, len(self.tokens))
        return len(self.tokens)

    def trim(self, n_keep: int) -> None:
        self.rewind(n_keep)

    def checkpoint(self, n_ahead: int | None = None) -> None:
        """Nothing to save: an attention cache drops any suffix."""

    def drop_branches(self) -> None:
        """A head drafts chains: no branches."""

    def perf_seconds(self) -> float:
        data = llama_cpp.llama_perf_context(self.ptr)
        return (data.t_eval_ms + data.t_p_eval_ms) / 1e3


class _HeadShared:
    """What a head context's slots share: the llama.cpp context, and the extended batch
    of the next call, with each slot's rows."""

    def __init__(self, ptr: llama_cpp.llama_context_p, n_vocab: int, n_embd: int) -> None:
        self.ptr: llama_cpp.llama_context_p | None = ptr
        self.n_vocab, self.n_embd = n_vocab, n_embd
        self.batch = llama_cpp.llama_batch_ext_init(ptr)
        self.staged: list[HeadContext] = []
        self.n_staged = 0
        self._pos = (ctypes.c_int32 * 4)()  # M-RoPE models read 4 (text: the first)
        self.logit_row = ctypes.c_float * n_vocab
        self.state_row = ctypes.c_float * n_embd
        # One row's hidden state, passed by value: its data pointer is rewritten in place
        # for each row (a ctypes.cast and a struct a row cost more than the call).
        self._embd = llama_cpp.llama_embd(None, 1, n_embd)
        self._embd_data = ctypes.c_size_t.from_buffer(self._embd)  # the pointer, at offset 0

    def stage(self, slot: HeadContext, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Add the rows to the batch now: llama.cpp copies each row's hidden state."""
        batch, place, embd, embd_data = self.batch, self._pos, self._embd, self._embd_data
        row_bytes = hidden.strides[0]
        base = hidden.ctypes.data
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            idx = llama_cpp.llama_batch_ext_add_token(batch, slot.seq, token)
            if idx < 0:
                raise RuntimeError(f"the head's batch is full ({self.n_staged} rows)")
            place[0] = pos + i
            llama_cpp.llama_batch_ext_set_pos(batch, idx, place)
            embd_data.value = base + i * row_bytes
            llama_cpp.llama_batch_ext_set_embd_token(batch, idx, embd)
            if i == last:
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
                slot._out = idx
        self.staged.append(slot)
        self.n_staged += len(tokens)

    def flush(self, name: str) -> int:
        staged, n = self.staged, self.n_staged
        if not n:
            return 0
        t0 = time.perf_counter()
        status = llama_cpp.llama_process(self.ptr, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        llama_cpp.llama_synchronize(self.ptr)
        seconds = time.perf_counter() - t0
        llama_cpp.llama_batch_ext_clear(self.batch)
        self.staged, self.n_staged = [], 0
        if status != 0:
            raise RuntimeError(f"{name}: the MTP head's decode failed with status {status}")
        for slot in staged:
            slot.decode_seconds += seconds
            slot.decode_calls += 1
        return n

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_batch_ext_free(self.batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
