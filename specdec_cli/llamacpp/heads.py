"""Drafting heads' contexts, from ctypes: a class per method, each over llama.cpp's
extended batches (headbatch.py), reading the target's hidden states (hiddenstates.py).

An MTP head (`MtpHead`) is a decoder block that reads two things at position p: the
token there, and the target's hidden state after position p - 1 (what the target's own
output layer reads to predict that token). From them it predicts the token after p, and
gives a hidden state of its own, which it reads at p + 1 to draft one more token, and so
on. A draft tree grows the same way, a depth a call: each node in a branch of its own (a
sequence forked from its parent's), beside the head's state at its parent's row
(`stage_branches`). Its context is of type LLAMA_CONTEXT_TYPE_MTP, over the target's own
model loaded with its nextn layers (or an MTP sidecar file). As `common/speculative.cpp`
does, the row at position 0 reads a zero hidden state.

An EAGLE-3 head (`Eagle3Head`) is the same loop over other states: the inputs of three
target layers, which its own encoder turns into its state (`states_for`), one position
earlier (its row at p reads the token at p + 1). Its context borrows the target's
embeddings and output through ctx_other.

Some models (MiMo-V2, Step-3.5, Hunyuan v3, ...) carry several MTP blocks, one a draft
step (`ChainedMtpHead`); llama.cpp picks a call's block with llama_set_nextn_layer_offset.
Each block attends over its own keys and values, so each keeps a sequence of its own in
the head's context (`stage_head`): a call decodes one block's rows, every slot's.

A DFlash drafter (`DFlashHead`) reads target layer inputs too, but not beside a token:
each position the target decoded goes into its cache as keys and values made from them
(`inject`, a decode of feature rows), and one decode of a block [last token, mask, mask,
...], which attends both ways, predicts at each mask's row the token at that position
(`stage_block`): a whole draft a call.

A Gemma 4 assistant (`AssistantHead`) has no cache of its own: its attention reads the
target's (its last sliding-window and last full layers'), so it needs no catch-up. Each
of its rows sits at the position of the text's last token, beside a hidden state (the
target's before it, then its own), and reads the target's cache up to there (`stage_at`).

Slots split a head's context as Context.split splits the target: one llama.cpp context
serves every slot, and one call decodes every slot's staged rows.

Beside images and audio, a head holds the target's positions: `tokens` is the text by
position, each media's placeholder at the positions it spans, and each row there reads
the target's state at that position (see headbatch.py for the token beside it). An
assistant reads the target's cache, media and all.
"""

from __future__ import annotations

import copy
import ctypes
from collections.abc import Sequence

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.floatviews import logits_at, state_at
from specdec_cli.llamacpp.headbatch import HeadBatch, Rows, rows_after
from specdec_cli.llamacpp.llama import FLASH_ATTN, LLAMA_MAX_SEQ, Context
from specdec_cli.llamacpp.model import Model

# The architectures whose MTP graph gives a state for the rows with logits only (it
# gathers them first): the others give one for every row.
MTP_STATES_OF_OUTPUTS_ONLY = frozenset({"deepseek4", "mimo2", "step35"})


def stand_in(target: Model) -> int:
    """The token a head reads at a media position (see headbatch.py): the target's
    padding token (0 where it has none), which no text is made of. What the row says of
    the media is the target's state beside it."""
    pad = llama_cpp.llama_vocab_pad(llama_cpp.llama_model_get_vocab(target.ptr))
    return pad if pad >= 0 else 0


def _metadata(model: Model, key: str) -> str | None:
    """A model's metadata value, as llama.cpp gives it (None: absent)."""
    buffer = ctypes.create_string_buffer(64)
    if llama_cpp.llama_model_meta_val_str(model.ptr, key.encode(), buffer, len(buffer)) < 0:
        return None
    return buffer.value.decode()


