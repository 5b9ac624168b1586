"""Replay -k auto for the n-gram lookup (`-d ngram`) on real prompts, without timing noise.

Greedy decoding with the lookup is described by the target's text alone: at each position
the lookup's guess (what followed the latest earlier occurrence of the longest n-gram that
ends the text, or a verbatim repeat's loop) and how much of it the text then takes. This
script records both for a question file's first turns (Spec-Bench's by default), then
replays draft-length policies over them, charging each round what the measured costs say:
the target's pass over k+1 tokens, a graph rebuild when the batch size changes, and a
round's time outside llama.cpp (`--python`). The lookup drafts for free. Policies: the
target alone, fixed k, and -k auto as the decoder runs it (the lookup's policy, and the
verbatim source's own), kept across the questions as `specdec bench` and `serve` keep
their decoders. Every policy sees the same text: differences of a fraction of a percent are real
here, where a timed benchmark drifts by a quarter.

    python benchmarks/replay_lookup.py -m CHAT.gguf [--suite spec-bench --per-category 2]
        [--prompts FILE.jsonl] [-n 128] [--costs BENCH.json] [--python MS] [-t 2]

`--costs` takes the "cost" of a `specdec bench --json` file (measured on a quiet machine);
without it the costs are measured here, which means nothing on a busy one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec_cli.commands.workload import (
    Workload,
    first_per_category,
    read_workload,
    suite_workload,
)
from specdec_cli.decoding.costmodel import Costs, verify_cost
from specdec_cli.decoding.draft import Draft
from specdec_cli.decoding.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.ngram import NgramDrafter
from specdec_cli.decoding.policy import LOOKUP_PRIOR, VERBATIM_PRIOR
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.models.chat import ChatFormat, Message

MAX_K = 16  # the longest guess recorded: past -k auto's --draft-max


@dataclass(frozen=True)
class Position:
    """At one position of the text: for each of the lookup's sources, in its order, the
    guess's length (0: nothing to offer) and how much of it the text takes."""

    offers: tuple[tuple[str, int, int], ...]  # (source, guessed, taken)
    matched: int = 0  # the length of the n-gram the guess follows (0: none)


@dataclass(frozen=True)
class Trace:
    category: str
    positions: tuple[Position, ...]


def record(engine: Engine, workload: Workload, n_predict: int) -> list[Trace]:
    """Each question's first turn: the target's greedy text, and the lookup at each
    position of it."""
    target_only = engine.make_decoder(None, "1")
    traces = []
    for question in workload.questions:
        prompt = engine.tokenize_messages([Message("user", question.turns[0])], workload.chat)
        generated: list[int] = []
        for new in target_only.generate(prompt, n_predict, np.random.default_rng(0), Stats()):
            generated += new.tokens
        lookup = NgramDrafter(n_min=1)  # every match: a replay leaves out the short ones
        lookup.begin(prompt)
        positions = []
        for p in range(len(generated)):
            tokens = prompt + generated[:p]
            match, offers = lookup.matches(tokens), []
            for source in lookup.sources(tokens):
                guess = lookup.continuation(match, MAX_K, None, source).tokens
                taken = 0
                while taken < len(guess) and p + taken < len(generated):
                    if guess[taken] != generated[p + taken]:
                        break
                    taken += 1
                offers.append((source, len(guess), taken))
            positions.append(Position(tuple(offers), _ngram_length(lookup, tokens)))
        traces.append(Trace(question.category or question.name, tuple(positions)))
    return traces


def save_traces(path: Path, traces: list[Trace]) -> None:
    data = [[t.category, [[p.offers, p.matched] for p in t.positions]] for t in traces]
    path.write_text(json.dumps(data))


def load_traces(path: Path) -> list[Trace]:
    return [
        Trace(category, tuple(Position(tuple(map(tuple, o)), n) for o, n in positions))
        for category, positions in json.loads(path.read_text())
    ]


def _ngram_length(lookup: NgramDrafter, tokens: list[int]) -> int:
    """How long an n-gram ending `tokens` the lookup found (its longest first)."""
    for n in range(min(lookup.n_max, len(tokens) - 1), lookup.n_min - 1, -1):
        if tuple(tokens[-n:]) in lookup._ends:
            return n
    return 0


@dataclass
class Replayed:
    tokens: int = 0
    passes: int = 0
    cost: float = 0.0  # in target-token times


class Decoding:
    """One policy per source, as decode.Decoder runs them: the first source whose policy
    drafts takes the round; if none does, the round is the first one's, undrafted."""

    def __init__(self, lengths: dict[str, DraftLength], costs: Costs, python: float) -> None:
        self.lengths, self.costs, self.python = lengths, costs, python
        self.last_batch = 1

    def generation(self, trace: Trace) -> Replayed:
        out, positions = Replayed(), trace.positions
        for length in self.lengths.values():
            length.begin(invariant=True)
        p = 0
        while p < len(positions):
            limit = len(positions) - p - 1
            offers = positions[p].offers
            chosen, k = None, 0
            for source, _, _ in offers:
                length = self.lengths.get(source, self.lengths["ngram"])
                k = length.choose(limit)
                if k > 0:
                    chosen = (length, source)
                    break
            if chosen is None:
                length, source = self.lengths.get(offers[0][0], self.lengths["ngram"]), None
            else:
                length, source = chosen
            guessed, taken = next(((g, t) for s, g, t in offers if s == source), (0, 0))
            drafted, accepted = min(k, guessed), min(k, taken)
            batch = drafted + 1
            verify = verify_cost(self.costs.verify, batch)
            if batch != self.last_batch:
                verify += self.costs.switch
            self.last_batch = batch
            t = self.costs.target_seconds
            length.observe(Draft(tokens=[0] * drafted), accepted, 0.0, verify * t, self.python * t)
            out.tokens += accepted + 1
            out.passes += 1
            out.cost += verify + self.python
            p += accepted + 1
        return out


