"""Replay MTP-head rounds under other machines' cost curves, from a known-answer model.

The known-answer models (tests/ggufgen.py, write_mtp_known_answer; with --blocks N,
tests/mimo2gen.py, write_chained_known_answer) draft what their tables say, in specdec
and in llama.cpp alike (tests/test_heads.py and test_chained_heads.py check both against
the tables): so their rounds can be replayed exactly, untimed, at every draft length,
and priced under a cost curve (replay_tree.py's *memory*, *gpu* and *steep*, in
one-token target passes), with a head step at --head of a target pass. Two drivers are
priced: specdec's (k head calls a round: the first catches up on the accepted tokens and
drafts at once; chained blocks a call each, drafting or catching up; the generation's
first token comes with the prompt, undrafted) and llama.cpp's common/speculative.cpp (a
catch-up call over the verified batch, one a block, then k draft calls).

    python benchmarks/replay_heads.py [-n 512] [--head 0.05] [--curve memory gpu steep]
        [--blocks 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the known-answer model and its simulation
sys.path.insert(0, str(REPO / "benchmarks"))
from ggufgen import FIRST_PIECE_ID, spm_vocab, write_mtp_known_answer  # noqa: E402
from mimo2gen import write_chained_known_answer  # noqa: E402
from replay_tree import MODEL_CURVES  # noqa: E402
from test_heads import head_drafts  # noqa: E402

from specdec_cli.decoding.costmodel import Costs, verify_cost  # noqa: E402

Drafts = Callable[[list[int], int], list[int]]  # the head's chain after tokens, k long


def rounds(
    succ: np.ndarray, drafts: Drafts, prompt: list[int], n: int, k: int
) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round of a greedy generation of n tokens at length k."""
    tokens, out = [*prompt, int(succ[prompt[-1]])], [(0, 0)]  # the first, undrafted
    while len(tokens) - len(prompt) < n:
        draft = drafts(tokens, min(k, n - (len(tokens) - len(prompt)) - 1))
        truth = [int(succ[tokens[-1]])]
        while len(truth) <= len(draft):
            truth.append(int(succ[truth[-1]]))
        pairs = zip(draft, truth[:-1], strict=True)
        taken = next((i for i, (d, t) in enumerate(pairs) if d != t), len(draft))
        out.append((len(draft), taken))
        tokens += truth[: taken + 1]
    return out


def priced(
    played: list[tuple[int, int]], costs: Costs, head: float, calls: Callable[[int], int]
) -> float:
    """Target passes' worth of time for the rounds: each verifies its draft and the last
    token, and pays its head calls (`calls` of the tokens it drafted)."""
    total = 0.0
    for drafted, _ in played:
        paid = calls(drafted) if drafted else 0
        total += verify_cost(costs.verify, drafted + 1) + paid * head
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=512, help="tokens a generation (512)")
    parser.add_argument("--head", type=float, default=0.05, help="a head step, in target passes")
    parser.add_argument(
        "--curve", nargs="+", choices=list(MODEL_CURVES), default=list(MODEL_CURVES)
    )
    parser.add_argument("--seed", type=int, default=3, help="the known-answer tables' seed")
    parser.add_argument("--blocks", type=int, default=1, help="chained MTP blocks (1: one)")
    args = parser.parse_args()
    blocks = args.blocks
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        if blocks > 1:
            chained = write_chained_known_answer(path, spm_vocab(), args.seed, n_heads=blocks)
            succ, drafts, lengths = chained.succ, chained.drafts, range(1, blocks + 1)
            prompt = list(range(FIRST_PIECE_ID, FIRST_PIECE_ID + 5))
        else:
            ka = write_mtp_known_answer(path, spm_vocab(), args.seed)
            succ, drafts, lengths = ka.succ, partial(head_drafts, ka), (1, 2, 3, 4, 5, 6, 8)
            prompt = [1, *np.flatnonzero(ka.good)[:4].tolist()]
    # specdec: a call a draft token (the first catches up), or a call a block; llama.cpp:
    # a catch-up call a block, then a call a draft token.
    ours_calls = (lambda drafted: blocks) if blocks > 1 else (lambda drafted: drafted)
    theirs_calls = lambda drafted: blocks + drafted  # noqa: E731
    print("curve\tk\ttok/pass\tspecdec\tllama.cpp\tratio")
    for name in args.curve:
        costs = MODEL_CURVES[name]
        for k in lengths:
            played = rounds(succ, drafts, prompt, args.n, k)
            tokens = sum(taken + 1 for _, taken in played)
            ours = tokens / priced(played, costs, args.head, ours_calls)
            theirs = tokens / priced(played, costs, args.head, theirs_calls)
            passes = tokens / len(played)
            print(f"{name}\t{k}\t{passes:.2f}\t{ours:.3f}x\t{theirs:.3f}x\t{ours / theirs:.3f}")


if __name__ == "__main__":
    main()