class HeadContext:
    """A drafting head's context for one sequence (a slot), over a llama.cpp context that
    may serve several slots. Like a draft model's Context, it holds a prefix of what it
    reads (`tokens`), `stage` + `flush` decode rows, `rewind` forgets a suffix, and for
    one round at a time its draft tree's branches follow its own sequence (`fork`,
    `drop_branches`). What it reads beside each token, and where, is its subclass's."""

    # Its row at position p holds the token at p + shift.
    shift = 0
    # Whether every staged row asks for logits (see Eagle3Head), not the last alone.
    logits_every_row = False
    # The MTP blocks it chains, one a draft step (see ChainedMtpHead).
    n_heads = 1
    context_type: int = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    # Its memory is attention only: any suffix drops (nothing to save before a call).
    recurrent = False

    def __init__(
        self, target: Context, n_slots: int, model: Model | None = None, seqs_per_slot: int = 1
    ) -> None:
        """Over `target` (the whole target context, before it is split into slots), with
        its threads and flash attention; `model`: a head file (None: the target's own MTP
        blocks). `seqs_per_slot`: a slot's own sequence and its draft tree's branches."""
        model = model or target.model
        n_seq_max = self._sequences(target, n_slots, seqs_per_slot)
        cparams = llama_cpp.llama_context_default_params()
        # Room for the target's text in each of a slot's sequences that holds it whole.
        cparams.n_ctx = llama_cpp.llama_n_ctx(target.ptr) * self.n_heads
        # llama.cpp keeps an output row per sequence, and no more rows than a batch has;
        # a slot's share of a call then holds a row in each of its sequences (chained
        # blocks: the text's last token and a draft a block).
        cparams.n_batch = max(target.n_batch, n_seq_max)
        cparams.n_ubatch = min(target.n_batch, llama_cpp.llama_n_ubatch(target.ptr))
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = n_seq_max > 1  # branches share the cells of their path
        cparams.n_threads = cparams.n_threads_batch = target.threads
        cparams.flash_attn_type = FLASH_ATTN[target.flash_attn]
        cparams.no_perf = False
        cparams.ctx_type = self.context_type
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
        n_embd = self._state_width(model)
        self._shared = HeadBatch(
            ptr, target.model.n_vocab, n_embd, cparams.n_ubatch, stand_in(target.model)
        )
        self._memory = self._own_memory(ptr)
        self._owner = True
        self.model = model
        self.n_embd = n_embd
        self.n_ctx: int = target.n_ctx
        self.n_batch: int = cparams.n_batch
        self.threads = target.threads
        self._start(0, n_seq_max)

    @classmethod
    def chains_only(cls, model: Model) -> str | None:
        """Why a head of this class over `model` drafts chains only (None: it can grow
        trees)."""
        return None

    def _sequences(self, target: Context, n_slots: int, seqs_per_slot: int) -> int:
        """The sequences its llama.cpp context holds: each slot's."""
        wanted = n_slots * seqs_per_slot
        if wanted > LLAMA_MAX_SEQ:
            raise UserError(
                f"-np {n_slots}: the drafting head needs {seqs_per_slot} sequences a slot, "
                f"{wanted} in all, and llama.cpp holds at most {LLAMA_MAX_SEQ}; use -np "
                f"{LLAMA_MAX_SEQ // seqs_per_slot} or fewer"
            )
        return wanted

    def _state_width(self, model: Model) -> int:
        """The width of the states it reads and gives."""
        return llama_cpp.llama_model_n_embd(model.ptr)

    def _own_memory(self, ptr: llama_cpp.llama_context_p) -> llama_cpp.llama_memory_t | None:
        """Its cache, where its staged rows and rewinds go."""
        return llama_cpp.llama_get_memory(ptr)

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
            slot = copy.copy(self)
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
        self, tokens: Sequence[int], n_logits: int = 1, *, hidden: np.ndarray | None = None
    ) -> None:
        """Put `tokens` after the sequence into the next flush, each beside its row of
        `hidden` (the state before it; None: zeros, the cost measurements' filler); the
        last one gives logits and a hidden state. `n_logits`: Context.stage's, which the
        cost measurements pass (a head's last row alone gives them)."""
        if hidden is None:
            hidden = np.zeros((len(tokens), self.n_embd), np.float32)
        self._shared.stage(self, rows_after(len(self.tokens), tokens, hidden))
        self.tokens.extend(tokens)

    def decode(self, tokens: Sequence[int], pos: int) -> None:
        """Evaluate `tokens` at positions pos, pos + 1, ... with zero hidden states (the
        cost measurements' filler), a batch at a time."""
        assert pos == len(self.tokens)
        for start in range(0, len(tokens), self.n_batch):
            self.stage(tokens[start : start + self.n_batch])
            self.flush()

    def flush(self) -> int:
        """Decode every slot's staged rows in one call: how many."""
        return self._shared.flush(self.model.name)

    def fork(self, source: int, seq: int, n_tokens: int) -> None:
        """Make branch `seq` hold the first n_tokens positions of sequence `source`,
        sharing their cells (see Context.fork)."""
        if not 0 < seq < self.n_seq_max:
            raise RuntimeError(f"{self.model.path.name}: no branch {seq} in this slot")
        if self._memory:
            seqs = (self.seq + source, self.seq + seq)
            llama_cpp.llama_memory_seq_cp(self._memory, *seqs, -1, n_tokens)
        self._branches = max(self._branches, seq)

    def drop_branches(self) -> None:
        """Forget every branch, keeping the slot's own sequence alone."""
        for branch in range(self.seq + 1, self.seq + self._branches + 1):
            self._forget(branch, 0)
        self._branches = 0

    def _forget(self, seq: int, first: int) -> None:
        """Forget sequence `seq` (absolute) from position `first` on."""
        if self._memory:
            llama_cpp.llama_memory_seq_rm(self._memory, seq, first, -1)

    def _place(self, row: int) -> int:
        """The batch place of this slot's staged row `row` in the last flush (-1: the
        last)."""
        return self._first + row if row >= 0 else self._out + 1 + row

    def logits(self, row: int = -1) -> np.ndarray:
        """The last flush's logits at this slot's staged row `row` (-1: the last; a row
        that asked for them), a view."""
        return self._shared.logit_rows.at(logits_at(self.ptr, self._place(row)))

    def hidden(self, row: int = -1) -> np.ndarray:
        """The head's own hidden state after the token at staged row `row` (-1: the
        last): what it reads beside the token after it (a view of llama.cpp's buffer,
        valid until the next decode: stage copies it first)."""
        return self._shared.state_rows.at(state_at(self.ptr, self._place(row)))

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

    def perf_seconds(self) -> float:
        data = llama_cpp.llama_perf_context(self.ptr)
        return (data.t_eval_ms + data.t_p_eval_ms) / 1e3


