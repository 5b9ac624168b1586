"""The llama.cpp wrapper: the only module that touches ctypes (backend.py, which asks
ggml which backends and devices the build has, aside).

It exposes just what speculative decoding needs: load a model, make a context,
decode a batch of tokens at given positions with logits where asked, read those
logits as zero-copy numpy views, and cut the KV cache back to a position.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp
import numpy as np

from specdec_cli.errors import UserError

FLASH_ATTN = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}

_SEQ = 0  # specdec decodes one sequence per context


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


_backend_ready = False


def init_backend(verbose: bool = False) -> None:
    """Start llama.cpp once per process; silence its logging unless `verbose`.

    `_quiet_log` is a module-level object on purpose: llama.cpp keeps the raw function
    pointer, and a callback that Python has collected crashes the next log line.
    """
    global _backend_ready
    if not verbose:
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    if not _backend_ready:
        llama_cpp.llama_backend_init()
        _backend_ready = True


@dataclass(frozen=True)
class ModelParams:
    """How llama.cpp loads a model; the defaults are llama.cpp's own."""

    n_gpu_layers: int = -1  # -ngl: layers to offload; -1 is all (a CPU-only build offloads none)
    devices: tuple[int, ...] | None = None  # -dev: ggml_backend_dev_t handles; None: every GPU
    use_extra_bufts: bool = True  # --repack: weights repacked for the CPU's fastest kernels

    def to_llama(self) -> tuple[llama_cpp.llama_model_params, ctypes.Array | None]:
        """llama_model_params, and the device array they point to (keep it alive until
        the model is loaded). llama.cpp reads `devices` as a NULL-terminated array; an
        array holding only NULL offloads nothing."""
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.use_extra_bufts = self.use_extra_bufts
        devices = None
        if self.devices is not None:
            devices = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)
            params.devices = ctypes.cast(devices, ctypes.c_void_p)
        return params, devices


class Model:
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: Path, params: ModelParams = ModelParams()) -> None:
        llama_params, _devices = params.to_llama()  # _devices: alive during the load
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_params)
        if not self.ptr:
            raise UserError(
                f"llama.cpp could not load {path}; check that it is a complete model file "
                "(rerun with --verbose to see llama.cpp's own messages)"
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.bos: int = llama_cpp.llama_vocab_bos(self.vocab)
        self._pieces: dict[int, bytes] = {}

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode()
        n_max = len(data) + 8
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(
            self.vocab, data, len(data), buf, n_max, add_special, parse_special
        )
        if n < 0:  # too small: -n is the size needed
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(
                self.vocab, data, len(data), buf, n_max, add_special, parse_special
            )
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (possibly part of a UTF-8 character). Cached."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """Format a one-turn conversation with the model's own (GGUF) chat template."""
        template = llama_cpp.llama_model_chat_template(self.ptr, None)
        if template is None:
            raise UserError(
                f"{self.path.name} has no chat template in its metadata; drop --chat and "
                "write the prompt in the model's format yourself"
            )
        turns = ([("system", system)] if system else []) + [("user", user)]
        messages = (llama_cpp.llama_chat_message * len(turns))(
            *(llama_cpp.llama_chat_message(role.encode(), text.encode()) for role, text in turns)
        )
        size = 2 * sum(len(t.encode()) for _, t in turns) + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(template, messages, len(turns), True, buf, size)
            if n < 0:
                raise UserError(
                    f"llama.cpp does not support the chat template of {self.path.name}; "
                    "drop --chat and format the prompt yourself"
                )
            if n <= size:
                return buf.raw[:n].decode(errors="replace")
            size = n + 1
        raise AssertionError("chat template grew between two calls")


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int
    n_threads: int
    flash_attn: str = "auto"
    n_batch: int = 512


class Context:
    """One model's inference state: its KV cache holds a single token sequence.

    `decode` is the only way tokens enter the cache; `trim` is the only way they leave.
    Time spent inside llama.cpp's decode is summed in `decode_seconds`, so callers can
    tell the engine's cost from their own.
    """

    def __init__(self, model: Model, params: ContextParams) -> None:
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = params.n_ctx
        cparams.n_batch = min(params.n_batch, params.n_ctx)
        cparams.n_ubatch = cparams.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = params.n_threads
        cparams.n_threads_batch = params.n_threads
        cparams.flash_attn_type = FLASH_ATTN[params.flash_attn]
        cparams.no_perf = False  # keep llama.cpp's own decode timing: see perf_seconds()
        self.model = model
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, cparams)
        if not self.ptr:
            raise UserError(
                f"llama.cpp could not create a context of {params.n_ctx} tokens for "
                f"{model.path.name}; try a smaller -c"
            )
        # llama.cpp may round the context up (to a multiple of 256); honour what was asked.
        self.n_ctx: int = min(params.n_ctx, llama_cpp.llama_n_ctx(self.ptr))
        self.n_batch: int = cparams.n_batch
        self.threads: int = params.n_threads
        self.memory = llama_cpp.llama_get_memory(self.ptr)
        self.decode_seconds = 0.0
        self.decode_calls = 0
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        # Every token belongs to sequence 0: set that once, then fill the batch through
        # numpy views of its arrays instead of element by element through ctypes.
        for i in range(self.n_batch):
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = _SEQ
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._want = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._offsets = np.arange(self.n_batch, dtype=self._pos.dtype)  # 0, 1, 2, ...
        self._row_type = ctypes.c_float * model.n_vocab

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    def decode(self, tokens: Sequence[int], pos: int, all_logits: bool = False) -> None:
        """Evaluate `tokens` at positions pos, pos+1, ...; keep logits for every token
        (`all_logits`) or only for the last one. Long inputs go in n_batch chunks."""
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            n = len(chunk)
            self._tokens[:n] = chunk
            np.add(self._offsets[:n], pos + start, out=self._pos[:n])
            self._want[:n] = all_logits
            if start + n == len(tokens):
                self._want[n - 1] = 1
            self._batch.n_tokens = n
            t0 = time.perf_counter()
            status = llama_cpp.llama_decode(self.ptr, self._batch)
            # Wait for the results here, so that decode_seconds (and llama.cpp's own
            # clock, which stops at a synchronize) covers this call and nothing else.
            llama_cpp.llama_synchronize(self.ptr)
            self.decode_seconds += time.perf_counter() - t0
            self.decode_calls += 1
            if status != 0:
                raise RuntimeError(
                    f"llama_decode failed with status {status} at position {pos + start}"
                )

    def logits(self, i: int) -> np.ndarray:
        """Row i of the last decode's logits (i counts the tokens that asked for logits;
        -1 is the last): a view into llama.cpp's buffer, valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, i)
        return np.frombuffer(
            self._row_type.from_address(ctypes.addressof(ptr.contents)), np.float32
        )

    def trim(self, n_keep: int) -> None:
        """Forget every cached token at position >= n_keep."""
        llama_cpp.llama_memory_seq_rm(self.memory, _SEQ, n_keep, -1)

    def perf_seconds(self) -> float:
        """llama.cpp's own clock of its decode calls (from decode to results), summed."""
        data = llama_cpp.llama_perf_context(self.ptr)
        return (data.t_eval_ms + data.t_p_eval_ms) / 1e3
