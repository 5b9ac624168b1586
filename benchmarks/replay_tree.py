"""Replay draft trees and chains on a pair's recorded text, charging any cost curve.

Whether a draft tree pays depends on what verifying more tokens costs, and that is the
machine's: on this CPU a wider batch costs nearly proportionally more, on a GPU almost
nothing up to some width. So the design is judged on modelled costs, not timings.

Greedy decoding makes the replay exact. The target's greedy text is recorded once per
built-in prompt (target-only decoding); speculative decoding writes that same text.
Each policy then runs the real draft model (`propose` with the policy's
draft length and tree shape, fed the accepted tokens as the decode loop feeds it), and
each round accepts what greedy tree verification would: the longest root path that
matches the recorded text (the target's argmax after a matching path is the text's
next token), plus the target's own token. A round costs its draft calls, the target's
pass over all its draft tokens plus one, and a graph rebuild when the batch size
changes (`replay_draft_length.round_cost`); target-only decoding costs 1 per token.

Cost curves, in one-token target passes:
  measured  this machine's, for these models (`Engine.costs`: measured once, then
            kept on disk, so reruns give the same figures);
  gpu       verifying 2-16 tokens costs 1.05, each token past 16 another 0.05;
            a draft call 0.05; no rebuild cost;
  memory    verifying n tokens costs 1 + 0.0375 (n - 1) (5 tokens 1.15, a machine whose
            passes are bound by reading the weights); a draft call 0.05; no rebuild;
  steep     verifying n tokens costs 1 + 0.45 (n - 1); a draft call 0.05; no rebuild.
A draft call is charged the same whether it evaluates one tree node or several.

`--draft ngram` replays prompt lookup (`-d ngram`) instead of a draft model.

    python benchmarks/replay_tree.py [--target T.gguf --draft D.gguf|ngram] [-n 128]
        [--curve measured memory gpu steep] [--prompts FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from replay_draft_length import (  # noqa: E402
    DEFAULT_DRAFT,
    add_replay_arguments,
    record_texts,
    replay_options,
    round_cost,
)

from specdec_cli.commands.bench import BUILTIN_PROMPTS  # noqa: E402
from specdec_cli.decoding.costmodel import Costs, verify_cost  # noqa: E402
from specdec_cli.decoding.draft import Draft, Drafter, propose  # noqa: E402
from specdec_cli.decoding.draftlength import DraftLength  # noqa: E402
from specdec_cli.decoding.engine import Engine  # noqa: E402
from specdec_cli.decoding.ngram import NgramDrafter  # noqa: E402
from specdec_cli.decoding.policy import Policy as DecoderPolicy  # noqa: E402
from specdec_cli.decoding.sampling import verify_tree_greedy  # noqa: E402
from specdec_cli.decoding.settings import AUTO_TREE_NODES, DraftOptions  # noqa: E402
from specdec_cli.decoding.treeshape import TreePolicy  # noqa: E402

DEFAULT_TARGET = REPO / "benchmarks" / "out" / "wide-target-q8_0.gguf"
MAX_K = DraftOptions().draft_max  # chains up to -k auto's longest draft (16)
# FixedTree sizes replayed, those larger than k: verification batches of 4, 8, 16, 32
# and 64 tokens (16: all of the gpu curve's flat part)...
TREE_NODES = (3, 7, 15, 31, 63)
TREE_KS = (2, 3, 4, 5, 6, 8, 10)  # ...at these depths, and at the best chain's k
LARGEST_TREE = max(AUTO_TREE_NODES, *TREE_NODES)


def model_curve(verify: Iterable[tuple[int, float]]) -> Costs:
    """A modelled curve: verify costs as given, a draft call 0.05 of a target token,
    no rebuild cost; time in target-token units (target_seconds = 1)."""
    return Costs(target_seconds=1.0, draft_over_target=0.05, verify=dict(verify))


BATCHES = range(1, LARGEST_TREE + 2)
MODEL_CURVES = {
    "gpu": model_curve((n, 1.0 if n == 1 else 1.05 + 0.05 * max(0, n - 16)) for n in BATCHES),
    "memory": model_curve((n, 1.0 + 0.0375 * (n - 1)) for n in BATCHES),
    "steep": model_curve((n, 1.0 + 0.45 * (n - 1)) for n in BATCHES),
}
CURVES = ("measured", *MODEL_CURVES)


@dataclass(frozen=True)
class Round:
    calls: int  # draft model decode calls
    batch: int  # tokens in the target's verification pass
    tokens: int  # tokens the round yields: the accepted path and the target's own


@dataclass(frozen=True)
class Policy:
    k: int | None  # the draft length; None: AutoLength (-k auto)
    tree: int | str | None = None  # FixedTree's nodes, "auto" (AutoTree), None: chains

    @property
    def name(self) -> str:
        return f"k={self.k or 'auto'}" + ("" if self.tree is None else f" tree {self.tree}")

    @property
    def learns_costs(self) -> bool:
        """Whether its rounds depend on the cost curve (it chooses from the costs)."""
        return self.k is None or self.tree == "auto"

    def make(
        self, decoders: DecoderPolicy, kind: str, costs: Costs | None
    ) -> tuple[DraftLength, TreePolicy | None]:
        """Fresh policies, as one `specdec run -k K --tree T` makes them for a drafter of
        `kind` (a translated draft's prior and margin included), priced with `costs`."""
        length = decoders.draft_length(kind, str(self.k or "auto"), costs)
        tree = None if self.tree is None else decoders.tree_policy(str(self.tree), kind, costs)
        return length, tree


def accepted_path(draft: Draft, truth: list[int]) -> list[int]:
    """The nodes greedy verification accepts when the target's text goes on as `truth`:
    the target's argmax at a row is the text's token at that row's depth."""
    parents = draft.parent_list()
    depth = [0]  # by target row: row 0 is the root, row j + 1 follows node j
    for parent in parents:
        depth.append(depth[parent + 1] + 1)
    path, _ = verify_tree_greedy(draft.tokens, parents, lambda row: truth[depth[row]])
    return path


def simulate(
    drafter: Drafter,
    prompt: list[int],
    text: list[int],
    length: DraftLength,
    tree: TreePolicy | None,
) -> list[Round]:
    """The rounds of one generation of `text`, as the decode loop would run them: the
    same choices, the same calls to the drafter, the same observations (untimed). The
    text's end is taken for -n's (where the target stopped on its own, a real run would
    not know it was coming and might draft past it). The first token comes with the
    prompt's call, undrafted (see decode._joining), and the drafter reads the prompt
    after it; that first round is charged as a pass of its own."""
    rounds = [Round(calls=0, batch=1, tokens=1)]
    done = 1
    drafter.begin(prompt)
    rng = np.random.default_rng(0)  # greedy drafting draws nothing; propose wants one
    while done < len(text):
        limit = len(text) - done - 1
        k = length.choose(limit)
        shape = tree.shape(k, limit) if tree and k > 0 else None
        tokens = prompt + text[:done]
        draft = propose(drafter, tokens, k, rng, shape=shape) if k > 0 else Draft()
        path = accepted_path(draft, text[done:])
        length.observe(draft, len(path), None, None, beside=draft.beside_primary(path))
        if tree:
            tree.observe(draft, path)
        rounds.append(Round(draft.calls, len(draft.tokens) + 1, len(path) + 1))
        done += len(path) + 1
    return rounds


def charge(rounds: Iterable[list[Round]], costs: Costs) -> tuple[int, int, float]:
    """Tokens, target passes and cost (target-token times) of some generations."""
    tokens = passes = 0
    cost = 0.0
    for generation in rounds:
        previous = -1
        for r in generation:
            cost += round_cost(costs, r.calls, r.batch, previous)
            tokens, passes, previous = tokens + r.tokens, passes + 1, r.batch
    return tokens, passes, cost


class Replay:
    """Every policy's rounds on the recorded texts, each replayed once: a policy that
    does not read the costs drafts the same under every curve. `decoders` and `kind`
    make the policies as the engine makes them for that drafter."""

    def __init__(
        self,
        drafter: Drafter,
        texts: dict[str, tuple[list[int], list[int]]],
        decoders: DecoderPolicy,
        kind: str,
    ):
        self.drafter, self.texts = drafter, texts
        self.decoders, self.kind = decoders, kind
        self._rounds: dict[tuple[Policy, str], list[list[Round]]] = {}

    def rounds(self, policy: Policy, curve: str, costs: Costs) -> list[list[Round]]:
        key = (policy, curve if policy.learns_costs else "")
        if key not in self._rounds:
            self._rounds[key] = [
                simulate(self.drafter, prompt, text, *policy.make(self.decoders, self.kind, costs))
                for prompt, text in self.texts.values()
            ]
        return self._rounds[key]

    def figures(self, policy: Policy, curve: str, costs: Costs) -> dict[str, float]:
        tokens, passes, cost = charge(self.rounds(policy, curve, costs), costs)
        return {"tokens_per_pass": tokens / passes, "speedup": tokens / cost}


def judge(replay: Replay, curve: str, costs: Costs) -> dict[str, Any]:
    """Every policy's figures under one curve, against the best chain; and the headline:
    the best tree against the best chain, and at that chain's k the fastest tree and the
    most tokens a pass any tree makes."""
    chains = [Policy(k) for k in range(1, MAX_K + 1)]
    figures = {p: replay.figures(p, curve, costs) for p in chains}
    best = max(chains, key=lambda p: figures[p]["speedup"])
    assert best.k is not None
    ks = sorted({*TREE_KS, best.k})
    trees = [Policy(k, n) for k in ks for n in TREE_NODES if n > k]  # else a chain
    trees += [Policy(best.k, "auto"), Policy(None, "auto")]
    for policy in [*trees, Policy(None)]:
        figures[policy] = replay.figures(policy, curve, costs)
    for f in figures.values():
        f["vs_best_chain"] = f["speedup"] / figures[best]["speedup"]
    best_tree = max(trees, key=lambda p: figures[p]["speedup"])
    at_k = [p for p in trees if p.k == best.k]
    fastest_at_k = max(at_k, key=lambda p: figures[p]["speedup"])
    fullest_at_k = max(at_k, key=lambda p: figures[p]["tokens_per_pass"])
    return {
        "costs": costs.to_dict(),
        "policies": {p.name: f for p, f in figures.items()},
        "best_chain": best.name,
        "best_tree": best_tree.name,
        "best_tree_vs_best_chain": figures[best_tree]["vs_best_chain"],
        "best_tree_at_k": fastest_at_k.name,
        "most_tokens_per_pass_at_k": fullest_at_k.name,
        "tokens_per_pass_ratio_at_k": figures[fullest_at_k]["tokens_per_pass"]
        / figures[best]["tokens_per_pass"],
    }


def describe(costs: Costs) -> str:
    """The curve in one line: the draft call, and verification at a few batch sizes."""
    sizes = (2, 3, 4, 5, 9, 16, 17, AUTO_TREE_NODES + 1, LARGEST_TREE + 1)
    verify = ", ".join(f"{n}: {verify_cost(costs.verify, n):.2f}" for n in sizes)
    return f"draft call {costs.draft_over_target:.3f}, verify {verify}, rebuild {costs.switch:.2f}"


def report(curve: str, costs: Costs, result: dict[str, Any]) -> None:
    print(f"\n{curve}: {describe(costs)}")
    print("policy\ttokens/pass\tspeedup\tvs best chain")
    for name, f in result["policies"].items():
        print(f"{name}\t{f['tokens_per_pass']:.2f}\t{f['speedup']:.3f}\t{f['vs_best_chain']:.3f}")
    print(
        f"{curve}: best tree {result['best_tree']} vs best chain {result['best_chain']}: "
        f"{result['best_tree_vs_best_chain']:.3f}x speedup; at {result['best_chain']}, "
        f"fastest {result['best_tree_at_k']}, most tokens/pass "
        f"{result['most_tokens_per_pass_at_k']}: {result['tokens_per_pass_ratio_at_k']:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="a GGUF file, or ngram")
    add_replay_arguments(parser)
    parser.add_argument("--curve", nargs="+", choices=CURVES, default=CURVES)
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--prompts", type=Path, help="one prompt a line (default: built-in)")
    args = parser.parse_args()
    prompts = BUILTIN_PROMPTS
    if args.prompts:
        lines = args.prompts.read_text().splitlines()
        prompts = {f"line {i}": line for i, line in enumerate(lines, 1) if line.strip()}
    # Contexts with room for the largest trees replayed, MAX_K deep.
    drafting = DraftOptions(k=str(MAX_K), tree=str(LARGEST_TREE))
    lookup = args.draft == "ngram"
    draft = None if lookup else Path(args.draft)
    options = replace(replay_options(args.target, draft, args.t, drafting), ngram=lookup)
    with Engine(options) as engine:
        texts = record_texts(engine, args.n, prompts)
        curves = {
            name: engine.costs() if name == "measured" else MODEL_CURVES[name]
            for name in args.curve
        }
        drafter: Drafter = NgramDrafter()
        if not lookup:  # the draft model, translated where its vocabulary is another
            assert engine.draft_ctx is not None
            drafter = engine.policy.model_drafter(engine.draft_ctx)
        replay = Replay(drafter, texts, engine.policy, "ngram" if lookup else "model")
        results = {name: judge(replay, name, costs) for name, costs in curves.items()}
    print(
        f"{args.target.name} + {Path(args.draft).name}: "
        + ", ".join(f"{name} {len(text)} tokens" for name, (_, text) in texts.items())
    )
    for name, result in results.items():
        report(name, curves[name], result)
    if args.json:
        pair = {"target": str(args.target), "draft": str(args.draft), "n": args.n}
        args.json.write_text(json.dumps({**pair, "curves": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
