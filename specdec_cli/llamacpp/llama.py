"""llama.cpp's context, from our ctypes layer (the model it decodes with is model.py's).

It exposes just what speculative decoding needs: make a context, decode a batch of
tokens (and media's embeddings) at given positions with logits where asked, read those
logits as zero-copy numpy views, and cut the KV cache back to a position; slots share
one context's decode calls.
"""

from __future__ import annotations

import copy
import ctypes
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import llama_cpp.llama_cpp as llama_cpp
import numpy as np

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.decodecall import SharedCall, Tree
from specdec_cli.llamacpp.floatviews import logits_at
from specdec_cli.llamacpp.model import Model
from specdec_cli.llamacpp.sequencestate import Checkpoint, MediaRun, SavedState

FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

LLAMA_MAX_SEQ = 256  # llama.cpp's limit on sequences in one context (llama-cparams.h)
# What hears of a decode call (see Context.on_decoded): a position, and batch places.
OnDecoded = Callable[[int, slice | list[int] | np.ndarray], None]


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int
    n_threads: int
    flash_attn: str = "auto"
    n_batch: int = 2048
    n_ubatch: int = 512
    # Recurrent models: how many tokens of the last decode call llama.cpp keeps state
    # snapshots for, so that rewind can drop them without a checkpoint (where supported).
    n_rs_seq: int = 0
    # Sequences held at once: 1, or the branches of a draft tree (the KV cache is then
    # unified, so branches share the cells of the accepted tokens instead of copying them).
    n_seq_max: int = 1


class MediaCells(Protocol):
    """An image or audio clip that a sequence holds as cells of its own (its embeddings:
    see mtmd.py): `n_tokens` cells, each written in Context.tokens as `placeholder` (a
    negative number, the same for the same media and no other), that advance positions
    by `n_pos` (fewer than n_tokens under M-RoPE)."""

    placeholder: int
    n_tokens: int
    n_pos: int

    def decode(
        self,
        ctx: llama_cpp.llama_context_p,
        pos: int,
        seq: int,
        n_batch: int,
        on_rows: Callable[[int], None] | None = None,
    ) -> int:
        """Decode the cells into sequence `seq` of `ctx` from position `pos` on, n_batch
        at most a call, no logits; `on_rows` hears how many cells each call decoded, right
        after it (the context's per-row buffers then hold them). Returns the next
        position, pos + n_pos."""
        ...


