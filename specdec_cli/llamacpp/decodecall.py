"""One llama_decode call, which the slots of a context share (see llama.Context.split):
its batch laid out in numpy arrays allocated once, the layout of a draft tree in it, and
the call itself, timed.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llama_cpp.llama_cpp as llama_cpp
import numpy as np

from specdec_cli.llamacpp.floatviews import FloatViews

if TYPE_CHECKING:
    from specdec_cli.llamacpp.llama import Context

SMALL_CALL = 64  # tokens at most in a decode call that Context.spend counts


class SharedCall:
    """What the slots of one llama.cpp context share: the context, its memory, one
    batch, and the decode call being put together in it."""

    def __init__(
        self, ptr: llama_cpp.llama_context_p, n_batch: int, n_seq_max: int, n_vocab: int
    ) -> None:
        self.ptr: llama_cpp.llama_context_p | None = ptr
        self.memory = llama_cpp.llama_get_memory(ptr)
        self.batch = Batch(n_batch, n_seq_max)
        self.offsets = np.arange(n_batch, dtype=np.int32)  # 0, 1, 2, ...
        self.rows = FloatViews((n_vocab,))  # views of its logits rows
        self.n_staged = 0
        self.staged: list[Context] = []
        self.last_size = 0  # tokens in the last decode call
        # What the decode calls of a verification's or a draft step's size spent (not a
        # prompt's, nor any call with rows that gave no logits, which skip the output
        # layer: the measurements' calls have none), and the deepest position decoded:
        # what -fa auto checks its choice against (decoding/flashattn.py).
        self.small_calls = 0
        self.small_tokens = 0
        self.small_seconds = 0.0
        self.deepest = 0
        # The rows with logits staged for the next call, and its deepest position + 1,
        # counted as they are staged (numpy's reductions over the batch's rows cost tens
        # of microseconds a call).
        self._staged_logits = self._staged_end = 0

    def stage(self, ctx: Context, n: int, n_logits: int, end: int) -> None:
        """`ctx`'s n rows in the next call, `n_logits` of them with logits, none at a
        position from `end` on."""
        if ctx in self.staged:
            raise RuntimeError(f"{ctx.model.path.name}: one stage per decode call and slot")
        self.staged.append(ctx)
        self.n_staged += n
        self._staged_logits += n_logits
        self._staged_end = max(self._staged_end, end)

    def flush(self, name: str) -> int:
        staged, n = self.staged, self.n_staged
        if not n:
            return 0
        self.staged, self.n_staged, self.last_size = [], 0, n
        n_logits, end = self._staged_logits, self._staged_end
        self._staged_logits = self._staged_end = 0
        self.batch.struct.n_tokens = n
        t0 = time.perf_counter()
        status = llama_cpp.llama_decode(self.ptr, self.batch.struct)
        # Wait for the results here, so that decode_seconds (and llama.cpp's own
        # clock, which stops at a synchronize) covers this call and nothing else.
        llama_cpp.llama_synchronize(self.ptr)
        seconds = time.perf_counter() - t0
        if status != 0:
            for ctx in staged:
                ctx.call_failed()
            raise RuntimeError(f"{name}: llama_decode failed with status {status}")
        for ctx in staged:
            ctx.call_done(seconds, len(staged) > 1)
        if n <= SMALL_CALL and n_logits == n:
            self.small_calls += 1
            self.small_tokens += n
            self.small_seconds += seconds
        self.deepest = max(self.deepest, end)
        return n

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None


class Batch:
    """A llama_batch over numpy arrays allocated once: filled by vectorised writes, not
    element by element through ctypes. Row i of `seq_id` holds token i's sequence ids
    (`n_seq_id[i]` of them)."""

    def __init__(self, n_tokens: int, n_seq_max: int) -> None:
        self.token = np.zeros(n_tokens, np.int32)
        self.pos = np.zeros(n_tokens, np.int32)
        self.n_seq_id = np.ones(n_tokens, np.int32)
        self.seq_id = np.zeros((n_tokens, n_seq_max), np.int32)
        self.logits = np.zeros(n_tokens, np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        # The address of each row of seq_id, worked out at once: a ctypes pointer per row
        # is thousands of objects made at every context's creation.
        rows = np.arange(n_tokens, dtype=np.uintp) * self.seq_id.strides[0]
        self._rows = rows + np.uintp(self.seq_id.ctypes.data)
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(int_p),
            embd=None,
            pos=self.pos.ctypes.data_as(int_p),
            n_seq_id=self.n_seq_id.ctypes.data_as(int_p),
            seq_id=ctypes.cast(self._rows.ctypes.data, ctypes.POINTER(int_p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def set_sequences(self, first: int, sequences: Sequence[Sequence[int]], base: int) -> None:
        """Rows from `first` on: each token's sequence ids, counted from `base`."""
        for i, seqs in enumerate(sequences, start=first):
            self.n_seq_id[i] = len(seqs)
            self.seq_id[i, : len(seqs)] = seqs
            self.seq_id[i, : len(seqs)] += base


class Tree:
    """A tree of tokens in one decode call, laid out for llama.cpp: each token's depth
    (1: a child of the token before the call) and the sequences through it, one per
    leaf. The first leaf met going down first children is sequence 0, so a chain is
    sequence 0 alone. A token's first sequence id is one of its own branch: llama.cpp
    masks attention by that one."""

    def __init__(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        n = len(tokens)
        self.tokens, self.parents = list(tokens), list(parents)
        children: list[list[int]] = [[] for _ in range(n + 1)]  # [n]: the root's
        depths = np.zeros(n, np.int32)
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"tree token {i} has parent {parent}: parents come first")
            children[parent].append(i)
            depths[i] = 1 if parent < 0 else depths[parent] + 1
        self.depths = depths
        self.depth = int(depths.max()) if n else 0  # the deepest token's
        # Leaves in depth-first order, first children first: the first is the primary.
        self.leaves: list[int] = []
        stack = children[-1][::-1]
        while stack:
            i = stack.pop()
            if children[i]:
                stack.extend(children[i][::-1])
            else:
                self.leaves.append(i)
        self.primary_leaf = self.leaves[0] if self.leaves else -1
        self.n_branches = len(self.leaves)
        self.sequences: list[list[int]] = [[] for _ in range(n)]
        for seq, leaf in enumerate(self.leaves):
            for i in self.path(leaf):
                self.sequences[i].append(seq)

    def path(self, i: int) -> list[int]:
        """The tokens from the first depth down to token i (indices)."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]

    def path_tokens(self, i: int) -> list[int]:
        return [self.tokens[j] for j in self.path(i)]
