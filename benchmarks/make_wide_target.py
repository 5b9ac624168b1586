"""Build a wide, slow target model whose greedy choices stories260K predicts well.

No large model with a small same-vocabulary companion can be had offline, so this
makes one from the real stories260K.gguf: every trained weight and all metadata are
kept, the feed-forward layers are widened to --ffn units and --extra-layers random
layers are appended. The new units' ffn_down columns and the new layers'
attn_output/ffn_down are scaled by --eps, so the target computes like a ~46M
parameter model but mostly repeats stories260K's predictions; eps sets how often
they differ. The result is quantized to Q8_0 (memory-bound on CPU, like real
models), or to --type. See benchmarks/README.md.

    python benchmarks/make_wide_target.py [stories260K.gguf] [--eps 0.10] [--ffn 8192]
        [--extra-layers 24] [--type q8_0|q4_0|q5_0|f16] [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGUFValue, GGUFValueType

REPO = Path(__file__).resolve().parents[1]
# The random-layer maker and the GGUF writer live with the test-model generator.
sys.path.insert(0, str(REPO / "tests"))
from ggufgen import ffn_weights, llama_block, read_f32_model, write_gguf  # noqa: E402

DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K.gguf"
DEFAULT_OUT = REPO / "benchmarks" / "out" / "wide-target-q8_0.gguf"
DEFAULT_EPS = 0.10
QUANT_BLOCK = 32  # Q8_0, Q5_0 and Q4_0 quantize rows in blocks of 32 values
FILE_TYPES = {
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
}


def widen(
    metadata: dict[str, GGUFValue],
    tensors: dict[str, np.ndarray],
    n_ff: int,
    extra_layers: int,
    eps: float,
    seed: int,
) -> tuple[dict[str, GGUFValue], dict[str, np.ndarray]]:
    """The wide model: trained layers widened to n_ff units, then extra_layers weak ones."""
    n_embd = metadata["llama.embedding_length"].value
    n_layer = metadata["llama.block_count"].value
    n_head = metadata["llama.attention.head_count"].value
    n_head_kv = metadata["llama.attention.head_count_kv"].value
    old_ff = metadata["llama.feed_forward_length"].value
    if n_ff <= old_ff or n_ff % QUANT_BLOCK or n_embd % QUANT_BLOCK:
        sys.exit(f"--ffn must exceed {old_ff} and be a multiple of {QUANT_BLOCK} (quant rows)")

    rng = np.random.default_rng(seed)
    wide = {name: w for name, w in tensors.items() if not name.startswith("blk.")}
    for layer in range(n_layer):
        prefix = f"blk.{layer}."
        wide |= {name: w for name, w in tensors.items() if name.startswith(prefix)}
        # New units: ordinary gate/up, but what they write back is scaled by eps.
        gate, up, down = ffn_weights(rng, n_embd, n_ff - old_ff, eps)
        for part, new, axis in (("gate", gate, 0), ("up", up, 0), ("down", down, 1)):
            name = f"{prefix}ffn_{part}.weight"
            wide[name] = np.concatenate([tensors[name], new], axis=axis)
    for layer in range(n_layer, n_layer + extra_layers):
        wide |= llama_block(rng, layer, n_embd, n_head, n_head_kv, n_ff, out_scale=eps)

    metadata = dict(metadata)
    metadata["llama.block_count"] = GGUFValue(n_layer + extra_layers, GGUFValueType.UINT32)
    metadata["llama.feed_forward_length"] = GGUFValue(n_ff, GGUFValueType.UINT32)
    return metadata, wide


def quantize(source: Path, out: Path, file_type: str) -> None:
    """Quantize with llama.cpp's own quantizer (1-D norm tensors stay F32)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if status != 0:
        sys.exit(f"llama_model_quantize failed on {source} (run with --verbose to see why)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", nargs="?", type=Path, default=DEFAULT_MODEL, help="all-F32 llama GGUF to widen"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="GGUF file to write")
    parser.add_argument("--ffn", type=int, default=8192, help="feed-forward width (default 8192)")
    parser.add_argument("--extra-layers", type=int, default=24, help="layers added (default 24)")
    parser.add_argument(
        "--eps", type=float, default=DEFAULT_EPS, help=f"scale of new outputs ({DEFAULT_EPS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--type", choices=FILE_TYPES, default="q8_0", help="weights' type (default q8_0)"
    )
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's quantizer log")
    args = parser.parse_args()
    if not args.model.is_file():
        sys.exit(f"model not found: {args.model} (see ../shared/models/README.md)")
    if not args.verbose:
        # llama-cpp-python prints llama.cpp's log at this logger's level; keep errors only.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

    start = time.perf_counter()
    metadata, tensors = widen(
        *read_f32_model(args.model), args.ffn, args.extra_layers, args.eps, args.seed
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    f32 = args.out.with_name(args.out.stem + ".f32.gguf")
    try:
        write_gguf(f32, metadata, tensors)
        quantize(f32, args.out, args.type)
    finally:
        f32.unlink(missing_ok=True)  # 180 MB of F32 is only a stepping stone
    n_params = sum(w.size for w in tensors.values())
    print(
        f"wrote {args.out}: {metadata['llama.block_count'].value} layers, "
        f"ffn {args.ffn}, eps {args.eps}, seed {args.seed}, {n_params / 1e6:.1f}M parameters, "
        f"{args.type.upper()}, {args.out.stat().st_size / 1e6:.1f} MB "
        f"in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