class MtpHead(HeadContext):
    """The target's own MTP block (or a sidecar file of it), reading at position p the
    token at p beside the target's state after p - 1; it drafts chains and trees."""

    def catch_up(self, tokens: Sequence[int], hidden: np.ndarray) -> None:
        """Decode `tokens` after the sequence now, each beside its row of `hidden`, without
        logits (see HeadBatch.decode_now): a text longer than a staged call holds."""
        self._shared.decode_now(self, rows_after(len(self.tokens), tokens, hidden))
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
        self._shared.stage(self, Rows(tokens, positions, hidden, seqs), every_row=True)
        self.tokens.extend(t for t, s in zip(tokens, seqs, strict=True) if s == 0)

    def states_for(self, rows: np.ndarray) -> np.ndarray:
        """The head's states for rows of the target's: an MTP head reads them as they are."""
        return rows


class Eagle3Head(MtpHead):
    """An EAGLE-3 draft file, reading at position p the token at p + 1 beside its
    encoding of the target's layer inputs at p (`states_for`): its rows lie one position
    `shift`ed."""

    shift = 1
    # Its graph computes logits for every row (no selection of the rows asked for), and
    # llama.cpp then keeps the first n_outputs: each row must ask, or the last row's
    # place reads the first row's logits.
    logits_every_row = True
    context_type = llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT

    def states_for(self, rows: np.ndarray) -> np.ndarray:
        """Its encoder's reading of the target's layer inputs: an extra call, which its
        own memory does not see."""
        out = np.empty((len(rows), self.n_embd), np.float32)
        pos = len(self.tokens)
        self._shared.features(self.seq, range(pos, pos + len(rows)), rows, out)
        return out


