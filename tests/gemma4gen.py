"""Write a tiny Gemma 4 target and a Gemma 4 assistant drafter for it, whose drafts are
known in advance (see write_assistant_known_answer).

A Gemma 4 assistant ("gemma4-assistant") is a small model that reads, at the position of
the text's last token, that token's embedding (the target's own table), a hidden state,
and through attention the target's own cache (its last sliding-window layer's and its
last full layer's keys and values): it has no cache of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValue, GGUFValueType
from ggufgen import (
    HParams,
    Vocab,
    _u32,
    llama_metadata,
    random_matrix,
    successor_cycle,
    with_architecture,
    write_gguf,
)

TARGET_ARCH, ASSISTANT_ARCH = "gemma4", "gemma4-assistant"


@dataclass(frozen=True)
class Gemma4Shape:
    """What the target and its assistant share: the attention heads' shapes (the assistant
    reads the target's keys and values), and the window."""

    n_head: int = 2
    n_head_kv: int = 1
    head_dim: int = 64
    n_swa: int = 512
    n_ctx_train: int = 2048


def sliding_pattern(n_layer: int) -> list[bool]:
    """Sliding-window layers, then a full one: an assistant reads the last of each kind."""
    return [True] * (n_layer - 1) + [False]


def _keys(shape: Gemma4Shape, n_embd: int, n_layer: int, n_ff: int) -> dict[str, GGUFValue]:
    f32 = GGUFValueType.FLOAT32
    return {
        "context_length": _u32(shape.n_ctx_train),
        "embedding_length": _u32(n_embd),
        "block_count": _u32(n_layer),
        "feed_forward_length": _u32(n_ff),
        "attention.head_count": _u32(shape.n_head),
        "attention.head_count_kv": _u32(shape.n_head_kv),
        "attention.key_length": _u32(shape.head_dim),
        "attention.value_length": _u32(shape.head_dim),
        "attention.key_length_swa": _u32(shape.head_dim),
        "attention.value_length_swa": _u32(shape.head_dim),
        "attention.sliding_window": _u32(shape.n_swa),
        "attention.sliding_window_pattern": GGUFValue(
            sliding_pattern(n_layer), GGUFValueType.ARRAY, GGUFValueType.BOOL
        ),
        "attention.layer_norm_rms_epsilon": GGUFValue(1e-6, f32),
        "rope.freq_base": GGUFValue(10000.0, f32),
        "rope.freq_base_swa": GGUFValue(10000.0, f32),
    }


def _block(
    rng: np.random.Generator,
    layer: int,
    shape: Gemma4Shape,
    n_embd: int,
    n_ff: int,
    with_kv: bool,
    post_scale: float,
) -> dict[str, np.ndarray]:
    """One layer whose attention and feed-forward outputs are normalised to `post_scale`
    (0: the layer adds nothing to what it reads)."""
    p = f"blk.{layer}."
    q_size, kv_size = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim

    def ones(n: int, scale: float = 1.0) -> np.ndarray:
        return np.full(n, scale, dtype=np.float32)

    tensors = {
        p + "attn_norm.weight": ones(n_embd),
        p + "attn_q.weight": random_matrix(rng, q_size, n_embd),
        p + "attn_output.weight": random_matrix(rng, n_embd, q_size),
        p + "attn_q_norm.weight": ones(shape.head_dim),
        p + "post_attention_norm.weight": ones(n_embd, post_scale),
        p + "ffn_norm.weight": ones(n_embd),
        p + "ffn_gate.weight": random_matrix(rng, n_ff, n_embd),
        p + "ffn_up.weight": random_matrix(rng, n_ff, n_embd),
        p + "ffn_down.weight": random_matrix(rng, n_embd, n_ff),
        p + "post_ffw_norm.weight": ones(n_embd, post_scale),
        p + "layer_output_scale.weight": ones(1),
    }
    if with_kv:
        tensors |= {
            p + "attn_k.weight": random_matrix(rng, kv_size, n_embd),
            p + "attn_v.weight": random_matrix(rng, kv_size, n_embd),
            p + "attn_k_norm.weight": ones(shape.head_dim),
        }
    return tensors


@dataclass(frozen=True)
class AssistantKnownAnswer:
    """The tables of a Gemma 4 target and assistant pair (see
    write_assistant_known_answer)."""

    succ: np.ndarray  # the target's next token after each token
    good: np.ndarray  # bool per token: the assistant predicts succ(succ(t)) reading t's state


