"""Replay `-d ngram -k auto` as the decode loop runs it: a length policy per source.

`replay_tree.py` replays one length policy for all of a drafter's rounds. A lookup's
rounds have sources of their own: verbatim repeats, and each length of match (see
NgramDrafter.source_of), each drafting by its own policy, picked by Decoder.who_drafts.
This script replays exactly that on the target's recorded greedy texts (greedy decoding
writes the same text whatever is drafted), and beside it the same lookup with one policy
for every match (verbatim repeats apart), as before matches had sources by length. Both
see the same texts, so a difference of a percent is real here, where the clock drifts
by a third.

A round costs the target's pass over its batch, and a graph rebuild when the batch size
changes. Curves:
  measured  the policies price with the engine's costs, what a run uses (some sizes
            measured, the others interpolated); the rounds are charged at every batch
            size, measured in this run (a CPU's kernels can make an odd batch dearer
            than the next: benchmarks/README.md, "Odd batches pay another pass");
  memory, gpu, steep
            replay_tree.py's modelled machines, pricing and charging alike.

    python benchmarks/replay_lookup.py [--target T.gguf] [-n 64] [--prompts FILE]
        [--curve measured memory gpu steep]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from replay_draft_length import add_replay_arguments, record_texts, replay_options, round_cost  # noqa: E402
from replay_tree import (  # noqa: E402
    DEFAULT_TARGET,
    MAX_K,
    MODEL_CURVES,
    add_curve_arguments,
    describe,
    read_prompts,
)

from specdec_cli.decoding.costmodel import Costs  # noqa: E402
from specdec_cli.decoding.decode import Decoder  # noqa: E402
from specdec_cli.decoding.drafters import Draft, NgramDrafter, propose  # noqa: E402
from specdec_cli.decoding.engine import Engine  # noqa: E402
from specdec_cli.decoding.settings import DraftOptions  # noqa: E402

Texts = dict[str, tuple[list[int], list[int]]]


def one_policy(decoder: Decoder) -> Decoder:
    """The decoder with one length policy for every match of its lookup (its own),
    verbatim repeats apart."""
    assert isinstance(decoder.drafter, NgramDrafter)
    shorter = set(decoder.drafter.shorter_sources())
    lengths = {s: length for s, length in decoder.lengths.items() if s not in shorter}
    return Decoder(
        decoder.target, decoder.drafter, decoder.sampling, decoder.length, lengths=lengths
    )


def replay(
    decoder: Decoder, prompt: list[int], text: list[int], costs: Costs, sources: Counter
) -> float:
    """The cost of generating `text` in rounds as the decoder drafts them (target-token
    times); each round's source, drafted and accepted tokens are added to `sources`."""
    drafter = decoder.drafter
    assert drafter is not None
    drafter.begin(prompt)
    for policy in (decoder.length, *decoder.lengths.values()):
        policy.begin(True)
    rng = np.random.default_rng(0)  # greedy drafting draws nothing; propose wants one
    done, spent, previous = 0, 0.0, -1
    while done < len(text):
        tokens = prompt + text[:done]
        length, source, k = decoder.who_drafts(tokens, len(text) - done - 1)
        draft = propose(drafter, tokens, k, rng, source=source) if k else Draft()
        accepted = 0
        while accepted < len(draft.tokens) and draft.tokens[accepted] == text[done + accepted]:
            accepted += 1
        length.observe(draft, accepted, None, None)  # untimed: it prices with its costs
        batch = len(draft.tokens) + 1
        spent += round_cost(costs, 0, batch, previous)
        previous, done = batch, done + accepted + 1
        sources[source or "none"] += 1
        sources[f"{source or 'none'} drafted"] += len(draft.tokens)
        sources[f"{source or 'none'} accepted"] += accepted
    return spent


def speedup(
    engine: Engine, texts: Texts, pricing: Costs, charged: Costs, one: bool
) -> tuple[float, Counter]:
    """Tokens per target-token time over every text, a fresh decoder each (as a run
    starts each generation's policies afresh)."""
    tokens, spent, sources = 0, 0.0, Counter()
    for prompt, text in texts.values():
        decoder = engine.policy.decoder("ngram", "auto", "off", costs=pricing)
        spent += replay(one_policy(decoder) if one else decoder, prompt, text, charged, sources)
        tokens += len(text)
    return tokens / spent, sources


def acceptance(sources: Counter) -> str:
    """Each source's rounds, and accepted of drafted tokens."""
    names = sorted(s for s in sources if " " not in s)
    return ", ".join(
        f"{s} {sources[s]} rounds, {sources[s + ' accepted']}/{sources[s + ' drafted']}"
        for s in names
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    add_replay_arguments(parser)
    add_curve_arguments(parser)
    args = parser.parse_args()
    prompts = read_prompts(args.prompts)
    drafting = DraftOptions(k="auto", tree="off")
    options = replace(replay_options(args.target, None, args.t, drafting), ngram=True)
    with Engine(options) as engine:
        texts = record_texts(engine, args.n, prompts)
        for curve in args.curve:
            pricing = charged = MODEL_CURVES.get(curve)
            if pricing is None:  # measured: priced as a run prices, charged at every size
                pricing = engine.costs()
                charged = engine.measure_costs(range(1, MAX_K + 2), reps=5)
            assert charged is not None
            before, _ = speedup(engine, texts, pricing, charged, one=True)
            after, sources = speedup(engine, texts, pricing, charged, one=False)
            print(f"{curve}: one policy {before:.3f}x, a policy per length of match {after:.3f}x")
            print(f"  charged: {describe(charged)}")
            print(f"  {acceptance(sources)}")


if __name__ == "__main__":
    main()
