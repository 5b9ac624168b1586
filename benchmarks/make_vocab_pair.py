"""Build a target/draft pair that carries a real tokenizer (152k-262k tokens), offline.

No trained pair with these vocabularies can be had offline, so this makes one from
random weights, shaped so that it behaves like a real pair where it matters for
speed: the draft is a small model (n_embd --draft-embd), the target a much wider and
deeper one (n_embd --target-embd) that computes the draft exactly inside its first
--draft-embd dimensions and adds --eps-scaled contributions from everything else.
So the target costs what a wide model costs (its output matrix alone is vocabulary x
n_embd), while its greedy choices agree with the draft's most of the time; --eps sets
how often they differ. Both are quantized to Q8_0 (memory-bound on a CPU, like real
models). Every `tokenizer.*` key of the vocabulary file is copied, so llama.cpp
tokenizes, detokenizes and ends generations exactly as for the real family.

How the draft sits inside the target (d = draft width, D = target width): the
residual stream's dimensions d..D stay exactly zero in every layer (nothing writes
to them), so RMS norms over D see the draft's values scaled by sqrt(d/D), which the
target's norm weights undo. Heads and feed-forward units that the draft does not
have read the same normalized input, and write to the first d dimensions only,
scaled by eps. See benchmarks/README.md.

    python benchmarks/make_vocab_pair.py ../shared/vocab/ggml-vocab-qwen2.gguf [--eps 0.3]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValue, GGUFValueType, TokenType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from ggufgen import ffn_weights, random_matrix, write_gguf  # noqa: E402
from make_wide_target import quantize  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "out"
HEAD_DIM = 16
GQA = 2  # query heads per key/value head, in both models
LOGIT_SCALE = 4.0  # spread of the logits: clear greedy choices, not one-hot ones


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_ff: int
    n_layer: int

    @property
    def n_head(self) -> int:
        return self.n_embd // HEAD_DIM


def tokenizer_metadata(vocab_file: Path) -> dict[str, GGUFValue]:
    """Every tokenizer.* key of a GGUF file, as the writer takes them."""
    reader = GGUFReader(vocab_file)
    metadata: dict[str, GGUFValue] = {}
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            main_type = field.types[0]
            sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
            metadata[field.name] = GGUFValue(field.contents(), main_type, sub_type)
    if "tokenizer.ggml.tokens" not in metadata:
        sys.exit(f"{vocab_file} has no tokenizer (tokenizer.ggml.tokens)")
    return metadata


def model_metadata(shape: Shape, tokenizer: dict[str, GGUFValue]) -> dict[str, GGUFValue]:
    def u32(value: int) -> GGUFValue:
        return GGUFValue(value, GGUFValueType.UINT32)

    return {
        "general.architecture": GGUFValue("llama", GGUFValueType.STRING),
        "general.name": GGUFValue("specdec-benchmark", GGUFValueType.STRING),
        "general.file_type": u32(0),
        "llama.context_length": u32(4096),
        "llama.embedding_length": u32(shape.n_embd),
        "llama.block_count": u32(shape.n_layer),
        "llama.feed_forward_length": u32(shape.n_ff),
        "llama.attention.head_count": u32(shape.n_head),
        "llama.attention.head_count_kv": u32(shape.n_head // GQA),
        "llama.rope.dimension_count": u32(HEAD_DIM),
        "llama.attention.layer_norm_rms_epsilon": GGUFValue(1e-5, GGUFValueType.FLOAT32),
        **tokenizer,
    }


def draft_tensors(shape: Shape, n_vocab: int, silent: np.ndarray, seed: int) -> dict:
    """A random small llama. Tokens in `silent` (control tokens: EOS, chat markers)
    get zero output rows, so greedy text runs on instead of ending at once."""
    rng = np.random.default_rng(seed)
    output = random_matrix(rng, n_vocab, shape.n_embd, LOGIT_SCALE)
    output[silent] = 0.0
    tensors = {
        "token_embd.weight": rng.standard_normal((n_vocab, shape.n_embd), dtype=np.float32),
        "output_norm.weight": np.ones(shape.n_embd, dtype=np.float32),
        "output.weight": output,
    }
    n_kv = shape.n_head // GQA * HEAD_DIM
    for layer in range(shape.n_layer):
        p = f"blk.{layer}."
        gate, up, down = ffn_weights(rng, shape.n_embd, shape.n_ff)
        tensors |= {
            p + "attn_norm.weight": np.ones(shape.n_embd, dtype=np.float32),
            p + "attn_q.weight": random_matrix(rng, shape.n_embd, shape.n_embd),
            p + "attn_k.weight": random_matrix(rng, n_kv, shape.n_embd),
            p + "attn_v.weight": random_matrix(rng, n_kv, shape.n_embd),
            p + "attn_output.weight": random_matrix(rng, shape.n_embd, shape.n_embd),
            p + "ffn_norm.weight": np.ones(shape.n_embd, dtype=np.float32),
            p + "ffn_gate.weight": gate,
            p + "ffn_up.weight": up,
            p + "ffn_down.weight": down,
        }
    return tensors


def embed(small: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A rows x cols zero matrix with `small` in its top-left corner."""
    out = np.zeros((rows, cols), dtype=np.float32)
    out[: small.shape[0], : small.shape[1]] = small
    return out


