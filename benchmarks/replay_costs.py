"""Generations run here, priced and decided with another machine's costs.

`specdec bench --json` records the costs it measured (one target token, a draft call,
the verification curve, a change of batch size). This script loads the models here,
makes -k auto plan with those costs instead of its own, and stops it from following
this machine's clock (every round is priced as modelled), so it chooses what it would
have chosen there: greedy text is the same whatever it chooses, and a sampled round
never follows the clock anyway (`--temp`: the same seed there draws the same text as
here, the models' numerics aside). It then prices every
decode call of each generation with those costs: the target's calls by the curve, a
draft call at its price whatever its size, and a rebuild whenever a context's batch
size changes. Time outside llama.cpp is left out. Per prompt: the modelled tok/s of
the target alone and of the drafted runs (one decoder each, kept across the prompts
and repeats, as `specdec bench` does), their ratio, and the rounds that drafted.

What a GPU spent on one bench (benchmarks/README.md, "On a GPU: Gemma 3 270M") can so
be weighed against the code since, on a machine without one:

    python benchmarks/replay_costs.py GPU_BENCH.json TARGET.gguf DRAFT.gguf \\
        [--prompts benchmarks/stories.txt] [-k auto] [-n 128] [--repeat 2] [--temp 0.8]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specdec_cli.decoding import decode, draftlength
from specdec_cli.decoding.costmodel import Costs, verify_cost
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.decodecall import SharedCall

Call = tuple[str, int]  # a decode call: the context's model file name, its tokens


def record_calls(log: list[Call]) -> None:
    """Every decode call of every context, appended to `log`."""
    flush = SharedCall.flush

    def logged(self: SharedCall, name: str) -> int:
        if self.n_staged:
            log.append((name, self.n_staged))
        return flush(self, name)

    SharedCall.flush = logged  # type: ignore[method-assign]


def record_choices(chosen: list[int]) -> None:
    """Every length -k auto chooses, appended to `chosen`."""
    choose = draftlength.AutoLength.choose

    def logged(self: draftlength.AutoLength, limit: int) -> int:
        k = choose(self, limit)
        chosen.append(k)
        return k

    draftlength.AutoLength.choose = logged  # type: ignore[method-assign]


def plan_with(costs: Costs) -> None:
    """-k auto plans with `costs` and never follows this machine's clock."""
    Engine.costs = lambda self: costs  # type: ignore[method-assign]
    conclude = decode.Generation.conclude
    decode.Generation.conclude = lambda self, timed: conclude(self, False)  # type: ignore[method-assign]


def priced(calls: Sequence[Call], costs: Costs, target: str) -> float:
    """Seconds the calls take at `costs`: a rebuild (costs.switch target passes, or as
    many draft calls) whenever a context's batch size changes."""
    t, total, last = costs.target_seconds, 0.0, {}
    for name, n in calls:
        one = 1.0 if name == target else costs.draft_over_target
        total += (verify_cost(costs.verify, n) if name == target else one) * t
        if last.get(name, n) != n:
            total += costs.switch * one * t
        last[name] = n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("costs", type=Path, help="a `specdec bench --json` file")
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("-k", default="auto")
    parser.add_argument("--prompts", type=Path, default=Path(__file__).with_name("stories.txt"))
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--temp", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="the first repeat's (sampling)")
    args = parser.parse_args()

    costs = Costs.from_dict(json.loads(args.costs.read_text())["cost"])
    plan_with(costs)
    calls: list[Call] = []
    chosen: list[int] = []
    record_calls(calls)
    record_choices(chosen)
    sampling = SamplingParams(temp=args.temp)  # greedy at 0
    options = EngineOptions(target=args.target, draft=args.draft, ngram=False, sampling=sampling)
    engine = Engine(options)
    prompts = [line.rstrip("\n") for line in args.prompts.open() if line.strip()]
    decoders = {
        "target": engine.make_decoder(None, "1"),
        "drafted": engine.make_decoder("model", args.k),
    }
    rates: dict[tuple[int, str], list[float]] = {}
    for repeat in range(args.repeat):
        for i, text in enumerate(prompts):
            prompt = engine.tokenize(text)
            for name, decoder in decoders.items():
                calls.clear()
                n = sum(
                    len(r.tokens)
                    for r in decoder.generate(
                        prompt, args.n, np.random.default_rng(args.seed + repeat), Stats()
                    )
                )
                # the prompt's pass is the same for both: left out
                rates.setdefault((i, name), []).append(
                    n / priced(calls[1:], costs, args.target.name)
                )
    ratios = []
    for i in range(len(prompts)):
        alone, drafted = (statistics.median(rates[(i, name)]) for name in decoders)
        ratios.append(drafted / alone)
        print(
            f"prompt {i + 1}: target alone {alone:.0f} tok/s, -k {args.k} {drafted:.0f} tok/s,"
            f" {drafted / alone:.3f}x"
        )
    drafted_rounds = sum(k > 0 for k in chosen)
    print(
        f"median {statistics.median(ratios):.3f}x, lowest {min(ratios):.3f}x;"
        f" rounds that drafted: {drafted_rounds} of {len(chosen)}"
    )


if __name__ == "__main__":
    main()
