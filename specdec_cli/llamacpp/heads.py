"""Drafting heads: llama.cpp's MTP ("nextn") and EAGLE-3 contexts, from ctypes.

An MTP head is a decoder block that reads two things at position p: the token there,
and the target's hidden state after position p - 1 (what the target's own output layer
reads to predict that token). From them it predicts the token after p, and gives a
hidden state of its own, which it reads at p + 1 to draft one more token, and so on.
A draft tree grows the same way, a depth a call: each node in a branch of its own (a
sequence forked from its parent's), beside the head's state at its parent's row
(`stage_branches`).

So the target's context records its hidden state after every position it decodes
(`HiddenStates`, fed by the target Context's `on_decoded` hook), and the head's context
(`HeadContext`: a context of type LLAMA_CONTEXT_TYPE_MTP over the target's own model,
loaded with its nextn layers) is fed rows of (token, position, hidden state) through
llama.cpp's extended batches. As `common/speculative.cpp` does, the row at position 0
reads a zero hidden state. Slots split it as Context.split splits the target: one head
context serves every slot, and one call decodes every slot's staged rows.

An EAGLE-3 head is the same loop over other states: the inputs of three target layers,
which its own encoder turns into its state (HeadContext.states_for), one position earlier
(its row at p reads the token at p + 1).

A DFlash drafter reads target layer inputs too, but not beside a token: each position
the target decoded goes into its cache as keys and values made from them (`inject`, a
decode of feature rows), and one decode of a block [last token, mask, mask, ...], which
attends both ways, predicts at each mask's row the token at that position (`stage_block`):
a whole draft a call.

A Gemma 4 assistant has no cache of its own: its attention reads the target's (its last
sliding-window and last full layers'), so it needs no catch-up. Each of its rows sits at
the position of the text's last token, beside a hidden state (the target's before it,
then its own), and reads the target's cache up to there (`stage_at`).

Some models (MiMo-V2, Step-3.5, Hunyuan v3, ...) carry several MTP blocks, one a draft
step; llama.cpp picks a call's block with llama_set_nextn_layer_offset. Each block
attends over its own keys and values, so each keeps a sequence of its own in the head's
context (`stage_head`): a call decodes one block's rows, every slot's.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Sequence

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.llama import FLASH_ATTN, Context, Model
from specdec_cli.models.heads import DFLASH_BLOCK_SIZE, MTP_STATES_OF_OUTPUTS_ONLY


def _floats(row_type: type[ctypes.Array], ptr: ctypes._Pointer) -> np.ndarray:
    """A numpy view of the floats at `ptr`, through a ctypes array type made once (making
    one a call, as np.ctypeslib.as_array does, costs tens of microseconds)."""
    return np.frombuffer(row_type.from_address(ctypes.addressof(ptr.contents)), np.float32)


class _RowPointer:
    """A llama_embd for one row of a float32 array, passed by value: one struct whose data
    pointer is rewritten in place for each row (a ctypes.cast and a struct a row cost
    more than the call that takes them)."""

    def __init__(self, width: int) -> None:
        self.embd = llama_cpp.llama_embd(None, 1, width)
        self._data = ctypes.c_size_t.from_buffer(self.embd)  # the pointer, at offset 0

    def at(self, rows: np.ndarray, i: int) -> llama_cpp.llama_embd:
        self._data.value = rows.ctypes.data + i * rows.strides[0]
        return self.embd


class HiddenStates:
    """The target's hidden state after each position of one sequence, as far as it was
    decoded since the head last caught up (`forget_before`)."""

    def __init__(self, n_embd: int) -> None:
        self.n_embd = n_embd
        self.rows = np.zeros((64, n_embd), np.float32)
        self.start = 0  # the position of rows[0]
        self.end = 0  # one past the last position held

    def record(self, pos: int, blocks: Sequence[np.ndarray]) -> None:
        """The states after positions pos, pos + 1, ...: a decode call's rows, given as
        blocks of columns side by side (one per layer read), copied once, into place. A
        call that starts before what is held (a rewind, a replay) replaces it from there."""
        if not self.start <= pos <= self.end:
            self.start = self.end = pos  # what lay before is not needed again
        n_rows = len(blocks[0])
        n = pos - self.start + n_rows
        if n > len(self.rows):
            grown = np.zeros((max(n, 2 * len(self.rows)), self.n_embd), np.float32)
            grown[: pos - self.start] = self.rows[: pos - self.start]
            self.rows = grown
        column = 0
        for block in blocks:
            width = block.shape[1]
            self.rows[pos - self.start : n, column : column + width] = block
            column += width
        self.end = pos + n_rows

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


def _mangled(name: str, argtypes: list, restype: object) -> Callable | None:
    """A function of llama.cpp's src/llama-ext.h, a C++ header: exported under its mangled
    (Itanium ABI) name, and not bound by llama-cpp-python. None where the build lacks it."""
    try:
        function = getattr(llama_cpp._lib, name)
    except AttributeError:
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


_set_layer_input = _mangled(
    "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool],
    None,
)
_get_layer_input = _mangled(
    "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    [ctypes.c_void_p, ctypes.c_uint32],
    ctypes.POINTER(ctypes.c_float),
)


def _metadata(model: Model, key: str) -> str | None:
    """A model's metadata value, as llama.cpp gives it (None: absent)."""
    buffer = ctypes.create_string_buffer(64)
    if llama_cpp.llama_model_meta_val_str(model.ptr, key.encode(), buffer, len(buffer)) < 0:
        return None
    return buffer.value.decode()


