"""Write a tiny MiMo-V2 (`mimo2`) model with several chained MTP heads, whose drafts are
known in advance (see write_chained_known_answer).

MiMo-V2, Step-3.5 and Hunyuan v3 carry several MTP blocks, one a draft step: the first
drafts the token after the text, the second the one after that (reading the first's
state), and so on (llama.cpp picks the block of a call with llama_set_nextn_layer_offset).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValue, GGUFValueType, TokenType
from ggufgen import (
    HParams,
    Vocab,
    _answers,
    _u32,
    ffn_weights,
    llama_metadata,
    random_matrix,
    successor_cycle,
    with_architecture,
    write_gguf,
)

ARCH = "mimo2"
N_HEAD, N_HEAD_KV, HEAD_DIM = 2, 1, 32


@dataclass(frozen=True)
class ChainedKnownAnswer:
    """The tables of write_chained_known_answer: the target's successor of each token,
    and per head the token it drafts after reading a state that stands for token t."""

    succ: np.ndarray  # the target's next token after each token
    answers: np.ndarray  # [head, t]: what head i drafts reading a state of token t

    def drafts(self, text: list[int], k: int) -> list[int]:
        """The chain the heads draft after `text` (greedy, k <= heads): head 0 reads the
        target's state of the token before the last; head i > 0 the state of head i - 1,
        which stands for the token that head read last."""
        read = [text[-2], text[-1]]  # the token each head's state stands for, in turn
        out: list[int] = []
        for head in range(k):
            out.append(int(self.answers[head, read[head]]))
            read.append(out[-1])
        return out


def _keys(n_embd: int, n_layer: int, n_heads: int, n_ff: int) -> dict[str, GGUFValue]:
    f32 = GGUFValueType.FLOAT32
    n_all = n_layer + n_heads
    # The first trunk layer slides (MiMo-V2 mixes both kinds); the rest attend in full.
    pattern = [layer == 0 and n_layer > 1 for layer in range(n_all)]
    return {
        "context_length": _u32(4096),
        "embedding_length": _u32(n_embd),
        "block_count": _u32(n_all),
        "nextn_predict_layers": _u32(n_heads),
        "feed_forward_length": _u32(n_ff),
        "expert_feed_forward_length": _u32(n_ff),
        "attention.head_count": _u32(N_HEAD),
        "attention.head_count_kv": _u32(N_HEAD_KV),
        "attention.key_length": _u32(HEAD_DIM),
        "attention.value_length": _u32(HEAD_DIM),
        "attention.sliding_window": _u32(512),
        "attention.sliding_window_pattern": GGUFValue(
            pattern, GGUFValueType.ARRAY, GGUFValueType.BOOL
        ),
        "attention.layer_norm_rms_epsilon": GGUFValue(1e-6, f32),
        "rope.freq_base": GGUFValue(10000.0, f32),
        "rope.dimension_count": _u32(HEAD_DIM),
    }


def _block(
    rng: np.random.Generator, layer: int, n_embd: int, n_ff: int, out_scale: float
) -> dict[str, np.ndarray]:
    """A layer whose attention (fused q, k, v: what llama.cpp's MTP graph wants) and
    feed-forward network add `out_scale` of a random layer's output."""
    prefix = f"blk.{layer}."
    qkv = N_HEAD * HEAD_DIM + 2 * N_HEAD_KV * HEAD_DIM
    gate, up, down = ffn_weights(rng, n_embd, n_ff, 0.0)
    return {
        prefix + "attn_norm.weight": np.ones(n_embd, np.float32),
        prefix + "attn_qkv.weight": random_matrix(rng, qkv, n_embd),
        prefix + "attn_output.weight": random_matrix(rng, n_embd, N_HEAD * HEAD_DIM, out_scale),
        prefix + "ffn_norm.weight": np.ones(n_embd, np.float32),
        prefix + "ffn_gate.weight": gate,
        prefix + "ffn_up.weight": up,
        prefix + "ffn_down.weight": down,
    }


def write_chained_known_answer(
    path: Path,
    vocab: Vocab,
    seed: int,
    n_heads: int = 3,
    good_fraction: float = 0.75,
    attention_scale: float = 0.005,
    second: float = 0.0,
    temper: float = 0.0,
    n_layer: int = 2,
    n_ff: int = 64,
) -> ChainedKnownAnswer:
    """A MiMo-V2 model with `n_heads` chained MTP blocks, its answers from tables.

    - The trunk: one-hot embeddings (token t in dimension t), blocks that add nothing, an
      output layer that maps t to succ(t), a cycle through the text pieces: greedy, it
      writes the cycle, and its hidden state after a token stands for that token.
    - Each head reads [its token x, a hidden state h]. Its input projection puts x in the
      upper half of its state and in the lower half the token h stands for (the trunk's:
      its lower half; a head's: its upper half, at three times the weight, so that the
      latest token dominates). Its output reads the lower half: head i answers, for a
      good token a (its own table), succ(succ(a)), the right draft; for the rest
      succ(succ(succ(a))). The upper half votes at half weight for succ(succ(x)), a decoy:
      without the right state the decoy wins.
    - Each head's attention reads its own cache (random projections, its output at
      `attention_scale`): too little to change an answer, enough that its logits follow
      what that cache holds, so a head reading another's cache is caught.

    With `second`, a head's answer for a bad token has the right one second (at that
    weight: a tree's second choice). With `temper`, every answer's logit is that much
    over standard normal noise on the text pieces, the target's and the heads': their
    answers spread (for sampling), and the tables no longer hold. `n_layer` and `n_ff`
    make the trunk as costly as a real model's, for benchmarks (each MTP block as wide
    as a layer of it).
    """
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab)
    half = -(-n_vocab // 64) * 64
    n_embd = 2 * half
    succ = successor_cycle(vocab, rng)
    ids = np.arange(n_vocab)
    good = rng.random((n_heads, n_vocab)) < good_fraction
    answers = np.where(good, succ[succ], succ[succ[succ]])
    normal = np.flatnonzero(np.asarray(vocab.types) == TokenType.NORMAL)
    output = np.zeros((n_vocab, n_embd), np.float32)
    output[:, :n_vocab] = _answers(rng, succ, normal, temper, n_embd)
    tensors = {
        "token_embd.weight": np.eye(n_vocab, n_embd, dtype=np.float32),
        "output_norm.weight": np.ones(n_embd, np.float32),
        "output.weight": output,
    }
    for layer in range(n_layer):
        tensors |= _block(rng, layer, n_embd, n_ff, 0.0)
    eh_proj = np.zeros((n_embd, 2 * n_embd), np.float32)
    eh_proj[half + ids, ids] = 1.0  # the token -> upper half
    eh_proj[ids, n_embd + ids] = 1.0  # the trunk's state (lower half) -> lower half
    eh_proj[ids, n_embd + half + ids] = 3.0  # a head's own (upper half) -> lower half
    for head in range(n_heads):
        layer = n_layer + head
        logits = np.zeros((n_vocab, n_embd), np.float32)
        logits[answers[head], ids] += 1.0
        logits[succ[succ], ids] += second * ~good[head]  # the right answer, second
        logits[succ[succ], half + ids] += 0.5
        if temper:  # a state after the head's norm: each of its two tokens at sqrt(n_embd / 2)
            logits *= temper / np.sqrt(n_embd / 2)
            logits[normal] += random_matrix(rng, len(normal), n_embd)
        tensors |= _block(rng, layer, n_embd, n_ff, attention_scale)
        nextn = f"blk.{layer}.nextn."
        tensors |= {
            nextn + "eh_proj.weight": eh_proj,
            nextn + "enorm.weight": np.ones(n_embd, np.float32),
            nextn + "hnorm.weight": np.ones(n_embd, np.float32),
            nextn + "shared_head_head.weight": logits,
            nextn + "shared_head_norm.weight": np.ones(n_embd, np.float32),
        }
    metadata = with_architecture(
        llama_metadata(HParams(), vocab), ARCH, _keys(n_embd, n_layer, n_heads, n_ff)
    )
    write_gguf(path, metadata, tensors)
    return ChainedKnownAnswer(succ, answers)
