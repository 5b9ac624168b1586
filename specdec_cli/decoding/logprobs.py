"""Log-probabilities of generated tokens, read from the target's own logits.

Every token a generation emits was checked against one row of the target's logits in
the round's verification pass (an accepted draft token against the row of the token
before it, the round's own token against the row it was sampled from). That row is
what the target alone would have computed at that position, whoever drafted the token,
so the numbers here are the target's: read from it once the round is verified, with no
decode of its own.

Two distributions, as llama-server offers them:
- the model's (the default): log_softmax of the raw logits, what vLLM and llama-server
  return;
- the one the token was drawn from (`post_sampling`, llama-server's
  `post_sampling_probs`): after top-k, top-p, min-p and temperature, the distribution
  target-only sampling draws from (sampling.distribution); greedy puts all of it on the
  argmax. A rejection-sampled round draws some tokens from a residual, but the token it
  emits is distributed as this one: the target's is reported, not the residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specdec_cli.decoding.sampling import SamplingParams, distribution, top_k_ids
from specdec_cli.llamacpp.rowexp import exp_sum, scratch_row

# The most alternatives the API lists per token (OpenAI's top_logprobs allows 20).
MAX_TOP = 20


@dataclass(frozen=True)
class LogprobOptions:
    """What a generation reports per token: the top `top` alternatives beside the
    token's own value, from the model's distribution or the post-sampling one."""

    top: int = 0
    post_sampling: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability, and the `top` likeliest tokens at its place
    (id, log-probability), likeliest first, the lower id first among equals."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(
    row: np.ndarray, token: int, options: LogprobOptions, sampling: SamplingParams
) -> TokenLogprob:
    """`token`'s entry of the distribution `options` names at the place whose logits
    are `row` (sampled with `sampling`)."""
    if options.post_sampling:
        return _post_sampling(row, token, options.top, sampling)
    return _model(row, token, options.top)


def _model(row: np.ndarray, token: int, n: int) -> TokenLogprob:
    """log_softmax(row) at `token` and at the top n: one exp pass over the row, into a
    kept buffer (the ggml kernel rowexp uses), and a partition for the top."""
    ids = _best(row, n)
    top = float(row[ids[0]]) if len(ids) else float(row.max())  # the likeliest's: the max
    norm = top + math.log(exp_sum(row, top, scratch_row(len(row))))
    return TokenLogprob(
        token, float(row[token]) - norm, tuple((int(i), float(row[i]) - norm) for i in ids)
    )


def _post_sampling(row: np.ndarray, token: int, n: int, sampling: SamplingParams) -> TokenLogprob:
    """The token's log-probability under what sampling draws from; the top n are only
    tokens that distribution can draw (llama-server leaves out those of probability 0)."""
    if sampling.greedy:  # verification takes np.argmax's choice: the lower id among equals
        best = int(np.argmax(row))
        return TokenLogprob(token, 0.0 if token == best else -math.inf, ((best, 0.0),)[:n])
    dist = distribution(row, sampling)
    p = dist.prob(token)
    drawable = np.flatnonzero(dist.probs > 0)
    at = drawable[_best(dist.probs[drawable], n)]
    top = tuple((int(dist.ids[i]), math.log(float(dist.probs[i]))) for i in at)
    return TokenLogprob(token, math.log(p) if p > 0 else -math.inf, top)


def _best(values: np.ndarray, n: int) -> np.ndarray:
    """The indices of the n largest values, largest first, the lower index first among
    equals. top_k_ids partitions only the few columns that can hold them: at 262k
    entries 0.13 ms, against 2.9 ms for np.argpartition over the whole row (which also
    allocates a row of indices)."""
    n = min(n, len(values))
    if n <= 0:
        return np.empty(0, np.int64)
    ids = top_k_ids(values, n)
    return ids[np.lexsort((ids, -values[ids]))]
