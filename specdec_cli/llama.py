"""The llama.cpp wrapper: the only module that touches ctypes.

It exposes just what speculative decoding needs: load a model, make a context,
decode a batch of tokens at given positions with logits where asked, read those
logits as zero-copy numpy views, and cut the KV cache back to a position. Also
llama.cpp's own view of a vocabulary and its chat-template formatting.
"""

from __future__ import annotations

import ctypes
import os
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


def physical_cores() -> int:
    """Physical cores available to this process: llama.cpp's raw default (4) oversubscribes
    small machines, and hyper-threads slow matrix work down rather than up."""
    if hasattr(os, "sched_getaffinity"):
        available = len(os.sched_getaffinity(0))
    else:
        available = os.cpu_count() or 1
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
    except OSError:
        return available
    cores = set()
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        if "core id" in {k.strip() for k in fields}:
            ids = {k.strip(): v.strip() for k, v in fields.items()}
            cores.add((ids.get("physical id"), ids["core id"]))
    return max(1, min(available, len(cores) or available))


# llama.h: enum llama_vocab_type. Pairing compares these, not GGUF's tokenizer.ggml.model
# names: "gpt2" and "gemma4" are both BPE to llama.cpp.
VOCAB_TYPES = {
    llama_cpp.LLAMA_VOCAB_TYPE_NONE: "none",
    llama_cpp.LLAMA_VOCAB_TYPE_SPM: "SPM",
    llama_cpp.LLAMA_VOCAB_TYPE_BPE: "BPE",
    llama_cpp.LLAMA_VOCAB_TYPE_WPM: "WPM",
    llama_cpp.LLAMA_VOCAB_TYPE_UGM: "UGM",
    llama_cpp.LLAMA_VOCAB_TYPE_RWKV: "RWKV",
    llama_cpp.LLAMA_VOCAB_TYPE_PLAMO2: "PLaMo2",
}


@dataclass(frozen=True)
class VocabInfo:
    """A tokenizer's special tokens and flags as llama.cpp applies them: with its defaults
    for keys a file leaves out and its per-family overrides (Gemma 4 always adds BOS)."""

    vocab_type: str
    n_tokens: int
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool


def _token_or_none(token: int) -> int | None:
    return None if token == llama_cpp.LLAMA_TOKEN_NULL else token


class Model:
    """A loaded GGUF model and its vocabulary. `vocab_only` loads the tokenizer alone
    (no weights: cheap), enough to tokenize and to read the vocabulary's facts."""

    def __init__(self, path: Path, n_gpu_layers: int = 0, vocab_only: bool = False) -> None:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise UserError(
                f"llama.cpp could not load {path}; check that it is a complete model file "
                "(rerun with --verbose to see llama.cpp's own messages)"
            )
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.bos: int = llama_cpp.llama_vocab_bos(self.vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
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

    def vocab_info(self) -> VocabInfo:
        return VocabInfo(
            vocab_type=VOCAB_TYPES.get(llama_cpp.llama_vocab_type(self.vocab), "unknown"),
            n_tokens=self.n_vocab,
            bos=_token_or_none(self.bos),
            eos=_token_or_none(llama_cpp.llama_vocab_eos(self.vocab)),
            add_bos=self.add_bos,
            add_eos=bool(llama_cpp.llama_vocab_get_add_eos(self.vocab)),
        )

    def chat_template(self) -> str | None:
        """The model's own chat template (tokenizer.chat_template), if it has one."""
        template = llama_cpp.llama_model_chat_template(self.ptr, None)
        return None if template is None else template.decode(errors="replace")


def read_vocab(path: Path) -> VocabInfo:
    """The tokenizer facts of a model file, read by loading its vocabulary alone."""
    model = Model(path, vocab_only=True)
    try:
        return model.vocab_info()
    finally:
        model.close()


def builtin_chat_templates() -> list[str]:
    """The names of the chat formats llama.cpp implements itself (chatml, llama3, gemma...)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return [name.decode() for name in names]


def apply_chat_template(
    template: str, messages: Sequence[tuple[str, str]], add_assistant: bool
) -> str | None:
    """Format (role, content) messages with llama.cpp's llama_chat_apply_template; None if
    llama.cpp does not recognise the template.

    `template` is a built-in name or a template's text. llama.cpp does not run Jinja: it
    recognises a known format by markers in the text (<|im_start|>, <start_of_turn>...) and
    writes that format with its own code. `add_assistant` ends with the assistant's header.
    """
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(role.encode(), text.encode()) for role, text in messages)
    )
    size = 2 * sum(len(role) + len(text.encode()) for role, text in messages) + 1024
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(
            template.encode(), chat, len(messages), add_assistant, buf, size
        )
        if n < 0:
            return None
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
