"""Does this CPU survive llama.cpp's repacked kernels? Asked once, in a child process.

On some CPUs that advertise Intel AMX, llama.cpp's AMX matrix kernels die with SIGILL
(or a segfault) on the first batch through any quantized model, killing the process
without a word (llama.cpp issue #20824). Loading without extra buffer types
(`--no-repack`) avoids them. So where the CPU advertises AMX and the user did not say
--repack or --no-repack, a child process (`python -m specdec_cli.llamacpp.probe`) writes a
tiny Q8_0 model, loads it with extra buffer types, and decodes a batch. If the child
dies, specdec runs with --no-repack and says so. The verdict is kept with the
measured costs (costcache), keyed by the CPU and the llama.cpp build.
"""

from __future__ import annotations

import platform
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.llamacpp import backend, costcache, machine
from specdec_cli.llamacpp.llama import Context, ContextParams
from specdec_cli.llamacpp.model import Model, ModelParams, init_backend

PROBE_COMMAND = (sys.executable, "-m", "specdec_cli.llamacpp.probe")
PROBE_TIMEOUT = 300  # seconds; a tiny model decodes in milliseconds, but machines stall

# The probe model: one llama layer whose matrices meet the AMX kernels' shape rules
# (rows and columns multiples of 32), and a batch long enough to take the tiled path.
N_EMBD, N_FF, N_VOCAB, N_HEAD = 64, 128, 64, 2
BATCH = 16

_GGUF_UINT32, _GGUF_FLOAT32, _GGUF_STRING = 4, 6, 8
_GGML_F32, _GGML_Q8_0 = 0, 8
_Q8_0_BLOCK, _Q8_0_BLOCK_BYTES = 32, 34  # 32 weights: an f16 scale and 32 int8
_ALIGNMENT = 32


@dataclass(frozen=True)
class Verdict:
    survived: bool
    detail: str  # how the probe ended: "passed", "died with SIGILL", "exited with code 1"


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _metadata(key: str, value: str | int | float) -> bytes:
    if isinstance(value, str):
        kind, payload = _GGUF_STRING, _string(value)
    elif isinstance(value, float):
        kind, payload = _GGUF_FLOAT32, struct.pack("<f", value)
    else:
        kind, payload = _GGUF_UINT32, struct.pack("<I", value)
    return _string(key) + struct.pack("<I", kind) + payload


def _tensors() -> list[tuple[str, tuple[int, ...], int, bytes]]:
    """(name, ggml shape, type, data): zero Q8_0 matrices (a zero block is all zero
    bytes) and F32 norms of ones. The values do not matter, only the kernels run."""

    def matrix(name: str, n_in: int, n_out: int) -> tuple[str, tuple[int, ...], int, bytes]:
        size = n_in * n_out // _Q8_0_BLOCK * _Q8_0_BLOCK_BYTES
        return name, (n_in, n_out), _GGML_Q8_0, bytes(size)

    def norm(name: str) -> tuple[str, tuple[int, ...], int, bytes]:
        return name, (N_EMBD,), _GGML_F32, struct.pack(f"<{N_EMBD}f", *[1.0] * N_EMBD)

    return [
        matrix("token_embd.weight", N_EMBD, N_VOCAB),
        norm("output_norm.weight"),
        matrix("output.weight", N_EMBD, N_VOCAB),
        norm("blk.0.attn_norm.weight"),
        *(matrix(f"blk.0.attn_{x}.weight", N_EMBD, N_EMBD) for x in ("q", "k", "v", "output")),
        norm("blk.0.ffn_norm.weight"),
        matrix("blk.0.ffn_gate.weight", N_EMBD, N_FF),
        matrix("blk.0.ffn_up.weight", N_EMBD, N_FF),
        matrix("blk.0.ffn_down.weight", N_FF, N_EMBD),
    ]


