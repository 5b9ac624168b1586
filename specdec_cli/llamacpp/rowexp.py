"""Every token's exp in one row of logits, with llama.cpp's own vectorised kernel.

Sampling with every filter off needs the exp of every token of every row (152k-262k
values, the draft's rows included), and so do a few rarer paths. numpy's float32 exp
is not vectorised on every CPU (benchmarks/README.md, "every filter off"). llama.cpp's
CPU backend has a kernel that is, for whichever SIMD extension it was built with: the
body of its softmax, `ggml_vec_soft_max_f32`, which writes exp(x - shift) and returns
the sum in float64. It is exported by the CPU backend's library but is not in ggml's
public headers, so it is checked against numpy once, on values that reach its edge
cases, before it is used; numpy takes over where the check fails or the symbol is
missing (a Windows DLL exports only ggml's API).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import llama_cpp._ctypes_extensions as ctypes_ext
import llama_cpp.llama_cpp as llama_cpp
import numpy as np

ExpSum = Callable[[np.ndarray, float, np.ndarray], float]

# Values that reach the kernel's special cases: exact 0, the float32 underflow and
# overflow edges, -inf (a masked token), and a length that leaves a tail after the
# widest SIMD block.
_CHECK_VALUES = np.array(
    [0.0, -1e-3, -0.5, -1.0, -10.0, -50.0, -87.0, -88.5, -100.0, -200.0, -np.inf, 3.5, 20.0] * 5,
    np.float32,
)


def exp_sum(x: np.ndarray, shift: float, out: np.ndarray) -> float:
    """out = exp(x - shift) (out may be x); returns the sum of out. Rows other than
    contiguous float32 ones of one length, which the kernel would misread, take numpy's."""
    if _is_row(x) and _is_row(out) and len(x) == len(out):
        return _kernel()(x, shift, out)
    return numpy_exp_sum(x, shift, out)


_scratch_rows: dict[int, np.ndarray] = {}


def scratch_row(n: int) -> np.ndarray:
    """A float32 row of n values, kept across calls: an `out` for exp_sum where the exps
    are wanted only within one call (their sum, a cut), as a new row per token would cost
    as much as the pass. One row per length for every caller, so a caller must be done
    with it before anything else may use it (one decode thread uses it at a time)."""
    if n not in _scratch_rows:
        _scratch_rows[n] = np.empty(n, np.float32)
    return _scratch_rows[n]


def kernel_name() -> str:
    """Which exp is in use, for `specdec info`."""
    return "numpy" if _kernel() is numpy_exp_sum else "llama.cpp (ggml_vec_soft_max_f32)"


@functools.cache
def _kernel() -> ExpSum:
    kernel = _ggml_kernel()
    return kernel if kernel is not None and _agrees_with_numpy(kernel) else numpy_exp_sum


def numpy_exp_sum(x: np.ndarray, shift: float, out: np.ndarray) -> float:
    np.subtract(x, np.float32(shift), out=out)
    np.exp(out, out=out)
    return float(out.sum())


def _ggml_kernel() -> ExpSum | None:
    try:
        # Beside the libllama in use (LLAMA_CPP_LIB_PATH can move it): the same build.
        library = ctypes_ext.load_shared_library("ggml-cpu", llama_cpp._base_path)
        function = library.ggml_vec_soft_max_f32
    except (OSError, RuntimeError, AttributeError):  # no such library, or no such symbol
        return None
    function.restype = ctypes.c_double
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]

    def ggml_exp_sum(x: np.ndarray, shift: float, out: np.ndarray) -> float:
        return float(function(len(x), out.ctypes.data, x.ctypes.data, shift))

    return ggml_exp_sum


def _is_row(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.ndim == 1 and a.flags.c_contiguous


def _agrees_with_numpy(kernel: ExpSum) -> bool:
    """Whether `kernel` computes what numpy does, to float32's precision (not bit for
    bit: the two exps round differently), on every edge case and for the sum."""
    shift = 2.5
    got = np.empty_like(_CHECK_VALUES)
    try:
        total = kernel(_CHECK_VALUES, shift, got)
    except OSError:  # what ctypes raises for a fault it catches (Windows)
        return False
    want = np.exp(_CHECK_VALUES.astype(np.float64) - shift)
    close = np.allclose(got, want, rtol=1e-5, atol=1e-37)
    return bool(close) and math.isclose(total, float(want.sum()), rel_tol=1e-6)
