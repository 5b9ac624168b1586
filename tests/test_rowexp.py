"""A row's exp: llama.cpp's kernel where it is exported and checks out, numpy's otherwise."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from specdec_cli.decoding import sampling
from specdec_cli.decoding.sampling import SamplingParams, distribution
from specdec_cli.llamacpp import rowexp
from specdec_cli.llamacpp.rowexp import ExpSum, numpy_exp_sum


@pytest.fixture(autouse=True)
def fresh_choice() -> Iterator[None]:
    """Each test decides the kernel anew, and leaves no choice of its own behind."""
    rowexp._kernel.cache_clear()
    yield
    rowexp._kernel.cache_clear()


def ggml_kernel_or_skip() -> ExpSum:
    kernel = rowexp._ggml_kernel()
    if kernel is None:
        pytest.skip("this llama.cpp build exports no ggml_vec_soft_max_f32: numpy's exp serves")
    return kernel


def row(n: int) -> np.ndarray:
    x = np.random.default_rng(n).normal(0, 4, n).astype(np.float32)
    x[1::97] = -np.inf  # tokens masked out
    return x


@pytest.mark.parametrize("n", [1, 7, 8, 67, 4099, 151_936])
def test_llama_cpp_kernel_matches_numpy(n: int) -> None:
    """Lengths below, at and past the SIMD width, with masked tokens; in place too."""
    kernel = ggml_kernel_or_skip()
    x = row(n)
    shift = float(x.max())
    want = np.empty_like(x)
    want_total = numpy_exp_sum(x, shift, want)
    got = np.empty_like(x)
    total = kernel(x, shift, got)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-38)
    assert math.isclose(total, want_total, rel_tol=1e-6)
    in_place = x.copy()
    assert kernel(in_place, shift, in_place) == total
    np.testing.assert_array_equal(in_place, got)


def test_llama_cpp_kernel_is_used_where_it_checks_out() -> None:
    ggml_kernel_or_skip()
    assert rowexp._kernel() is not numpy_exp_sum
    assert rowexp.kernel_name() == "llama.cpp (ggml_vec_soft_max_f32)"


def test_rows_the_kernel_would_misread_take_numpys_exp() -> None:
    x = row(64)
    for bad_x, bad_out in (
        (x.astype(np.float64), np.empty(64, np.float64)),
        (x[::2], np.empty(32, np.float32)),  # not contiguous
    ):
        shift = float(bad_x.max())
        total = rowexp.exp_sum(bad_x, shift, bad_out)
        np.testing.assert_allclose(bad_out, np.exp(bad_x.astype(np.float64) - shift), rtol=1e-6)
        assert math.isclose(total, float(bad_out.sum()), rel_tol=1e-6)


def shift_ignored(x: np.ndarray, shift: float, out: np.ndarray) -> float:
    return numpy_exp_sum(x, 0.0, out)


def sum_wrong(x: np.ndarray, shift: float, out: np.ndarray) -> float:
    return 2.0 * numpy_exp_sum(x, shift, out)


def faults(x: np.ndarray, shift: float, out: np.ndarray) -> float:
    raise OSError("exception: access violation reading 0x0000000000000000")


@pytest.mark.parametrize("wrong", [shift_ignored, sum_wrong, faults])
def test_a_kernel_that_disagrees_with_numpy_is_not_used(
    wrong: ExpSum, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's negative control: a kernel whose arguments are read differently (a
    changed signature), whose sum is wrong, or that fails, leaves numpy in charge."""
    monkeypatch.setattr(rowexp, "_ggml_kernel", lambda: wrong)
    assert not rowexp._agrees_with_numpy(wrong)
    assert rowexp._kernel() is numpy_exp_sum


def test_a_build_without_the_library_falls_back_to_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, base_path: object) -> None:
        raise FileNotFoundError(f"Shared library with base name '{name}' not found")

    monkeypatch.setattr(rowexp.ctypes_ext, "load_shared_library", missing)
    assert rowexp._ggml_kernel() is None
    assert rowexp._kernel() is numpy_exp_sum
    assert rowexp.kernel_name() == "numpy"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=0, top_p=1.0, min_p=0.0), SamplingParams(top_k=0)],
    ids=["plain softmax", "top-k 0, exact total"],
)
def test_distributions_agree_whichever_kernel_takes_the_exp(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole-row paths (the plain softmax, top-p's exact total) give the same
    distribution from either kernel, at a real vocabulary size."""
    ggml_kernel_or_skip()
    monkeypatch.setattr(sampling, "NEAR_MARGINS", ())  # top-p from the exact total
    logits = row(151_936)
    with_ggml = distribution(logits, params)
    monkeypatch.setattr(rowexp, "_kernel", lambda: numpy_exp_sum)
    with_numpy = distribution(logits, params)
    np.testing.assert_array_equal(with_ggml.ids, with_numpy.ids)
    np.testing.assert_allclose(with_ggml.probs, with_numpy.probs, rtol=2e-6, atol=1e-30)