def record_hidden_states(target: Context, layers: Sequence[int] = ()) -> HiddenStates:
    """Make the target's decode calls keep, for every row, its final hidden state (an
    MTP head's input), or with `layers` the inputs of those layers side by side (an
    EAGLE-3 head's; id n_layer is the final state), and record this slot's in a
    HiddenStates. Call before the target's first decode: llama.cpp reserves its graph for
    them then (enabled later, their values stay zero)."""
    ptr, n_embd = target.ptr, llama_cpp.llama_model_n_embd(target.model.ptr)
    n_layer = llama_cpp.llama_model_n_layer(target.model.ptr)
    sources: list[Callable[[], ctypes._Pointer]] = []
    for layer in layers or [n_layer]:
        if layer < n_layer:
            if _set_layer_input is None or _get_layer_input is None:
                raise UserError("this llama.cpp build does not export its layer inputs")
            _set_layer_input(ptr, layer, True)
            sources.append(functools.partial(_get_layer_input, ptr, layer))
        else:
            llama_cpp_ext.llama_set_embeddings_nextn(ptr, True, False)
            sources.append(functools.partial(llama_cpp_ext.llama_get_embeddings_nextn, ptr))
    states = HiddenStates(n_embd * len(sources))
    # Unmasked, llama.cpp keeps a row for every place of a batch.
    whole_batch = ctypes.c_float * (llama_cpp.llama_n_batch(ptr) * n_embd)

    def decoded(pos: int, rows: slice | list[int]) -> None:
        states.record(
            pos, [_floats(whole_batch, read()).reshape(-1, n_embd)[rows] for read in sources]
        )

    target.on_decoded = decoded
    return states


