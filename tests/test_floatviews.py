"""floatviews.py: llama.cpp's output rows, viewed once an address."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp
import numpy as np
import pytest
from test_decode import PROMPT

from specdec_cli.llamacpp import floatviews
from specdec_cli.llamacpp.floatviews import FloatViews, address_of
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model


def fresh_row(ctx: Context, row: int) -> np.ndarray:
    """llama.cpp's logits row, viewed afresh through its own binding."""
    ptr = llama_cpp.llama_get_logits_ith(ctx.ptr, row)
    return np.ctypeslib.as_array(ptr, shape=(ctx.model.n_vocab,))


def test_a_logits_row_is_viewed_once_where_it_comes_back(target_model: Path) -> None:
    """A context's logits rows are views made once for each address llama.cpp gives:
    the same object for a row read again, and after the next decode call its new
    values, as a fresh view of llama.cpp's pointer has them."""
    model = Model(target_model)
    ctx = Context(model, ContextParams(256, 1, "off"))
    try:
        prompt = model.tokenize(PROMPT)
        ctx.decode(prompt, 0, n_logits=2)
        last = ctx.logits(-1)
        assert ctx.logits(-1) is last
        assert ctx.logits(0) is not last
        assert np.array_equal(last, fresh_row(ctx, len(prompt) - 1))
        assert np.array_equal(ctx.logits(0), fresh_row(ctx, len(prompt) - 2))
        before = last.copy()
        ctx.decode([int(last.argmax())], len(prompt))
        after = ctx.logits(-1)
        assert np.array_equal(after, fresh_row(ctx, 0))
        assert not np.array_equal(after, before)
    finally:
        ctx.close()
        model.close()


def test_no_output_is_refused_and_the_views_stay_few(monkeypatch: pytest.MonkeyPatch) -> None:
    views = FloatViews((2,))
    with pytest.raises(RuntimeError, match="no output"):
        views.at(None)
    monkeypatch.setattr(floatviews, "MOST_VIEWS", 4)
    buffer = np.arange(16, dtype=np.float32)
    for i in range(0, 14, 2):  # 7 addresses: the views start afresh past 4
        assert views.at(address_of(buffer[i:])).tolist() == [i, i + 1]
    assert len(views._views) <= 4


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4)[1:],
        np.zeros((0, 4), np.float32),
        np.frombuffer(bytes(16), np.float32),  # read-only
    ],
    ids=["rows", "empty", "read-only"],
)
def test_an_arrays_address_is_numpys(array: np.ndarray) -> None:
    assert address_of(array) == array.ctypes.data


def test_a_function_answers_an_address() -> None:
    """returning_address: the same C function, its pointer as an int (None: NULL)."""
    libc = ctypes.CDLL(None)
    strchr = floatviews.returning_address(libc.strchr, ctypes.c_void_p, ctypes.c_int)
    text = ctypes.create_string_buffer(b"specdec")
    assert strchr(ctypes.addressof(text), ord("c")) == ctypes.addressof(text) + 3
    assert strchr(ctypes.addressof(text), ord("x")) is None