class ChainedMtpHead(HeadContext):
    """Several MTP blocks, one a draft step: block i reads the text beside the target's
    states, and the drafts before it beside the states the blocks before it gave. Each
    block keeps a sequence of its own in the slot (its own, then the next ones)."""

    def __init__(
        self, target: Context, n_slots: int, model: Model | None = None, seqs_per_slot: int = 1
    ) -> None:
        self.n_heads = (model or target.model).n_nextn
        super().__init__(target, n_slots, model, max(seqs_per_slot, self.n_heads))

    @classmethod
    def chains_only(cls, model: Model) -> str:
        return f"{model.path.name}'s {model.n_nextn} chained MTP blocks draft chains"

    def _block_rows(self, head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> Rows:
        """Rows for block `head` in its own sequence of the slot, from position `pos`."""
        rows = rows_after(pos, tokens, hidden)
        return rows._replace(seqs=[head] * len(tokens))

    def stage_head(self, head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Rows for block `head` (0: the first draft step's), in its own sequence of this
        slot, at positions pos, pos + 1, ..., each beside its row of `hidden`; the last
        gives logits and a hidden state. A flush decodes one block's rows: every slot
        stages the same block between two flushes."""
        self._shared.stage(self, self._block_rows(head, tokens, pos, hidden), head=head)

    def catch_up_head(self, head: int, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Decode block `head`'s rows now, without logits (see HeadBatch.decode_now): a
        text longer than a staged call holds."""
        self._shared.decode_now(self, self._block_rows(head, tokens, pos, hidden), head=head)

    def forget_head(self, head: int, first: int) -> None:
        """Forget block `head`'s rows from position `first` on."""
        self._forget(self.seq + head, first)


class DFlashHead(HeadContext):
    """A DFlash file: fed the target's layer inputs at each position (`inject`), it drafts
    a block a call (`stage_block`), every row of the block with logits."""

    logits_every_row = True
    context_type = llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT

    def __init__(self, target: Context, n_slots: int, model: Model, block_size: int) -> None:
        """`block_size`: the block the file was trained on (models/heads.py reads it)."""
        super().__init__(target, n_slots, model)
        # A block sees itself both ways, unless the file was trained causal.
        causal = _metadata(model, "dflash.attention.causal") == "true"
        llama_cpp.llama_set_causal_attn(self.ptr, causal)
        self.block_size = block_size
        self.mask = llama_cpp.llama_vocab_mask(llama_cpp.llama_model_get_vocab(model.ptr))

    @classmethod
    def chains_only(cls, model: Model) -> str:
        return "a DFlash drafter drafts chains"

    def stage(
        self, tokens: Sequence[int], n_logits: int = 1, *, hidden: np.ndarray | None = None
    ) -> None:
        """Token rows after the sequence alone: they read no state (the target's come in
        as feature rows, see inject)."""
        self._shared.stage(self, rows_after(len(self.tokens), tokens, None))
        self.tokens.extend(tokens)

    def inject(self, tokens: Sequence[int], features: np.ndarray) -> None:
        """Put the target's layer inputs at the positions of `tokens` (after the sequence)
        into the drafter's cache, now, as llama.cpp's driver does per sequence; a media's
        positions too (feature rows need no token). Under M-RoPE an image's positions are
        fewer than its cells, a state each: llama.cpp's driver, which would put every
        cell at one position, where a sliding window's cache cannot hold them, leaves
        M-RoPE images out."""
        first = len(self.tokens)
        positions = range(first, first + len(tokens))
        self.decode_seconds += self._shared.features(self.seq, positions, features)
        self.tokens.extend(tokens)

    def stage_block(self, last: int, k: int) -> None:
        """The block [last, mask x k] at the positions after the sequence, into the next
        flush; its rows 1 .. k then give the draft's logits (`logits(row)`). They stay
        out of `tokens`: drop_block forgets them."""
        self._shared.stage(self, rows_after(len(self.tokens), [last] + [self.mask] * k, None))

    def drop_block(self) -> None:
        """Forget the staged block's rows (from the end of `tokens`)."""
        self._forget(self.seq, len(self.tokens))


class AssistantHead(HeadContext):
    """A Gemma 4 assistant, whose cache is the target's (`stage_at`): its rows go into the
    target's sequences, and it reads and gives states of the target's width."""

    def _sequences(self, target: Context, n_slots: int, seqs_per_slot: int) -> int:
        return target.n_seq_max

    def _state_width(self, model: Model) -> int:
        return llama_cpp.llama_model_n_embd_out(model.ptr)

    def _own_memory(self, ptr: llama_cpp.llama_context_p) -> None:
        """None: its cache is the target's, which llama.cpp (today) leaves alone when the
        assistant's context is asked to change it; its rows leave nothing there."""
        return None

    def decode(self, tokens: Sequence[int], pos: int) -> None:
        """What it reads is in the target's cache already: nothing to evaluate."""
        assert pos == len(self.tokens)
        self.tokens.extend(tokens)

    def stage_at(self, tokens: Sequence[int], pos: int, hidden: np.ndarray) -> None:
        """Its rows: each at `pos` (the text's last token's, which the target has not
        read yet) in the slot's own sequence, beside its row of `hidden`, each with logits
        and a hidden state. They read the target's cache below `pos` and leave nothing
        behind, so the rows of a tree's depth need no branches."""
        hidden = np.ascontiguousarray(hidden, np.float32)
        self._shared.stage(self, Rows(tokens, [pos] * len(tokens), hidden), every_row=True)