class HeadContext:
    """A drafting head's context for one sequence (a slot), over a llama.cpp context that
    may serve several slots. Like a draft model's Context, it holds a prefix of what it
    reads (`tokens`), `stage` + `flush` decode rows, and for one round at a time its
    draft tree's branches follow its own sequence (`fork`, `stage_branches`,
    `drop_branches`).

    Three kinds: "mtp", the target's own MTP block (a context of type MTP over the
    target's weights), reading at position p the token at p beside the target's state
    after p - 1; "eagle3", an EAGLE-3 draft file (its context borrows the target's
    embeddings and output through ctx_other), reading at position p the token at p + 1
    beside its encoding of the target's layer inputs at p (`states_for`): its rows lie one
    position `shift`ed; "dflash", a DFlash file, fed the target's layer inputs at
    each position (`inject`), drafting a block a call (`stage_block`); and "assistant", a
    Gemma 4 assistant, whose cache is the target's (`stage_at`)."""

    def __init__(
        self,
        target: Context,
        n_slots: int,
        model: Model | None = None,
        kind: str = "mtp",
        seqs_per_slot: int = 1,
    ) -> None:
        """Over `target` (the whole target context, before it is split into slots), with
        its size, threads and flash attention; `model`: an EAGLE-3 file, or an MTP
        sidecar (a file of the MTP block alone), None for the target's own MTP head.
        `seqs_per_slot`: a slot's own sequence and its draft tree's branches."""
        self.kind = kind
        self.shift = 1 if kind == "eagle3" else 0
        # EAGLE-3's graph computes logits for every row (no selection of the rows asked
        # for), and llama.cpp then keeps the first n_outputs: each row must ask, or the
        # last row's place reads the first row's logits. A DFlash block wants them all.
        self.logits_every_row = kind in ("eagle3", "dflash")
        model = model or target.model
        # MTP blocks chained one a draft step, each in a sequence of its own (see
        # stage_head); 1 for every other kind.
        self.n_heads = max(1, model.n_nextn) if kind == "mtp" else 1
        seqs_per_slot = max(seqs_per_slot, self.n_heads)
        cparams = llama_cpp.llama_context_default_params()
        # Room for the target's text in each of a slot's sequences that holds it whole.
        cparams.n_ctx = llama_cpp.llama_n_ctx(target.ptr) * self.n_heads
        cparams.n_batch = target.n_batch
        cparams.n_ubatch = min(target.n_batch, llama_cpp.llama_n_ubatch(target.ptr))
        # llama.cpp keeps an output row per sequence, and no more rows than a batch has.
        cparams.n_seq_max = min(n_slots * seqs_per_slot, target.n_batch)
        if kind == "assistant":  # its rows go into the target's sequences (see stage_at)
            cparams.n_seq_max = target.n_seq_max
        cparams.kv_unified = cparams.n_seq_max > 1  # branches share the cells of their path
        cparams.n_threads = cparams.n_threads_batch = target.threads
        cparams.flash_attn_type = FLASH_ATTN[target.flash_attn]
        cparams.no_perf = False
        if self.kind in ("mtp", "assistant"):
            cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = target.ptr
        cparams.n_rs_seq = 0
        ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not ptr:
            raise UserError(f"llama.cpp could not create a drafting context for {model.path.name}")
        # The rows' hidden states, read by their batch places. Not "masked" (the rows with
        # logits only), where the graph computes the state of every row (Qwen3.5's MTP
        # graph): llama.cpp would copy its first n_outputs rows, so that a call whose
        # last row alone has logits would hand back its first row's state. Masked where
        # the graph computes them for those rows alone (unmasked, llama.cpp would read
        # past its end).
        masked = _metadata(model, "general.architecture") in MTP_STATES_OF_OUTPUTS_ONLY
        llama_cpp_ext.llama_set_embeddings_nextn(ptr, True, masked)
        # The width of the states it reads and gives: an assistant's are the target's.
        width = (
            llama_cpp.llama_model_n_embd_out
            if kind == "assistant"
            else llama_cpp.llama_model_n_embd
        )
        n_embd = width(model.ptr)
        self._shared = _HeadShared(ptr, target.model.n_vocab, n_embd, cparams.n_ubatch)
        if kind == "dflash":
            # A block sees itself both ways, unless the file was trained causal.
            causal = _metadata(model, "dflash.attention.causal") == "true"
            llama_cpp.llama_set_causal_attn(ptr, causal)
            self.block_size = int(_metadata(model, "dflash.block_size") or DFLASH_BLOCK_SIZE)
            self.mask = llama_cpp.llama_vocab_mask(llama_cpp.llama_model_get_vocab(model.ptr))
        self._owner = True
        self.model = model
        self.n_embd = n_embd
        self.n_ctx: int = target.n_ctx
        self.n_batch: int = target.n_batch
        self.threads = target.threads
        self._start(0, cparams.n_seq_max)

    def _start(self, seq: int, n_seq: int) -> None:
        """This slot's own state: sequences seq .. seq + n_seq - 1 (its own, then its
        tree's branches), empty."""
        self.seq = seq
        self.n_seq_max = n_seq
        self._branches = 0  # sequences after `seq` that may hold cells
        self.tokens: list[int] = []  # what the sequence holds, by position
        # The first `fed` of them were read beside the target's hidden states; the rest
        # beside the head's own (its drafts), which the next round must not keep.
        self.fed = 0
        self.decode_seconds = 0.0
        self.decode_calls = 0
        self._first = -1  # the batch place of this slot's first staged row, after a flush
        self._out = -1  # the batch place of this slot's last staged row, after a flush

    def split(self, n: int) -> list[HeadContext]:
        """n slots over this context (see Context.split)."""
        if n == 1:
            return [self]
        width = self.n_seq_max // n
        slots = []
        for i in range(n):
            slot = object.__new__(HeadContext)
            slot.__dict__.update(self.__dict__)
            slot._owner = False
            slot.n_ctx, slot.n_batch = self.n_ctx // n, self.n_batch // n
            slot._start(i * width, width)
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
        and a tree goes in depth by depth (stage_branches)."""
        assert parents is None, "a head stages a tree a depth a call: see stage_branches"
        pos = len(self.tokens)
        if self.kind == "dflash":
            hidden = None  # its token rows read no state (an embedding row is a feature)
        elif hidden is None:
            hidden = np.zeros((len(tokens), self.n_embd), np.float32)
        else:
            hidden = np.ascontiguousarray(hidden, np.float32)
        self._shared.stage(self, tokens, range(pos, pos + len(tokens)), hidden)
        self.tokens.extend(tokens)

    def stage_branches(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seqs: Sequence[int],
        hidden: np.ndarray,
    ) -> None:
        """Stage token i at positions[i] in sequence seqs[i] (counted from this slot's
        own), beside hidden[i], each row with logits and a hidden state (row i is token
        i's): how a draft tree grows, a depth a call (see Context.stage_branches). Tokens
        of sequence 0 extend the sequence; the others are branches (see fork)."""
        hidden = np.ascontiguousarray(hidden, np.float32)
        self._shared.stage(self, tokens, positions, hidden, seqs, every_row=True)
        self.tokens.extend(t for t, s in zip(tokens, seqs, strict=True) if s == 0)

    def fork(self, source: int, seq: int, n_tokens: int) -> None:
        """Make branch `seq` hold the first n_tokens positions of sequence `source`,
        sharing their cells (see Context.fork)."""
        if not 0 < seq < self.n_seq_max:
            raise RuntimeError(f"{self.model.path.name}: no branch {seq} in this slot")
        memory = self._memory
        if memory:
            llama_cpp.llama_memory_seq_cp(memory, self.seq + source, self.seq + seq, -1, n_tokens)
        self._branches = max(self._branches, seq)

    def drop_branches(self) -> None:
        """Forget every branch, keeping the slot's own sequence alone."""
        for branch in range(self.seq + 1, self.seq + self._branches + 1):
            self._forget(branch, 0)
        self._branches = 0

    @property
    def _memory(self) -> llama_cpp.llama_memory_t | None:
        """Its cache, None for an assistant's: that is the target's, which llama.cpp
        (today) leaves alone when the assistant's context is asked to change it."""
        return None if self.kind == "assistant" else llama_cpp.llama_get_memory(self.ptr)

    def _forget(self, seq: int, first: int) -> None:
        """Forget sequence `seq` (absolute) from position `first` on."""
        memory = self._memory
        if memory:
            llama_cpp.llama_memory_seq_rm(memory, seq, first, -1)

    def stage_at(self, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """An assistant's rows: each at `pos` (the text's last token's, which the target
        has not read yet) in the slot's own sequence, beside its row of `hidden`, each
        with logits and a hidden state. They read the target's cache below `pos` and
        leave nothing behind, so the rows of a tree's depth need no branches."""
        hidden = np.ascontiguousarray(hidden, np.float32)
        self._shared.stage(self, tokens, [pos] * len(tokens), hidden, every_row=True)

    def stage_head(self, head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Chained MTP blocks: rows for block `head` (0: the first draft step's), in its own
        sequence of this slot, at positions pos, pos + 1, ..., each beside its row of
        `hidden`; the last gives logits and a hidden state. A flush decodes one block's
        rows: every slot stages the same block between two flushes."""
        self._shared.stage(self, *_block_rows(head, tokens, pos, hidden), head=head)

    def catch_up(self, tokens: Sequence[int], hidden: np.ndarray) -> None:
        """Decode `tokens` after the sequence now, each beside its row of `hidden`, without
        logits (see _HeadShared.decode_now): a text longer than a staged call holds."""
        pos, hidden = len(self.tokens), np.ascontiguousarray(hidden, np.float32)
        self._shared.decode_now(self, tokens, range(pos, pos + len(tokens)), hidden)
        self.tokens.extend(tokens)

    def catch_up_head(self, head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Chained MTP blocks: catch_up for block `head`, in its own sequence, from `pos`."""
        self._shared.decode_now(self, *_block_rows(head, tokens, pos, hidden), head=head)

    def forget_head(self, head: int, first: int) -> None:
        """Forget block `head`'s rows (stage_head) from position `first` on."""
        self._forget(self.seq + head, first)

    def inject(self, tokens: Sequence[int], features: np.ndarray) -> None:
        """DFlash: put the target's layer inputs at the positions of `tokens` (after the
        sequence) into the drafter's cache, now, as llama.cpp's driver does per sequence."""
        self.decode_seconds += self._shared.embed_rows(self.seq, len(self.tokens), features)
        self.tokens.extend(tokens)

    def stage_block(self, last: int, k: int) -> None:
        """DFlash: the block [last, mask x k] at the positions after the sequence, into
        the next flush; its rows 1 .. k then give the draft's logits (`block_logits`).
        They stay out of `tokens`: drop_block forgets them."""
        pos = len(self.tokens)
        self._shared.stage(self, [last] + [self.mask] * k, range(pos, pos + k + 1), None)

    def block_logits(self, row: int) -> np.ndarray:
        """The last flush's logits at this slot's block row (a view)."""
        return _floats(
            self._shared.logit_row, llama_cpp.llama_get_logits_ith(self.ptr, self._first + row)
        )

    def drop_block(self) -> None:
        """Forget the staged block's rows (from the end of `tokens`)."""
        self._forget(self.seq, len(self.tokens))

    def flush(self) -> int:
        return self._shared.flush(self.model.path.name)

    def decode(self, tokens: Sequence[int], pos: int) -> None:
        """Evaluate `tokens` at positions pos, pos + 1, ... with zero hidden states (the
        cost measurements' filler), a batch at a time."""
        assert pos == len(self.tokens)
        if self.kind == "assistant":  # what it reads is in the target's cache already
            self.tokens.extend(tokens)
            return
        for start in range(0, len(tokens), self.n_batch):
            self.stage(tokens[start : start + self.n_batch])
            self.flush()

    def _place(self, row: int) -> int:
        """The batch place of this slot's staged row `row` in the last flush (-1: the
        last)."""
        return self._first + row if row >= 0 else self._out + 1 + row

    def logits(self, row: int = -1) -> np.ndarray:
        """The last flush's logits at this slot's staged row `row` (-1: the last; a row
        that asked for them), a view."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, self._place(row))
        return _floats(self._shared.logit_row, ptr)

    def states_for(self, rows: np.ndarray) -> np.ndarray:
        """The head's states for rows of the target's: an MTP head reads them as they are;
        an EAGLE-3 head its encoder's reading of the target's layer inputs (an extra call,
        which its own memory does not see)."""
        if self.kind != "eagle3":
            return rows
        out = np.empty((len(rows), self.n_embd), np.float32)
        self._shared.embed_rows(self.seq, len(self.tokens), rows, out)
        return out

    def hidden(self, row: int = -1) -> np.ndarray:
        """The head's own hidden state after the token at staged row `row` (-1: the
        last): what it reads beside the token after it (a view of llama.cpp's buffer,
        valid until the next decode: stage copies it first)."""
        ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ptr, self._place(row))
        return _floats(self._shared.state_row, ptr).reshape(1, -1)

    def hidden_rows(self, rows: Sequence[int]) -> np.ndarray:
        """The hidden states at these staged rows of the last flush, a row each: for one
        row (a chain's step, every draft token) a view, as `hidden`; else a copy."""
        if len(rows) == 1:
            return self.hidden(rows[0])
        return np.concatenate([self.hidden(row) for row in rows])

    def rewind(self, n_keep: int) -> int:
        """Forget every position >= n_keep (a head's memory is attention only)."""
        self.drop_branches()
        if n_keep < len(self.tokens):
            self._forget(self.seq, n_keep)
            del self.tokens[n_keep:]
        self.fed = min(self.fed, len(self.tokens))
        return len(self.tokens)

    def trim(self, n_keep: int) -> None:
        self.rewind(n_keep)

    def checkpoint(self, n_ahead: int | None = None) -> None:
        """Nothing to save: an attention cache drops any suffix."""

    def perf_seconds(self) -> float:
        data = llama_cpp.llama_perf_context(self.ptr)
        return (data.t_eval_ms + data.t_p_eval_ms) / 1e3


def _block_rows(
    head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray
) -> tuple[Sequence[int], range, np.ndarray, list[int]]:
    """Rows for chained MTP block `head` in its own sequence of a slot: tokens,
    positions from `pos`, their states, and their sequences (counted from the slot's)."""
    hidden = np.ascontiguousarray(hidden, np.float32)
    return tokens, range(pos, pos + len(tokens)), hidden, [head] * len(tokens)


class _HeadShared:
    """What a head context's slots share: the llama.cpp context, and the extended batch
    of the next call, with each slot's rows."""

    def __init__(
        self, ptr: llama_cpp.llama_context_p, n_vocab: int, n_embd: int, n_ubatch: int
    ) -> None:
        self.ptr: llama_cpp.llama_context_p | None = ptr
        self.n_vocab, self.n_embd, self.n_ubatch = n_vocab, n_embd, n_ubatch
        self.batch = llama_cpp.llama_batch_ext_init(ptr)
        self.encoder_batch = llama_cpp.llama_batch_ext_init(ptr)
        self.encoded = ctypes.c_float * (n_ubatch * n_embd)
        self.staged: list[HeadContext] = []
        self.n_staged = 0
        self._pos = (ctypes.c_int32 * 4)()  # M-RoPE models read 4 (a token row: the first)
        # A feature row's: M-RoPE's three text positions, and 0 (as llama.cpp's driver).
        self._feature_pos = (ctypes.c_int32 * 4)()
        self.logit_row = ctypes.c_float * n_vocab
        self.state_row = ctypes.c_float * n_embd
        self._state = _RowPointer(n_embd)
        self._feature: _RowPointer | None = None  # made at the first encode (its width)
        # The MTP block the staged rows are for, and the one llama.cpp decodes with now.
        self.head, self._head_set = 0, 0

    def stage(
        self,
        slot: HeadContext,
        tokens: Sequence[int],
        positions: Sequence[int],
        hidden: np.ndarray | None,
        seqs: Sequence[int] | None = None,
        every_row: bool = False,
        head: int = 0,
    ) -> None:
        """Add the rows to the batch now, at `positions`, in the slot's sequence or in
        `seqs` (counted from the slot's own): llama.cpp copies each row's hidden state
        (None: token rows alone). The last row gives logits; `every_row`: every row.
        `head`: the MTP block they are for (chained blocks: one a flush)."""
        if self.n_staged and head != self.head:
            raise RuntimeError(f"rows for MTP blocks {self.head} and {head} in one call")
        self.head = head
        logits_from = 0 if every_row or slot.logits_every_row else len(tokens) - 1
        slot._first = self._add(self.batch, slot, tokens, positions, hidden, seqs, logits_from)
        slot._out = slot._first + len(tokens) - 1
        self.staged.append(slot)
        self.n_staged += len(tokens)

    def _add(
        self,
        batch: llama_cpp.llama_batch_ext_p,
        slot: HeadContext,
        tokens: Sequence[int],
        positions: Sequence[int],
        hidden: np.ndarray | None,
        seqs: Sequence[int] | None,
        logits_from: int,
    ) -> int:
        """Add token rows to `batch` (see stage), the rows from `logits_from` on with
        logits; return the first one's batch place."""
        place, idx = self._pos, -1
        for i, token in enumerate(tokens):
            seq = slot.seq if seqs is None else slot.seq + seqs[i]
            idx = llama_cpp.llama_batch_ext_add_token(batch, seq, token)
            if idx < 0:
                raise RuntimeError(f"the head's batch is full ({self.n_staged} rows)")
            place[0] = positions[i]
            llama_cpp.llama_batch_ext_set_pos(batch, idx, place)
            if hidden is not None:
                llama_cpp.llama_batch_ext_set_embd_token(batch, idx, self._state.at(hidden, i))
            if i >= logits_from:
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, True)
        return idx - len(tokens) + 1  # a batch numbers its rows in order

    def decode_now(
        self,
        slot: HeadContext,
        tokens: Sequence[int],
        positions: Sequence[int],
        hidden: np.ndarray,
        seqs: Sequence[int] | None = None,
        head: int = 0,
    ) -> None:
        """Decode rows now, without logits, in a batch apart (a ubatch a call), as
        llama.cpp's driver catches a head up: a text longer than a staged call holds.
        The staged rows wait for the next flush. Only before a round's first flush: the
        slots' outputs of a flush are read after it, and this call's would replace them."""
        self._use_head(head)
        batch = self.encoder_batch
        t0 = time.perf_counter()
        for start in range(0, len(tokens), self.n_ubatch):
            stop = min(start + self.n_ubatch, len(tokens))
            rows = slice(start, stop)
            seqs_here = seqs[rows] if seqs is not None else None
            self._add(
                batch, slot, tokens[rows], positions[rows], hidden[rows], seqs_here, stop - start
            )
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

    def embed_rows(
        self, seq: int, pos: int, features: np.ndarray, out: np.ndarray | None = None
    ) -> float:
        """Process rows of `features` at positions pos, pos + 1, ..., a ubatch a call, and
        return the seconds it took. With `out`: EAGLE-3's encoder, whose output for each
        row goes there (it reads no positions, but llama.cpp wants them to follow the
        sequence's memory); without: a DFlash decode that puts them into the cache, with
        no output (positions as llama.cpp's driver gives feature rows: M-RoPE's text
        three, and 0)."""
        features = np.ascontiguousarray(features, np.float32)
        batch, place = self.encoder_batch, self._feature_pos
        encode = out is not None
        process = (
            llama_cpp.LLAMA_PROCESS_TYPE_ENCODE if encode else llama_cpp.LLAMA_PROCESS_TYPE_DECODE
        )
        if self._feature is None:
            self._feature = _RowPointer(features.shape[1])
        t0 = time.perf_counter()
        for start in range(0, len(features), self.n_ubatch):
            stop = min(start + self.n_ubatch, len(features))
            for i in range(start, stop):
                idx = llama_cpp.llama_batch_ext_add_embd(batch, seq, self._feature.at(features, i))
                place[0] = place[1] = place[2] = pos + i
                llama_cpp.llama_batch_ext_set_pos(batch, idx, place)
                llama_cpp.llama_batch_ext_set_output_logits(batch, idx, encode)
            status = llama_cpp.llama_process(self.ptr, process, batch)
            llama_cpp.llama_batch_ext_clear(batch)
            if status != 0:
                raise RuntimeError(f"the drafting head's feature rows failed with status {status}")
            if encode:
                rows = _floats(self.encoded, llama_cpp_ext.llama_get_embeddings_nextn(self.ptr))
                out[start:stop] = rows.reshape(-1, self.n_embd)[: stop - start]
        llama_cpp.llama_synchronize(self.ptr)
        return time.perf_counter() - t0

    def flush(self, name: str) -> int:
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
            llama_cpp.llama_batch_ext_free(self.encoder_batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