def write_probe_model(path: Path) -> Path:
    """A GGUF file (version 3) of a one-layer llama with Q8_0 weights and no tokenizer."""
    metadata = {
        "general.architecture": "llama",
        "llama.context_length": 64,
        "llama.embedding_length": N_EMBD,
        "llama.block_count": 1,
        "llama.feed_forward_length": N_FF,
        "llama.attention.head_count": N_HEAD,
        "llama.attention.head_count_kv": N_HEAD,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": N_VOCAB,  # with no tokenizer, llama.cpp makes this many ids
        "tokenizer.ggml.model": "none",
    }
    tensors = _tensors()
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _metadata(key, value)
    offset = 0
    for name, shape, kind, data in tensors:
        out += _string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, kind, offset)
        offset += -(-len(data) // _ALIGNMENT) * _ALIGNMENT
    for _, _, _, data in tensors:
        out += bytes(-len(out) % _ALIGNMENT) + data
    path.write_bytes(bytes(out))
    return path


def run_probe_model() -> None:
    """The child's work: load the probe model with extra buffer types (the default), on
    the CPU (the quirk is the CPU's), and decode a batch."""
    with tempfile.TemporaryDirectory() as folder:
        init_backend()
        model = Model(write_probe_model(Path(folder) / "probe.gguf"), ModelParams(n_gpu_layers=0))
        context = Context(model, ContextParams(64, machine.physical_cores()))
        context.decode(list(range(1, BATCH + 1)), 0, n_logits=BATCH)
        context.close()
        model.close()


def run_probe(command: Sequence[str] = PROBE_COMMAND) -> Verdict:
    """Run the probe in a child process and say how it ended."""
    try:
        child = subprocess.run(command, capture_output=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"did not finish in {PROBE_TIMEOUT} s")
    if child.returncode == 0:
        return Verdict(True, "passed")
    if child.returncode < 0:  # killed by a signal (POSIX)
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        return Verdict(False, f"died with {name}")
    return Verdict(False, f"exited with code {child.returncode}")


def cached_verdict() -> tuple[Verdict, bool]:
    """The probe's verdict for this CPU and llama.cpp build, from the cache or run now;
    and whether it was run now."""
    cpu = {
        "name": machine.cpu_name(),
        "flags": sorted(machine.cpu_flags()),
        "os": platform.platform(),  # the kernel grants AMX state (Linux 5.16+, or not)
    }
    key = costcache.cache_key([], {"probe": "repack", "cpu": cpu})
    entry = costcache.load_entry("probe", key)
    if entry is not None and isinstance(entry.get("survived"), bool):
        return Verdict(entry["survived"], str(entry.get("detail", ""))), False
    verdict = run_probe()
    costcache.save_entry("probe", key, {"survived": verdict.survived, "detail": verdict.detail})
    return verdict, True


def choose_repack(asked: bool | None) -> tuple[bool, str | None]:
    """Whether to load with extra buffer types (--repack), and a line for the user when
    specdec turns them off itself: said once, when the probe finds out (`specdec info`
    says it after). `asked` is --repack / --no-repack (None: neither)."""
    if asked is not None:
        return asked, None
    if not machine.advertises_amx(machine.cpu_flags(), backend.system_info()):
        return True, None
    result, fresh = cached_verdict()
    if result.survived or not fresh:
        return result.survived, None
    return False, (
        f"llama.cpp's repacked (AMX) kernels crash on this CPU (a test run {result.detail}): "
        "running with --no-repack from now on; pass --repack to force them"
    )


def llama_cpp_flags() -> list[str]:
    """The flag that gives llama.cpp's own tools (llama-server, llama-speculative-simple)
    the repacking specdec chose here: `--no-repack` where the probe found the repacked
    kernels crash, which would kill a tool at its first batch; none elsewhere."""
    repack, _ = choose_repack(None)
    return [] if repack else ["--no-repack"]


if __name__ == "__main__":
    run_probe_model()
