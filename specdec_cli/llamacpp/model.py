"""llama.cpp's model, from our ctypes layer: start the backend once, load a model (or its
vocabulary alone), read its vocabulary and metadata, and format chats with llama.cpp's
built-in chat templates. The context that decodes with a model is llama.py's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llama_cpp.llama_cpp as llama_cpp

from specdec_cli.errors import UserError


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
    load_mtp: bool = False  # the MTP ("nextn") layers too, to draft with (llamacpp/heads.py)

    def to_llama(self) -> tuple[llama_cpp.llama_model_params, ctypes.Array | None]:
        """llama_model_params, and the device array they point to (keep it alive until
        the model is loaded). llama.cpp reads `devices` as a NULL-terminated array; an
        array holding only NULL offloads nothing."""
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        params.use_extra_bufts = self.use_extra_bufts
        params.load_mtp = self.load_mtp
        devices = None
        if self.devices is not None:
            devices = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)
            params.devices = ctypes.cast(devices, ctypes.c_void_p)
        return params, devices


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

    def __init__(
        self, path: Path, params: ModelParams = ModelParams(), vocab_only: bool = False
    ) -> None:
        llama_params, _devices = params.to_llama()  # _devices: alive during the load
        llama_params.vocab_only = vocab_only
        self.path = path
        self.name = path.name  # its messages' (pathlib computes it at each read)
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
        self.eos: int = llama_cpp.llama_vocab_eos(self.vocab)
        # Recurrent and hybrid models keep a state that cannot be cut back to a position.
        is_recurrent, is_hybrid = (
            llama_cpp.llama_model_is_recurrent,
            llama_cpp.llama_model_is_hybrid,
        )
        self.recurrent: bool = is_recurrent(self.ptr) or is_hybrid(self.ptr)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        # MTP blocks the file has (loaded only with ModelParams.load_mtp).
        self.n_nextn: int = llama_cpp.llama_model_n_layer_nextn(self.ptr)
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
        """The bytes a token stands for (possibly part of a UTF-8 character); a control
        token stands for none, as llama.cpp writes text. Cached."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self._pieces[token] = self._token_to_piece(token, special=False)
        return cached

    def token_text(self, token: int) -> str:
        """A token's text, special tokens written out ("<bos>", "<|im_end|>"): what a
        chat template calls bos_token and eos_token. "" for no token (-1)."""
        if token < 0:
            return ""
        return self._token_to_piece(token, special=True).decode(errors="replace")

    def _token_to_piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:  # too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def vocab_info(self) -> VocabInfo:
        return VocabInfo(
            vocab_type=VOCAB_TYPES.get(llama_cpp.llama_vocab_type(self.vocab), "unknown"),
            n_tokens=self.n_vocab,
            bos=_token_or_none(self.bos),
            eos=_token_or_none(self.eos),
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


@cache
def builtin_chat_templates() -> tuple[str, ...]:
    """The names of the chat formats llama.cpp implements itself (chatml, llama3, gemma...):
    fixed for a build, asked once (every chat prompt checks its template against them)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return tuple(name.decode() for name in names)


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
