"""Replay MTP-head rounds under other machines' cost curves, from a known-answer model.

The known-answer model (tests/ggufgen.py, write_mtp_known_answer) drafts what its tables
say, in specdec and in llama.cpp alike (tests/test_heads.py checks both against the
tables): so its rounds can be replayed exactly, untimed, at every draft length, and
priced under a cost curve (replay_tree.py's *memory*, *gpu* and *steep*, in one-token
target passes), with a head step at --head of a target pass. Two drivers are priced:
specdec's (k head calls a round: the first catches up on the accepted tokens and drafts
at once; the generation's first token comes with the prompt, undrafted) and llama.cpp's
common/speculative.cpp (a catch-up call over the verified batch, then k draft calls).

    python benchmarks/replay_heads.py [-n 512] [--head 0.05] [--curve memory gpu steep]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the known-answer model and its simulation
sys.path.insert(0, str(REPO / "benchmarks"))
from ggufgen import KnownAnswer, spm_vocab, write_mtp_known_answer  # noqa: E402
from replay_tree import MODEL_CURVES  # noqa: E402
from test_heads import head_drafts  # noqa: E402

from specdec_cli.decoding.costmodel import Costs, verify_cost  # noqa: E402


def rounds(ka: KnownAnswer, prompt: list[int], n: int, k: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round of a greedy generation of n tokens at length k."""
    tokens, out = [*prompt, int(ka.succ[prompt[-1]])], [(0, 0)]  # the first, undrafted
    while len(tokens) - len(prompt) < n:
        draft = head_drafts(ka, tokens, min(k, n - (len(tokens) - len(prompt)) - 1))
        truth = [int(ka.succ[tokens[-1]])]
        while len(truth) <= len(draft):
            truth.append(int(ka.succ[truth[-1]]))
        pairs = zip(draft, truth[:-1], strict=True)
        taken = next((i for i, (d, t) in enumerate(pairs) if d != t), len(draft))
        out.append((len(draft), taken))
        tokens += truth[: taken + 1]
    return out


def priced(played: list[tuple[int, int]], costs: Costs, head: float, extra_call: bool) -> float:
    """Target passes' worth of time for the rounds: each verifies its draft and the last
    token, and pays its head calls (one more a round with `extra_call`)."""
    total = 0.0
    for drafted, _ in played:
        calls = drafted + (1 if extra_call and drafted else 0)
        total += verify_cost(costs.verify, drafted + 1) + calls * head
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=512, help="tokens a generation (512)")
    parser.add_argument("--head", type=float, default=0.05, help="a head step, in target passes")
    parser.add_argument(
        "--curve", nargs="+", choices=list(MODEL_CURVES), default=list(MODEL_CURVES)
    )
    parser.add_argument("--seed", type=int, default=3, help="the known-answer tables' seed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        vocab = spm_vocab()
        ka = write_mtp_known_answer(Path(folder) / "m.gguf", vocab, args.seed)
    prompt = [1, *np.flatnonzero(ka.good)[:4].tolist()]
    print("curve\tk\ttok/pass\tspecdec\tllama.cpp\tratio")
    for name in args.curve:
        costs = MODEL_CURVES[name]
        for k in (1, 2, 3, 4, 5, 6, 8):
            played = rounds(ka, prompt, args.n, k)
            tokens = sum(taken + 1 for _, taken in played)
            ours = tokens / priced(played, costs, args.head, extra_call=False)
            theirs = tokens / priced(played, costs, args.head, extra_call=True)
            passes = tokens / len(played)
            print(f"{name}\t{k}\t{passes:.2f}\t{ours:.3f}x\t{theirs:.3f}x\t{ours / theirs:.3f}")


if __name__ == "__main__":
    main()