def heads_first(small: np.ndarray, small_heads: int, big_heads: int) -> np.ndarray:
    """Q/K/V rows: the draft's heads first (the same query-to-key/value grouping
    maps them onto the draft's key/value heads), then zero rows for the new heads."""
    return embed(small, big_heads * HEAD_DIM, small.shape[1])


def target_tensors(
    draft: dict[str, np.ndarray], d: Shape, t: Shape, eps: float, seed: int
) -> dict[str, np.ndarray]:
    """The target: the draft inside the first d.n_embd dimensions, plus eps-weak rest."""
    rng = np.random.default_rng(seed + 1)
    D, small = t.n_embd, d.n_embd
    norm_fix = np.float32(np.sqrt(small / D))  # RMS over D of a vector zero beyond d

    def norm(name: str) -> np.ndarray:
        out = np.full(D, norm_fix, dtype=np.float32)
        out[:small] *= draft[name]
        return out

    def weak_rows(rows: int, cols: int) -> np.ndarray:
        """Writes into the first d dimensions only, scaled by eps."""
        return embed(random_matrix(rng, small, cols, eps), rows, cols)

    n_vocab = draft["token_embd.weight"].shape[0]
    tensors = {
        "token_embd.weight": embed(draft["token_embd.weight"], n_vocab, D),
        "output_norm.weight": norm("output_norm.weight"),
        "output.weight": embed(draft["output.weight"], n_vocab, D),
    }
    n_kv = t.n_head // GQA * HEAD_DIM
    for layer in range(t.n_layer):
        p = f"blk.{layer}."
        # New heads read from everything (only the first d dimensions are non-zero).
        q = random_matrix(rng, D, D)
        k = random_matrix(rng, n_kv, D)
        v = random_matrix(rng, n_kv, D)
        out = weak_rows(D, D)
        gate, up, _ = ffn_weights(rng, D, t.n_ff)
        down = weak_rows(D, t.n_ff)
        if layer < d.n_layer:  # the draft's layer, inside
            n_q, n_k = d.n_head * HEAD_DIM, d.n_head // GQA * HEAD_DIM
            q[:n_q], k[:n_k], v[:n_k] = (
                embed(draft[p + f"attn_{x}.weight"], rows, D)
                for x, rows in (("q", n_q), ("k", n_k), ("v", n_k))
            )
            out[:small, :n_q] = draft[p + "attn_output.weight"]
            n_ff = d.n_ff
            gate[:n_ff] = embed(draft[p + "ffn_gate.weight"], n_ff, D)
            up[:n_ff] = embed(draft[p + "ffn_up.weight"], n_ff, D)
            down[:small, :n_ff] = draft[p + "ffn_down.weight"]
            attn_norm, ffn_norm = norm(p + "attn_norm.weight"), norm(p + "ffn_norm.weight")
        else:
            attn_norm = ffn_norm = np.full(D, norm_fix, dtype=np.float32)
        tensors |= {
            p + "attn_norm.weight": attn_norm,
            p + "attn_q.weight": q,
            p + "attn_k.weight": k,
            p + "attn_v.weight": v,
            p + "attn_output.weight": out,
            p + "ffn_norm.weight": ffn_norm,
            p + "ffn_gate.weight": gate,
            p + "ffn_up.weight": up,
            p + "ffn_down.weight": down,
        }
    return tensors


def write_q8_0(path: Path, metadata: dict[str, GGUFValue], tensors: dict) -> int:
    """Write F32, quantize to Q8_0 with llama.cpp's quantizer; the parameter count."""
    f32 = path.with_name(path.stem + ".f32.gguf")
    try:
        write_gguf(f32, metadata, tensors)
        quantize(f32, path, "q8_0")
    finally:
        f32.unlink(missing_ok=True)
    return sum(w.size for w in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vocab", type=Path, help="a GGUF file with a tokenizer (../shared/vocab)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write into")
    parser.add_argument("--eps", type=float, default=0.3, help="scale of the target's extra")
    parser.add_argument("--draft-embd", type=int, default=64, help="draft width (64)")
    parser.add_argument("--target-embd", type=int, default=1024, help="target width (1024)")
    parser.add_argument("--target-layers", type=int, default=8, help="target layers (8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    if not args.vocab.is_file():
        sys.exit(f"vocabulary file not found: {args.vocab} (see ../shared/vocab/README.md)")
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

    start = time.perf_counter()
    tokenizer = tokenizer_metadata(args.vocab)
    types = np.asarray(tokenizer["tokenizer.ggml.token_type"].value)
    silent = np.flatnonzero(types == TokenType.CONTROL)
    d = Shape(args.draft_embd, 3 * args.draft_embd, 2)
    t = replace(d, n_embd=args.target_embd, n_ff=3 * args.target_embd, n_layer=args.target_layers)
    draft = draft_tensors(d, len(types), silent, args.seed)
    target = target_tensors(draft, d, t, args.eps, args.seed)
    family = args.vocab.stem.removeprefix("ggml-vocab-")
    args.out.mkdir(parents=True, exist_ok=True)
    for role, shape, tensors in (("target", t, target), ("draft", d, draft)):
        path = args.out / f"{family}-{role}-q8_0.gguf"
        n_params = write_q8_0(path, model_metadata(shape, tokenizer), tensors)
        print(
            f"wrote {path}: {len(types)} tokens, n_embd {shape.n_embd}, {shape.n_layer} layers, "
            f"{n_params / 1e6:.1f}M parameters, {path.stat().st_size / 1e6:.1f} MB"
        )
    print(f"eps {args.eps}, seed {args.seed}, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