def write_assistant_known_answer(
    target_path: Path,
    assistant_path: Path,
    vocab: Vocab,
    seed: int,
    good_fraction: float = 0.75,
    second: float = 0.0,
    attention_scale: float = 0.005,
    target_blocks: float = 0.0,
    target_output: float = 1.0,
    assistant_output: float = 1.0,
    n_layer: int = 2,
    n_ff: int = 64,
) -> AssistantKnownAnswer:
    """A Gemma 4 target and assistant whose answers follow from tables.

    - The target: one-hot embeddings (token t in dimension t), blocks that add nothing
      (their outputs normalised to zero), an output layer that maps t to succ(t), a cycle
      through the text pieces: greedy, it writes the cycle, and its hidden state after a
      token stands for that token.
    - The assistant reads [the embedding of its token x_p, a hidden state h]. Its input
      projection puts x_p in the upper half of its state and the token h stands for (the
      target's: x_{p-1}; its own: the token it read last) in the lower half. Its output
      reads the lower half: a good token a votes for succ(succ(a)), the right answer, a
      bad one for succ(succ(succ(a))), and at `second` weight for the right answer (a
      tree's second choice); the upper half votes at half weight for succ(succ(x_p)), a
      decoy. Without the right hidden state the decoy wins. Its own
      hidden state stands for x_p.
    - Its layers read the target's cache (random projections, their outputs normalised
      to `attention_scale`): too little to change an answer, enough that its logits
      follow what the target's cache holds.

    With `target_blocks` the target's layers add that much of a random layer each, and
    with a `target_output` below 1 its output layer is that much weaker: its answers
    spread over many tokens (for sampling), and the tables no longer hold. An
    `assistant_output` below 1 spreads the assistant's the same way. `n_layer` and `n_ff`
    make the target as costly as a real model's, for benchmarks (the assistant keeps two
    small layers).
    """
    rng = np.random.default_rng(seed)
    shape = Gemma4Shape()
    n_vocab = len(vocab)
    half = -(-n_vocab // 64) * 64
    n_target, n_assistant = half, 2 * half  # llama.cpp wants the two widths to differ
    succ = successor_cycle(vocab, rng)
    good = rng.random(n_vocab) < good_fraction
    ids = np.arange(n_vocab)

    output = np.zeros((n_vocab, n_target), np.float32)
    output[succ, ids] = target_output
    target = {
        "token_embd.weight": np.eye(n_vocab, n_target, dtype=np.float32),
        "output_norm.weight": np.ones(n_target, dtype=np.float32),
        "output.weight": output,
        "rope_freqs.weight": np.ones(shape.head_dim // 2, dtype=np.float32),
    }
    for layer in range(n_layer):
        target |= _block(rng, layer, shape, n_target, n_ff, True, target_blocks)
    metadata = llama_metadata(HParams(), vocab)
    keys = _keys(shape, n_target, n_layer, n_ff) | {
        "embedding_length_per_layer_input": _u32(0),
    }
    write_gguf(target_path, with_architecture(metadata, TARGET_ARCH, keys), target)

    # Both inputs arrive at sqrt(n_target) in one dimension (the embedding is scaled by
    # it, the hidden state normalised to it): brought to 1.
    unit = 1.0 / np.sqrt(n_target)
    pre = np.zeros((n_assistant, 2 * n_target), np.float32)
    pre[half + ids, ids] = unit  # the token -> upper half
    pre[ids, n_target + ids] = unit  # the hidden state -> lower half
    head = np.zeros((n_vocab, n_assistant), np.float32)  # its output (token_embd, tied)
    answer = np.where(good, succ[succ], succ[succ[succ]])
    head[answer, ids] += 1.0
    head[succ[succ[ids[~good]]], ids[~good]] += second
    head[succ[succ], half + ids] += 0.5
    # Its own state: the upper half (normalised to sqrt(n_assistant / 2)) back to one
    # dimension at sqrt(n_target), as the target's state.
    post = np.zeros((n_target, n_assistant), np.float32)
    post[ids, half + ids] = np.sqrt(n_target / (n_assistant / 2))
    assistant = {
        "token_embd.weight": head * assistant_output,
        "output_norm.weight": np.ones(n_assistant, dtype=np.float32),
        "nextn.pre_projection.weight": pre,
        "nextn.post_projection.weight": post,
        "rope_freqs.weight": np.ones(shape.head_dim // 2, dtype=np.float32),
    }
    n_small = 2  # a sliding-window layer and a full one
    for layer in range(n_small):
        assistant |= _block(rng, layer, shape, n_assistant, 64, False, attention_scale)
    keys = _keys(shape, n_assistant, n_small, 64) | {
        "embedding_length_out": _u32(n_target),
        "nextn_predict_layers": _u32(n_small),
    }
    write_gguf(assistant_path, with_architecture(metadata, ASSISTANT_ARCH, keys), assistant)
    return AssistantKnownAnswer(succ, good)