def cells_by_position(n_tokens: int, n_pos: int) -> np.ndarray:
    """For each of the positions a media's `n_tokens` cells span (`n_pos` of them), the
    cell that stands for it where something reads one state a position (a drafting
    head): the cells shared out evenly, each position taking the last of its share. One
    each where n_pos == n_tokens; under M-RoPE, the last cell of each row of an image's
    grid. The last position always takes the last cell, the state the text after it
    follows."""
    return -(-(np.arange(1, n_pos + 1) * n_tokens) // n_pos) - 1


class Context:
    """One model's inference state for one sequence: the memory holds the accepted token
    sequence, and for one round at a time the branches of a draft tree.

    `decode` is the only way tokens enter the memory; `rewind` and `keep_branch` are
    the ways they leave. Attention caches drop any suffix. A recurrent state (Mamba,
    RWKV, the recurrent layers of hybrids) cannot be cut back: `checkpoint` saves it
    first, and `rewind` restores that copy (the caller evaluates the rest again).
    Time spent inside llama.cpp's decode is summed in `decode_seconds`, so callers can
    tell the engine's cost from their own; the time `checkpoint` and `keep_branch` take
    to make a call's tokens undoable and to undo the rejected ones, in
    `rollback_seconds` (a recurrent state's copies run where its layers do: over RPC, a
    round trip each).

    Trees: a token of the accepted sequence is in the context's own sequence (`seq`). A
    tree's branches are the sequences after it, seq + 1, seq + 2, ..., which share
    those cells (a unified KV cache); each tree token carries the ids of every branch
    through it, and llama.cpp lets it attend only to cells of its own branch. After
    verification, `keep_branch` turns the accepted path back into `seq` and drops
    everything else, as llama.cpp's examples/speculative does with seq_keep / seq_cp.

    Slots: `split(n)` gives n contexts over the same llama.cpp context (one per
    generation running at once), each with its own sequences and an n-th of the cells.
    Each `stage`s its tokens into the one batch they share, and one `flush` decodes
    them all in one llama_decode: every slot's verification in one pass.

    Media: `decode_media` puts an image's (or audio clip's) embeddings in the memory, as
    cells written in `tokens` as its placeholder. Everything here counts places in
    `tokens`; a token's position is its place less the positions the media before it
    saved (MediaRun.saved: none but under M-RoPE). Text is only ever decoded after all
    the media the memory holds, and the memory is only cut at the edges of media: a
    rewind into an image drops all of it.
    """

    def __init__(self, model: Model, params: ContextParams) -> None:
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = params.n_ctx
        cparams.n_batch = min(params.n_batch, params.n_ctx)
        cparams.n_ubatch = min(params.n_ubatch, cparams.n_batch)
        # llama.cpp keeps an output row per sequence, and no more rows than a batch has.
        cparams.n_seq_max = min(params.n_seq_max, cparams.n_batch)
        cparams.kv_unified = cparams.n_seq_max > 1
        cparams.n_threads = params.n_threads
        cparams.n_threads_batch = params.n_threads
        cparams.flash_attn_type = FLASH_ATTN[params.flash_attn]
        cparams.no_perf = False  # keep llama.cpp's own decode timing: see perf_seconds()
        self.recurrent = model.recurrent
        cparams.n_rs_seq = params.n_rs_seq if self.recurrent else 0
        self.model = model
        ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not ptr:
            raise UserError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens for "
                f"{model.path.name}; try a smaller -c"
            )
        self._shared = SharedCall(ptr, cparams.n_batch, cparams.n_seq_max, model.n_vocab)
        self._owner = True
        # llama.cpp may round the context up (to a multiple of 256); honour what was asked.
        self.n_ctx: int = min(params.n_ctx, llama_cpp.llama_n_ctx(ptr))
        self.n_batch: int = cparams.n_batch
        self.threads: int = params.n_threads
        self.flash_attn = params.flash_attn
        # Called after each decode call with this context's tokens in it: (the position
        # of its first token, its places in the batch); for a tree's call, at keep_branch
        # with the kept path's places; for media, a place a position (cells_by_position).
        # A drafting head reads the target's hidden states there (see
        # hiddenstates.record_hidden_states).
        self.on_decoded: OnDecoded | None = None
        # llama.cpp grants snapshots only to the families it supports them for (else 0).
        self.n_rs_seq: int = llama_cpp.llama_n_rs_seq(ptr) if self.recurrent else 0
        self._start_sequences(0, cparams.n_seq_max)

    def _start_sequences(self, seq: int, n_seq: int) -> None:
        """This context's own state: sequences seq .. seq + n_seq - 1, empty."""
        self.seq = seq  # the accepted sequence; its tree's branches follow it
        self.n_seq_max: int = n_seq
        self.decode_seconds = 0.0  # in the decode calls this context took part in
        self.decode_calls = 0
        self.rollback_seconds = 0.0  # in checkpoint and keep_branch
        self.tokens: list[int] = []  # what the sequence holds, by place (see MediaCells)
        self._media: list[MediaRun] = []  # the media among them, in order
        self._shift = 0  # their saved positions: the next token goes at len(tokens) - _shift
        self._last_call_start = 0  # position of the first token of the last decode call
        self._first_logit = 0  # place in that call's batch of the first row with logits
        self._last_row = 0  # place in that call's batch of its last row with logits
        self._checkpoint = Checkpoint()
        self._tree: Tree | None = None  # the last decode's tree, until keep_branch
        self._staged_tree: Tree | None = None
        self._branches = 0  # sequences after `seq` that may hold cells
        # Runs of adjacent cells the sequence holds, as far as this side can tell: a decode
        # call shared with other slots puts each slot's tokens after the last's, so each
        # such call (and the first after cells were removed) starts a run. A state is
        # copied a run at a time (see save_state).
        self.runs = 0
        self._run_open = False  # the next call alone extends the last run

    def split(self, n: int) -> list[Context]:
        """n contexts over this one's llama.cpp context, for n generations at once: each
        with an n-th of its sequences and of its cells (llama-server's -c split across
        --parallel slots). This context itself is then left alone (its first sequence
        is the first slot's); for one slot, it is that slot."""
        if n == 1:
            return [self]
        width = self.n_seq_max // n
        if width < 1:
            raise RuntimeError(f"{self.model.path.name}: {n} slots need {n} sequences")
        slots = []
        for i in range(n):
            slot = copy.copy(self)
            slot._owner = False
            slot.n_ctx = self.n_ctx // n
            slot.n_batch = self.n_batch // n  # its share of a decode call's tokens
            slot.n_rs_seq = 0  # llama.cpp's snapshots cover a whole decode call, not a slot's
            slot._start_sequences(i * width, width)
            slots.append(slot)
        return slots

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        return self._shared.ptr

    def spend(self) -> tuple[int, int, float, int]:
        """The llama.cpp context's decode calls of at most decodecall.SMALL_CALL tokens, each with
        logits for every row, with every slot's (how many, their tokens and their
        seconds), and the deepest position it decoded."""
        shared = self._shared
        return shared.small_calls, shared.small_tokens, shared.small_seconds, shared.deepest

    @property
    def memory(self) -> llama_cpp.llama_memory_t:
        return self._shared.memory

    def close(self) -> None:
        if self._owner:
            self._shared.close()

    def decode(
        self,
        tokens: Sequence[int],
        pos: int,
        n_logits: int = 1,
        parents: Sequence[int] | None = None,
    ) -> None:
        """Evaluate `tokens` at positions pos, pos+1, ...; keep logits for the last
        `n_logits` of them. Long inputs go in n_batch chunks: only rows of the last
        chunk stay readable.

        `parents` makes the tokens a tree (one decode call): token i follows token
        parents[i] of this call (-1: the token before `pos`), at the position after its
        parent's. Without it, each token follows the one before: a chain, the tree with
        one branch.
        """
        self._check_position(pos)
        if parents is not None:
            self.stage(tokens, n_logits, parents)
            self.flush()
            return
        first_wanted = len(tokens) - n_logits
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self.stage(chunk, len(chunk) - max(0, first_wanted - start))
            self.flush()

    def _check_position(self, pos: int) -> None:
        if pos != len(self.tokens):
            raise RuntimeError(
                f"{self.model.path.name}: decoding at position {pos}, but the memory holds "
                f"{len(self.tokens)} tokens"
            )

    def stage(
        self, tokens: Sequence[int], n_logits: int = 1, parents: Sequence[int] | None = None
    ) -> None:
        """Put `tokens` (a chain, or with `parents` a tree: see decode) after the
        sequence into the batch of the next `flush`, which may hold other slots' tokens
        too. At most one stage per context and flush."""
        self.drop_branches()
        n = len(tokens)
        if not n:
            return
        pos = len(self.tokens)
        rows = self._rows(tokens)
        b, offsets = self._shared.batch, self._shared.offsets
        if parents is None:
            np.add(offsets[:n], pos - self._shift, out=b.pos[rows])
            b.n_seq_id[rows] = 1
            b.seq_id[rows, 0] = self.seq
            self.tokens.extend(tokens)
            depth = n
        else:
            tree = self._stage_tree(tokens, parents, rows)
            np.add(tree.depths, pos - 1 - self._shift, out=b.pos[rows])
            self.tokens.extend(tree.path_tokens(tree.primary_leaf))
            depth = tree.depth
        n_logits = min(n_logits, n)
        np.greater_equal(offsets[:n], n - n_logits, out=b.logits[rows])
        self._staged(rows, n_logits, pos, pos - self._shift + depth)

    def _rows(self, tokens: Sequence[int]) -> slice:
        """The next rows of the shared batch, given `tokens`."""
        shared, n = self._shared, len(tokens)
        if n > self.batch_room:
            raise RuntimeError(
                f"{n} tokens do not fit in one decode call of {self.model.path.name} "
                f"({self.batch_room} places left)"
            )
        rows = slice(shared.n_staged, shared.n_staged + n)
        shared.batch.token[rows] = tokens
        return rows

    def _staged(self, rows: slice, n_logits: int, pos: int, end: int) -> None:
        """Rows filled from position `pos` on, the last `n_logits` with logits, none at
        a batch position from `end` on: they are this context's part of the next flush."""
        self._first_logit, self._last_row = rows.stop - n_logits, rows.stop - 1
        self._last_call_start = pos
        self._staged_rows = rows
        self._shared.stage(self, rows.stop - rows.start, n_logits, end)

    @property
    def last_call_size(self) -> int:
        """Tokens in the last decode call, any slot's: the next keeps its compute graph
        only at that size."""
        return self._shared.last_size

    @property
    def batch_room(self) -> int:
        """Tokens the next decode call can still take, from any slot."""
        return len(self._shared.offsets) - self._shared.n_staged

    def _stage_tree(self, tokens: Sequence[int], parents: Sequence[int], rows: slice) -> Tree:
        """A tree's sequences in the batch: sequence `seq` goes down the first child of
        every token (the path a chain would have taken); each other leaf's branch is a
        sequence of its own, given the cells of the accepted tokens first."""
        if self.recurrent:
            raise RuntimeError(f"{self.model.path.name} is recurrent: it cannot verify a tree")
        tree = Tree(tokens, parents)
        if tree.n_branches > self.n_seq_max:
            raise RuntimeError(
                f"a tree of {tree.n_branches} branches does not fit one decode call of "
                f"{self.model.path.name} ({self.n_seq_max} sequences)"
            )
        for branch in range(1, tree.n_branches):
            llama_cpp.llama_memory_seq_cp(self.memory, self.seq, self.seq + branch, -1, -1)
        self._branches = tree.n_branches - 1
        self._shared.batch.set_sequences(rows.start, tree.sequences, self.seq)
        self._staged_tree = tree
        return tree

    def flush(self) -> int:
        """llama_decode every token staged since the last flush, by any slot: how many."""
        return self._shared.flush(self.model.name)

    def call_done(self, seconds: float, shared: bool) -> None:
        """The flush that held this context's staged tokens is done (`shared`: with other
        contexts' tokens)."""
        self.decode_seconds += seconds
        self.decode_calls += 1
        if shared or not self._run_open:
            self.runs += 1
        self._run_open = not shared
        self._tree, self._staged_tree = self._staged_tree, None
        # A tree's rows are its nodes, not positions: keep_branch reports the kept path's.
        if self.on_decoded is not None and self._tree is None:
            self.on_decoded(self._last_call_start - self._shift, self._staged_rows)

    def call_failed(self) -> None:
        """The flush that held this context's staged tokens failed: forget them."""
        self._staged_tree = None
        self.drop_branches()
        self._remove_from(self._last_call_start)
        del self.tokens[self._last_call_start :]

    def stage_branches(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int]
    ) -> None:
        """Stage token i at positions[i] in sequence seqs[i], with logits for every
        token (row i is token i's): how a draft grows its tree, one depth per call.
        Tokens of sequence 0 extend the accepted sequence's memory, in order; other
        sequences are branches (see fork), dropped by drop_branches. Sequences are
        counted from this context's own. Positions are places in `tokens`, after any
        media (see the class's docstring)."""
        rows, b = self._rows(tokens), self._shared.batch
        np.subtract(positions, self._shift, out=b.pos[rows])
        b.logits[rows] = 1
        b.n_seq_id[rows] = 1
        np.add(seqs, self.seq, out=b.seq_id[rows, 0])
        self.tokens.extend(t for t, s in zip(tokens, seqs, strict=True) if s == 0)
        end = max(positions) - self._shift + 1
        self._staged(rows, len(tokens), int(positions[0]), end)

    def fork(self, source: int, seq: int, n_tokens: int) -> None:
        """Make branch `seq` hold the first n_tokens positions of sequence `source`
        (sharing their cells): the start of a branch that leaves `source` there.
        Sequences are counted from this context's own."""
        if self.recurrent or not 0 < seq < self.n_seq_max:
            raise RuntimeError(f"{self.model.path.name} cannot hold a branch {seq}")
        end = self._position(n_tokens)
        llama_cpp.llama_memory_seq_cp(self.memory, self.seq + source, self.seq + seq, -1, end)
        self._branches = max(self._branches, seq)

    def drop_branches(self) -> None:
        """Forget every branch, keeping the accepted sequence alone."""
        for branch in range(self.seq + 1, self.seq + self._branches + 1):
            llama_cpp.llama_memory_seq_rm(self.memory, branch, -1, -1)
        self._branches = 0
        self._tree = None

    def keep_branch(self, index: int) -> None:
        """After a decode call: keep its tokens on the path that ends with its token
        `index` (that token and its ancestors), forget the call's other tokens. For a
        chain, the same as rewind to the end of that path."""
        t0 = time.perf_counter()
        self._keep_branch(index)
        self.rollback_seconds += time.perf_counter() - t0

    def _keep_branch(self, index: int) -> None:
        tree = self._tree
        if tree is None:
            self.rewind(self._last_call_start + index + 1)
            return
        branch = tree.sequences[index][0]  # a branch through `index`
        n_keep = self._last_call_start + int(tree.depths[index])
        if self.on_decoded is not None:  # the kept path's rows, by position (see call_done)
            first = self._staged_rows.start
            path = [first + i for i in tree.path(index)]
            self.on_decoded(self._last_call_start - self._shift, path)
        if branch != 0:
            # That branch becomes the accepted sequence, as in llama.cpp's
            # examples/speculative (there with seq_keep, which would drop other slots).
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, -1, -1)
            llama_cpp.llama_memory_seq_cp(self.memory, self.seq + branch, self.seq, -1, -1)
            self.runs += 1  # the path skips its siblings' cells: a run more, at least
            self._run_open = False
            del self.tokens[self._last_call_start :]
            self.tokens.extend(tree.path_tokens(tree.leaves[branch]))
        self.drop_branches()
        self.rewind(n_keep)

    def logits(self, i: int) -> np.ndarray:
        """Row i of the last decode's logits for this context's tokens (i counts the
        tokens that asked for logits; -1 is the last): a view into llama.cpp's buffer,
        valid until the next decode."""
        # llama.cpp counts rows by their token's place in the batch.
        row = i + self._first_logit if i >= 0 else self._last_row + 1 + i
        return self._shared.rows.at(logits_at(self.ptr, row))

    def checkpoint(self, n_ahead: int | None = None) -> None:
        """Make the current length a point `rewind` can come back to. `n_ahead`: the
        rewind will drop at most that many tokens of the next decode call, and keep at
        least its first one (None: no such promise).

        Only recurrent states need this. llama.cpp's snapshots (where the family has
        them) cover such a rewind, and then nothing needs to be saved: they hold the
        states after each token of the last call, but not the state before it.
        """
        if not self.recurrent or (n_ahead is not None and n_ahead <= self.n_rs_seq):
            return
        t0 = time.perf_counter()
        self._checkpoint.save(self.ptr, self.seq, len(self.tokens))
        self.rollback_seconds += time.perf_counter() - t0

    def rewind(self, n_keep: int) -> int:
        """Forget every token from place n_keep on (and the whole of any media there), or,
        for a recurrent state, go back to the checkpoint at or before n_keep. Returns how
        many tokens the memory holds: the caller evaluates the rest again, with the next
        tokens it has to decode."""
        self.drop_branches()
        if len(self.tokens) <= n_keep:
            return len(self.tokens)
        n_keep = self._media_edge(n_keep)
        if n_keep > 0 and self.recurrent and not self._within_snapshots(n_keep):
            n_keep = self._checkpoint.restore(self.ptr, self.seq, n_keep, self.model.path.name)
        self._remove_from(n_keep)  # for a hybrid, its attention layers; never fails at 0
        del self.tokens[n_keep:]
        self._checkpoint.forget_after(n_keep)
        return n_keep

    def prefill(self, tokens: Sequence[int], media: Mapping[int, MediaCells] | None = None) -> int:
        """Make the memory hold exactly `tokens`, keeping the longest start of them it
        already holds (a chat's earlier turns): returns how many tokens were reused.
        `media`: the media whose placeholders `tokens` holds, by placeholder."""
        n = self.reuse(tokens)
        if not media:
            self.decode(tokens[n:], n)
            return n
        start = n
        while start < len(tokens):
            if tokens[start] < 0:
                self.decode_media(media[tokens[start]])
                start = len(self.tokens)
                continue
            end = next((i for i in range(start, len(tokens)) if tokens[i] < 0), len(tokens))
            self.decode(tokens[start:end], start)
            start = end
        return n

    def reuse(self, tokens: Sequence[int]) -> int:
        """Keep the longest start of `tokens` the memory already holds, forget the rest:
        returns its length (the tokens from there on are still to be decoded)."""
        n = common_prefix(self.tokens, tokens)
        if n < len(self.tokens) and not self._can_rewind_to(n):
            n = 0  # a recurrent state that cannot go back there: start over
        return self.rewind(n)

    def save_state(self) -> SavedState:
        """A copy, in host memory, of what the sequence holds (its cells, or its
        recurrent state), to be loaded again into this or another slot of the context.
        llama.cpp copies it a run of cells at a time, and with flash attention off a row
        of a run at a time: on a GPU each is a transfer of its own."""
        self.drop_branches()
        size = llama_cpp.llama_state_seq_get_size(self.ptr, self.seq)
        data = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ptr, data, size, self.seq)
        if written == 0 and self.tokens:
            raise RuntimeError(f"llama.cpp could not save a sequence of {self.model.path.name}")
        return SavedState(tuple(self.tokens), data, self.runs, tuple(self._media))

    def load_state(self, saved: SavedState) -> None:
        """Make the sequence hold what `saved` holds, in place of its own."""
        self.rewind(0)
        if not llama_cpp.llama_state_seq_set_data(self.ptr, saved.data, len(saved.data), self.seq):
            raise RuntimeError(f"llama.cpp could not load a sequence of {self.model.path.name}")
        self.tokens = list(saved.tokens)
        self._media = list(saved.media)
        self._shift = sum(run.saved for run in self._media)
        self.runs, self._run_open = saved.runs, False  # as scattered as the copy, at a guess
        self._last_call_start = len(self.tokens)  # no snapshots of a call to go back into
        self._checkpoint = Checkpoint()

    def _can_rewind_to(self, n_keep: int) -> bool:
        if not self.recurrent or n_keep == 0 or self._within_snapshots(n_keep):
            return True
        return self._checkpoint.n_tokens is not None and self._checkpoint.n_tokens <= n_keep

    def _within_snapshots(self, n_keep: int) -> bool:
        """llama.cpp's snapshots cover the trailing tokens of the last decode call only,
        not its first: going further back (or twice without a decode) silently gives a
        wrong state, though llama_memory_seq_rm reports success."""
        return n_keep > self._last_call_start and len(self.tokens) - n_keep <= self.n_rs_seq

    def _remove_from(self, n_keep: int) -> None:
        """Drop the cells from place n_keep on (an edge of any media: see _media_edge)."""
        self._run_open = False
        if n_keep == 0:
            self.runs = 0
        pos = self._position(n_keep)
        if not llama_cpp.llama_memory_seq_rm(self.memory, self.seq, pos, -1):
            raise RuntimeError(
                f"llama.cpp could not remove tokens from position {pos} of "
                f"{self.model.path.name}'s memory"
            )
        if self._media and self._media[-1].end > n_keep:
            self._media = [run for run in self._media if run.end <= n_keep]
            self._shift = sum(run.saved for run in self._media)

    def _position(self, place: int) -> int:
        """The position of the token at `place` in `tokens` (an edge of any media)."""
        if not self._media:
            return place
        return place - sum(run.saved for run in self._media if run.start < place)

    def _media_edge(self, n: int) -> int:
        """n, or the start of the media whose cells n falls among: the memory keeps an
        image whole, or none of it."""
        for run in self._media:
            if run.start < n < run.end:
                return run.start
        return n

    def decode_media(self, media: MediaCells) -> None:
        """Put `media` in the memory after what it holds (in decode calls of its own,
        not the shared batch's: nothing of this context may be staged)."""
        self.drop_branches()
        start = len(self.tokens)
        pos = start - self._shift
        try:
            media.decode(
                self.ptr, pos, self.seq, len(self._shared.offsets), self._reporter(media, pos)
            )
        except BaseException:
            self._remove_from(start)  # what part of it was decoded
            raise
        self.tokens.extend([media.placeholder] * media.n_tokens)
        run = MediaRun(start, len(self.tokens), media.n_tokens - media.n_pos)
        self._media.append(run)
        self._shift += run.saved
        self.runs += 1
        self._run_open = False
        self._last_call_start = len(self.tokens)  # no snapshots to go back into it

    def _reporter(self, media: MediaCells, pos: int) -> Callable[[int], None] | None:
        """What tells on_decoded, after each call of a media's cells from position `pos`
        on, the cells that stand for its positions (cells_by_position) in that call."""
        on_decoded = self.on_decoded
        if on_decoded is None:
            return None
        cells = cells_by_position(media.n_tokens, media.n_pos)
        done = 0

        def decoded(n: int) -> None:
            nonlocal done
            first, end = np.searchsorted(cells, [done, done + n])
            if end > first:
                on_decoded(pos + int(first), cells[first:end] - done)
            done += n

        return decoded

    def perf_seconds(self) -> float:
        """llama.cpp's own clock of its decode calls (from decode to results), summed
        over every slot of the context."""
        data = llama_cpp.llama_perf_context(self.ptr)
        return (data.t_eval_ms + data.t_p_eval_ms) / 1e3


PREFIX_CHUNK = 256  # tokens compared a slice at a time (in C), before one at a time


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from their start. The drafting heads ask it
    of the whole text every round: slices of PREFIX_CHUNK are compared at C speed, and
    only the first that differs token by token."""
    if type(a) is not list or type(b) is not list:  # slices of two kinds never compare equal
        a, b = list(a), list(b)
    n, most = 0, min(len(a), len(b))
    while n < most and a[n : n + PREFIX_CHUNK] == b[n : n + PREFIX_CHUNK]:
        n += PREFIX_CHUNK
    n = min(n, most)
    for x, y in zip(a[n : n + PREFIX_CHUNK], b[n : n + PREFIX_CHUNK], strict=False):
        if x != y:
            break
        n += 1
    return n
