"""Replay draft-length policies on a pair's real acceptance pattern, without timing noise.

Greedy speculative decoding is fully described by two token streams: what the target
generates, and what the draft predicts at each position given the target's text so far
(a round accepts drafts up to the first position where they differ). This script
records both for the built-in prompts, then replays every policy (fixed k and
`AutoLength`) over them, charging each round the measured costs: draft calls (one
more after a round accepted whole), the target's pass over k+1 tokens, and a graph
rebuild when the batch size changes; with --python, the Python work of a round too.
Every policy sees the same text, so differences of a fraction of a percent are real
here, where a timed benchmark drifts by 25 %.

Two modes: "bench" keeps one policy across the prompts and repeats, as `specdec bench`
does; "fresh" starts a new one per prompt, as separate `specdec run`s do.

    python benchmarks/replay_draft_length.py TARGET.gguf [DRAFT.gguf] [-n 128] [-t 2] [--python F]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specdec_cli.commands.bench import BUILTIN_PROMPTS
from specdec_cli.decoding.costmodel import Costs, verify_cost
from specdec_cli.decoding.draft import Draft
from specdec_cli.decoding.draftlength import AutoLength, DraftLength, FixedLength
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = REPO.parent / "shared" / "models" / "stories260K.gguf"
MAX_K = 8


def record_texts(
    engine: Engine, n_predict: int, prompts: dict[str, str] = BUILTIN_PROMPTS
) -> dict[str, tuple[list[int], list[int]]]:
    """Per prompt (by default the built-in ones): its tokens and the target's greedy
    continuation (target-only decoding, up to `n_predict` tokens). Greedy speculative
    decoding writes this same text, so every policy can be replayed on it without the
    target."""
    target_only = engine.make_decoder(None, "1")
    texts = {}
    for name, text in prompts.items():
        prompt = engine.tokenize(text)
        generated: list[int] = []
        rng = np.random.default_rng(0)
        for new in target_only.generate(prompt, n_predict, rng, Stats()):
            generated += new.tokens
        texts[name] = (prompt, generated)
    return texts


def record_matches(engine: Engine, n_predict: int) -> dict[str, np.ndarray]:
    """Per prompt: does the draft's greedy choice equal the target's, position by position."""
    draft = engine.draft_ctx
    matches = {}
    for name, (prompt, generated) in record_texts(engine, n_predict + MAX_K + 1).items():
        sequence = prompt + generated
        draft.rewind(0)
        draft.decode(sequence, 0, n_logits=len(sequence))
        positions = range(len(prompt) - 1, len(sequence) - 1)
        guesses = [int(np.argmax(draft.logits(i))) for i in positions]
        matches[name] = np.array(guesses) == np.array(generated)
    return matches


def round_cost(costs: Costs, calls: int, batch: int, previous_batch: int) -> float:
    """A round's cost in target-token times: its draft calls, the target's pass over
    `batch` tokens, and a graph rebuild if the previous pass had another batch size."""
    switch = costs.switch if batch != previous_batch else 0.0
    return calls * costs.draft_over_target + verify_cost(costs.verify, batch) + switch


def replay(
    policy: DraftLength, match: np.ndarray, n_predict: int, costs: Costs, other: float = 0.0
) -> float:
    """Tokens per target-token-time of one generation under `policy`; `other` is a
    round's time outside llama.cpp (Python's), in target-token times."""
    t = costs.target_seconds
    done, spent, last_k, whole = 0, 0.0, -1, False
    while done < n_predict:
        k = policy.choose(n_predict - done - 1)
        accepted = 0
        while accepted < k and match[done + accepted]:
            accepted += 1
        calls = k + 1 if k and whole else k
        draft_cost = calls * costs.draft_over_target
        cost = round_cost(costs, calls, k + 1, last_k + 1)
        seconds = (draft_cost * t, (cost - draft_cost) * t, other * t)
        policy.observe(Draft(tokens=[0] * k, calls=calls), accepted, *seconds)
        spent += cost + other
        done += accepted + 1
        last_k, whole = k, k > 0 and accepted == k
    return done / spent


def evaluate(
    make: Callable[[], DraftLength],
    matches: dict[str, np.ndarray],
    n_predict: int,
    costs: Costs,
    mode: str,
    repeats: int = 3,
    other: float = 0.0,
) -> dict[str, float]:
    """Median speed per prompt; "bench" keeps one policy throughout (after a warm-up
    on 16 tokens of the first prompt), "fresh" makes one per generation."""
    policy = make()
    if mode == "bench":
        replay(policy, next(iter(matches.values())), 16, costs, other)
    speeds: dict[str, list[float]] = {name: [] for name in matches}
    for _ in range(repeats):
        for name, match in matches.items():
            current = policy if mode == "bench" else make()
            speeds[name].append(replay(current, match, n_predict, costs, other))
    return {name: float(np.median(v)) for name, v in speeds.items()}


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """-n and -t, which every replay takes."""
    parser.add_argument("-n", type=int, default=128, help="tokens per prompt (default 128)")
    parser.add_argument("-t", type=int, default=2, help="threads (default 2)")


def replay_options(
    target: Path, draft: Path | None, threads: int, drafting: DraftOptions
) -> EngineOptions:
    """The engine a replay records with: greedy, a 512-token context."""
    return EngineOptions(
        target=target, draft=draft, n_ctx=512, threads=threads, sampling=GREEDY, drafting=drafting
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path, nargs="?", default=DEFAULT_DRAFT)
    add_replay_arguments(parser)
    parser.add_argument(
        "--python", type=float, default=0.0, metavar="F", help="a round's time outside "
        "llama.cpp, in target-token times (here: about 0.06 on the stories pair, 0.04 on "
        "Qwen2's; default 0)"
    )  # fmt: skip
    args = parser.parse_args()
    options = replay_options(args.target, args.draft, args.t, DraftOptions(k="1"))
    with Engine(options) as engine:
        matches = record_matches(engine, args.n)
        costs = engine.measure_costs(range(1, 18), reps=5, position=16 + args.n // 2)
    print("agreement: " + ", ".join(f"{n} {m[: args.n].mean():.2f}" for n, m in matches.items()))
    print(f"costs: {costs.to_dict()}")
    policies = {f"k={k}": (lambda k=k: FixedLength(k)) for k in range(1, MAX_K + 1)}
    policies["auto"] = lambda: AutoLength(costs, 0, 16, uses_confidence=False)
    for mode in ("bench", "fresh"):
        print(f"\n{mode}: tokens per target-token time (speedup at zero overhead)")
        print("policy\tall\t" + "\t".join(matches))
        for name, make in policies.items():
            if mode == "fresh" and name != "auto" and name != "k=3":
                continue  # a fixed k keeps no state: same as bench
            speed = evaluate(make, matches, args.n, costs, mode, other=args.python)
            overall = len(speed) / sum(1 / s for s in speed.values())  # same tokens per prompt
            print(f"{name}\t{overall:.3f}\t" + "\t".join(f"{s:.2f}" for s in speed.values()))


if __name__ == "__main__":
    main()