def policies(costs: Costs) -> dict[str, Callable[[], dict[str, DraftLength]]]:
    """Each policy's source -> length policy."""
    made: dict[str, Callable[[], dict[str, DraftLength]]] = {
        "target alone": lambda: {"ngram": FixedLength(0)},
    }
    for k in (1, 2, 3, 4, 8):
        made[f"k={k}"] = lambda k=k: {"ngram": FixedLength(k)}

    def auto() -> dict[str, DraftLength]:
        return {
            "ngram": AutoLength(costs, 0, 16, uses_confidence=False, prior=LOOKUP_PRIOR),
            NgramDrafter.VERBATIM_SOURCE: AutoLength(
                costs, 0, 16, uses_confidence=False, prior=VERBATIM_PRIOR
            ),
        }

    made["auto"] = auto
    return made


def replay(
    traces: list[Trace], costs: Costs, python: float, n_min: int = DraftOptions.ngram_min
) -> dict[str, dict[str, float]]:
    """Per policy, per category: tokens per target-token time, over the category's
    questions together. Each policy is kept across all the questions, in their order, as
    bench and serve keep a decoder; the lookup looks up n-grams of `n_min` tokens or
    more (the traces hold every match: one shorter is no match)."""
    speeds: dict[str, dict[str, float]] = {}
    for name, make in policies(costs).items():
        decoding = Decoding(make(), costs, python)
        totals: dict[str, Replayed] = {}
        for trace in traces:
            run = decoding.generation(from_n_grams_of(trace, n_min))
            total = totals.setdefault(trace.category, Replayed())
            total.tokens, total.cost = total.tokens + run.tokens, total.cost + run.cost
        speeds[name] = {category: t.tokens / t.cost for category, t in totals.items()}
    return speeds


def from_n_grams_of(trace: Trace, n_min: int) -> Trace:
    """The trace as a lookup of n-grams from `n_min` tokens long sees it: no guess where
    only a shorter one matched."""

    def offer(position: Position, offer: tuple[str, int, int]) -> tuple[str, int, int]:
        source = offer[0]
        short = source == NgramDrafter.name and position.matched < n_min
        return (source, 0, 0) if short else offer

    return Trace(
        trace.category,
        tuple(Position(tuple(offer(p, o) for o in p.offers), p.matched) for p in trace.positions),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, help="a Spec-Bench/MT-Bench question file")
    parser.add_argument("--suite", default="spec-bench")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--chat-template", help="a built-in chat format, for a base model")
    parser.add_argument("-n", type=int, default=128, help="tokens per question (default 128)")
    parser.add_argument("-t", type=int, default=2, help="threads (default 2)")
    parser.add_argument(
        "--ngram-min", type=int, default=DraftOptions.ngram_min,
        help=f"the lookup's shortest n-gram (default {DraftOptions.ngram_min})",
    )  # fmt: skip
    parser.add_argument("--costs", type=Path, help="a specdec bench --json file")
    parser.add_argument(
        "--traces", type=Path, help="read the recorded texts from this file, or record and "
        "write them there where it does not exist",
    )  # fmt: skip
    parser.add_argument(
        "--python", type=float, default=0.0, metavar="F",
        help="a round's time outside llama.cpp, in target-token times (default 0)",
    )  # fmt: skip
    args = parser.parse_args()
    workload = read_workload(args.prompts) if args.prompts else suite_workload(args.suite)
    workload = first_per_category(workload, args.per_category)
    chat = ChatFormat(template=args.chat_template) if args.chat_template else ChatFormat()
    workload = Workload(workload.questions, workload.source, chat)
    options = EngineOptions(
        target=args.model, n_ctx=4096, threads=args.t, sampling=GREEDY, flash_attn="off",
        drafting=DraftOptions(k="1"),
    )  # fmt: skip
    if args.traces and args.traces.exists():
        traces = load_traces(args.traces)
    else:
        with Engine(options) as engine:
            traces = record(engine, workload, args.n)
        if args.traces:
            save_traces(args.traces, traces)
    if args.costs:
        costs = Costs.from_dict(json.loads(args.costs.read_text())["cost"])
    else:
        with Engine(options) as engine:
            costs = engine.measure_costs(range(1, MAX_K + 2), reps=5, position=512)
    print(f"costs: {costs.to_dict()}")
    speeds = replay(traces, costs, args.python, args.ngram_min)
    base = speeds["target alone"]
    categories = list(base)
    print("speedup over the target alone (modelled)")
    print("policy\tall\t" + "\t".join(categories))
    for name, by_category in speeds.items():
        ratios = [by_category[c] / base[c] for c in categories]
        print(f"{name}\t{statistics.geometric_mean(ratios):.3f}\t" + "\t".join(
            f"{r:.3f}" for r in ratios
        ))  # fmt: skip


if __name__ == "__main__":
    main()
