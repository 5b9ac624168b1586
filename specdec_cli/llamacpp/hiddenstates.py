"""The target's hidden states, as a drafting head reads them: recorded after every decode
call of the target's context (`record_hidden_states`, through its `on_decoded` hook),
either its final state (an MTP head's or a Gemma 4 assistant's input) or the inputs of
some of its layers side by side (an EAGLE-3 or DFlash file's), read through llama.cpp's
extended API (src/llama-ext.h, a C++ header: its functions are bound here by their
mangled names where llama-cpp-python does not bind them)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from specdec_cli.errors import UserError
from specdec_cli.llamacpp.floatviews import FloatViews, nextn_states_at
from specdec_cli.llamacpp.llama import Context


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

    def after(self, first: int, last: int) -> np.ndarray:
        """The states after positions first .. last - 1, a row each (what a head reads
        beside the tokens that follow them). Zero where none is held (position -1, before
        the text; or a prefix the target took from a cache without decoding it): the head
        then drafts worse, never wrongly, since the target verifies every draft."""
        out = np.zeros((last - first, self.n_embd), np.float32)
        lo, hi = max(first, self.start), min(last, self.end)
        if lo < hi:
            out[lo - first : hi - first] = self.rows[lo - self.start : hi - self.start]
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
    ctypes.c_void_p,  # an address (see floatviews.py)
)


def record_hidden_states(target: Context, layers: Sequence[int] = ()) -> HiddenStates:
    """Make the target's decode calls keep, for every row, its final hidden state (an
    MTP head's input), or with `layers` the inputs of those layers side by side (an
    EAGLE-3 head's; id n_layer is the final state), and record this slot's in a
    HiddenStates. Call before the target's first decode: llama.cpp reserves its graph for
    them then (enabled later, their values stay zero)."""
    ptr, n_embd = target.ptr, llama_cpp.llama_model_n_embd(target.model.ptr)
    n_layer = llama_cpp.llama_model_n_layer(target.model.ptr)
    sources: list[Callable[[], int | None]] = []
    for layer in layers or [n_layer]:
        if layer < n_layer:
            if _set_layer_input is None or _get_layer_input is None:
                raise UserError("this llama.cpp build does not export its layer inputs")
            _set_layer_input(ptr, layer, True)
            sources.append(functools.partial(_get_layer_input, ptr, layer))
        else:
            llama_cpp_ext.llama_set_embeddings_nextn(ptr, True, False)
            sources.append(functools.partial(nextn_states_at, ptr))
    states = HiddenStates(n_embd * len(sources))
    # Unmasked, llama.cpp keeps a row for every place of a batch.
    whole_batch = FloatViews((llama_cpp.llama_n_batch(ptr), n_embd))

    def decoded(pos: int, rows: slice | list[int] | np.ndarray) -> None:
        states.record(pos, [whole_batch.at(read())[rows] for read in sources])

    target.on_decoded = decoded
    return states
