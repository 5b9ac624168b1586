"""Python cost of sampling one row of logits at real vocabulary sizes, per sampler setting.

For each vocabulary size and setting, over many rows shaped like a trained model's (a
long normal tail and a few strong tokens; `--spread` for a random-weight model's plain
normal row), the median microseconds of:

- build: `distribution` of one row (what the target pays per verified row, and the
  draft per drafted token);
- sample: drawing one token from it;
- verify: one speculative check against a draft distribution of a nearby row, p(x) and
  q(x) for the drafted token, then the residual built and sampled (what a rejection costs).

No model is needed. Time it on a quiet machine: anything else running makes it meaningless.

    python benchmarks/sampling_cost.py [--rows 300] [--vocab 151936 262144] [--spread 0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from specdec_cli.decoding.sampling import SamplingParams, distribution, residual

SETTINGS = {
    "greedy (argmax)": SamplingParams(temp=0.0),
    "defaults": SamplingParams(),
    "--top-k 0": SamplingParams(top_k=0),
    "--top-k 0 --top-p 1 --min-p 0": SamplingParams(top_k=0, top_p=1.0, min_p=0.0),
    "--top-p 0.8 --top-k 20": SamplingParams(top_p=0.8, top_k=20),
    "--min-p 0.1": SamplingParams(min_p=0.1),
}
N_DISTINCT = 32  # distinct rows, cycled: generating 262k normals costs more than sampling


def rows(n_vocab: int, spread: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Rows of float32 logits (what llama.cpp hands over)."""
    out = []
    for _ in range(N_DISTINCT):
        if spread > 0:
            row = rng.normal(0, spread, n_vocab)
        else:
            row = rng.normal(0, 2.5, n_vocab)
            row[rng.choice(n_vocab, 8, replace=False)] = row.max() + rng.uniform(-1, 5, 8)
        out.append(row.astype(np.float32))
    return out


def median_us(step: Callable[[int], object], n_rows: int) -> float:
    times = []
    for i in range(n_rows):
        start = time.perf_counter_ns()
        step(i)
        times.append(time.perf_counter_ns() - start)
    return float(np.median(times)) / 1e3


def measure(
    params: SamplingParams, target: list[np.ndarray], draft: list[np.ndarray], n_rows: int
) -> tuple[float, float, float]:
    """Median microseconds of (build, sample, verify); greedy's build is its argmax."""
    rng = np.random.default_rng(0)
    n = len(target)
    if params.greedy:
        return median_us(lambda i: int(np.argmax(target[i % n])), n_rows), 0.0, 0.0
    build = median_us(lambda i: distribution(target[i % n], params), n_rows)
    p_rows = [distribution(row, params) for row in target]
    q_rows = [distribution(row, params) for row in draft]
    sample = median_us(lambda i: p_rows[i % n].sample(rng), n_rows)

    def verify(i: int) -> None:
        """A drafted token checked and, whatever the test says, rejected: the worst case."""
        p, q = p_rows[i % n], q_rows[i % n]
        x = q.sample(rng)
        _ = rng.random() * q.prob(x) < p.prob(x)
        residual(p, q).sample(rng)

    return build, sample, median_us(verify, n_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300, help="timed rows per figure")
    parser.add_argument("--vocab", type=int, nargs="+", default=[151_936, 262_144])
    parser.add_argument(
        "--spread", type=float, default=0.0, help="plain normal rows of this spread (4: random)"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    for n_vocab in args.vocab:
        target = rows(n_vocab, args.spread, rng)
        # The draft sees nearly the same row: a good draft, as speculation needs.
        draft = [row + rng.normal(0, 0.5, n_vocab).astype(np.float32) for row in target]
        print(f"\nvocabulary {n_vocab}, median microseconds per row over {args.rows} rows")
        print(f"{'setting':32} {'build':>8} {'sample':>8} {'verify':>8}")
        for name, params in SETTINGS.items():
            build, sample, verify = measure(params, target, draft, args.rows)
            print(f"{name:32} {build:8.0f} {sample:8.0f} {verify:8.0f}")


if __name__ == "__main__":
    main()
