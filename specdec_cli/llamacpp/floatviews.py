"""numpy views of llama.cpp's output buffers (a row of logits, a head's state), made once
for each address.

llama.cpp answers every read of an output with a pointer: a row of logits after every
decode call, a head's state beside every draft token. Viewing one afresh (the pointer's
contents, a ctypes array at its address, numpy's frombuffer) costs several microseconds,
more right after a decode call has left the caches cold. llama.cpp keeps its output
buffer from call to call (it grows it only for a call with more outputs than it has
room for), so rows come back at the same few addresses: each is viewed once.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

# Past this many addresses (an output buffer that moved many times) the views start afresh.
MOST_VIEWS = 4096

Address = Callable[..., int | None]


def returning_address(function: Any, *argtypes: Any) -> Address:
    """The C function a ctypes binding calls, returning its pointer as an int (None:
    NULL) instead of a ctypes pointer object, which would cost a call more to read."""
    prototype = ctypes.CFUNCTYPE(ctypes.c_void_p, *argtypes)
    return prototype(ctypes.cast(function, ctypes.c_void_p).value)


# llama_get_logits_ith, a head's llama_get_embeddings_nextn_ith (its state after a row),
# and llama_get_embeddings_nextn (a context's every state, or EAGLE-3's encodings),
# answering addresses.
logits_at = returning_address(llama_cpp.llama_get_logits_ith, ctypes.c_void_p, ctypes.c_int32)
state_at = returning_address(
    llama_cpp_ext.llama_get_embeddings_nextn_ith, ctypes.c_void_p, ctypes.c_int32
)
nextn_states_at = returning_address(llama_cpp_ext.llama_get_embeddings_nextn, ctypes.c_void_p)


def address_of(array: np.ndarray) -> int:
    """The address of a C-contiguous array's first element: through ctypes' buffer view
    where the array is writable and not empty (a third of the cost of numpy's
    `array.ctypes.data`, which builds an object each time), else numpy's."""
    if array.flags.writeable and array.size:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


class FloatViews:
    """float32 views of one shape, one for each address llama.cpp has given."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self._array = ctypes.c_float * math.prod(shape)
        self._views: dict[int | None, np.ndarray] = {}

    def at(self, address: int | None) -> np.ndarray:
        """The view at `address` (valid as long as llama.cpp's buffer is there: until the
        next decode call, for a row read after one)."""
        view = self._views.get(address)
        return self._view(address) if view is None else view

    def _view(self, address: int | None) -> np.ndarray:
        if not address:
            raise RuntimeError("llama.cpp has no output at that row")
        if len(self._views) >= MOST_VIEWS:
            self._views.clear()
        view = np.frombuffer(self._array.from_address(address), np.float32).reshape(self.shape)
        self._views[address] = view
        return view
