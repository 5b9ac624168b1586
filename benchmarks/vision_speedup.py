"""Speculation's speedup on the text after an image, against after text alone, and the
image's encode time apart from decoding (issue 63's benchmark).

The same question is asked with the images and without them, each by the target alone and
speculating (the drafter of -d, fed the text alone), the four runs in turns that alternate
their order from repeat to repeat; each run's tokens per second count generation only (the
prompt, image included, is read before the clock starts). The encoder's time is measured
on its own, every image encoded afresh each repeat. Medians over the repeats; a speedup is
the median of each repeat's ratio, with its range.

    python benchmarks/vision_speedup.py -m TARGET --mmproj MMPROJ -d DRAFT \\
        --image pic.png [--image ...] [-p "Describe the picture in detail."] \\
        [-n 128] [--repeat 5] [-t 2] [-k auto]

Run it alone on the machine: anything else running makes the figures meaningless.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdec_cli.decoding.decode import Decoder
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.multimodal import MediaPrompt
from specdec_cli.decoding.sampling import GREEDY
from specdec_cli.decoding.settings import DraftOptions, EngineOptions
from specdec_cli.decoding.stats import Stats
from specdec_cli.llamacpp.media import Media, read_media
from specdec_cli.models.chat import ChatOptions

CASES = ("after the image", "text alone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("--mmproj", type=Path, required=True)
    parser.add_argument("-d", "--draft", default="ngram", help="a draft model, or ngram")
    parser.add_argument(
        "--mmproj-draft", type=Path, help="the draft model's own projector (else: text alone)"
    )
    parser.add_argument("--image", type=Path, action="append", required=True)
    parser.add_argument("-p", "--prompt", default="Describe the picture in detail.")
    parser.add_argument("-n", "--n-predict", type=int, default=128)
    parser.add_argument("-k", default="auto")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    lookup = args.draft == "ngram"
    options = EngineOptions(
        args.model,
        draft=None if lookup else Path(args.draft),
        ngram=True if lookup else None,
        mmproj=args.mmproj,
        mmproj_draft=args.mmproj_draft,
        threads=args.threads,
        sampling=GREEDY,
        drafting=DraftOptions(k=args.k),
    )
    media = [read_media(path) for path in args.image]
    rates: dict[tuple[str, str], list[float]] = {}
    per_pass: dict[str, list[float]] = {}
    encode_seconds: list[float] = []
    with Engine(options) as engine:
        decoders = {"target": engine.make_decoder(None, "1"), "speculative": engine.decoder}
        chat = ChatOptions()
        for rep in range(args.repeat):
            encode_seconds.append(time_encoding(engine, args.prompt, chat, media))
            runs = [(case, side) for case in CASES for side in decoders]
            for case, side in runs if rep % 2 == 0 else runs[::-1]:
                with engine.prompt(args.prompt, chat, media if case == CASES[0] else ()) as prompt:
                    stats = generate(decoders[side], prompt, args.n_predict)
                rates.setdefault((case, side), []).append(stats.tokens_per_second)
                if side == "speculative":
                    per_pass.setdefault(case, []).append(stats.tokens_per_pass)
    report(rates, per_pass, encode_seconds, len(media))


def time_encoding(engine: Engine, text: str, chat: ChatOptions, media: list[Media]) -> float:
    """Seconds the projector takes to encode every image of the prompt, afresh."""
    assert engine.encodings is not None
    projector = engine.encodings.projector
    with engine.prompt(text, chat, media) as prompt:
        chunks = [m.chunk for m in prompt.media.values()]
        start = time.perf_counter()
        for chunk in chunks:
            projector.encode(chunk)
        return time.perf_counter() - start


def generate(decoder: Decoder, prompt: MediaPrompt, n: int) -> Stats:
    stats = Stats()
    rounds = decoder.generate(prompt.tokens, n, np.random.default_rng(0), stats, media=prompt.media)
    for _ in rounds:
        pass
    return stats


def paired(over: list[float], under: list[float]) -> str:
    """The median of the repeats' ratios, and their range."""
    ratios = [a / b for a, b in zip(over, under, strict=True)]
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def report(
    rates: dict[tuple[str, str], list[float]],
    per_pass: dict[str, list[float]],
    encode: list[float],
    n_media: int,
) -> None:
    print("case\ttarget tok/s\tspeculative tok/s\ttokens a pass\tspeedup (paired)")
    for case in CASES:
        target, speculative = rates[case, "target"], rates[case, "speculative"]
        medians = [statistics.median(v) for v in (target, speculative, per_pass[case])]
        cells = [case, *(f"{m:.{2 if i == 2 else 1}f}" for i, m in enumerate(medians))]
        print("\t".join([*cells, paired(speculative, target)]))
    image, text = (
        [s / t for s, t in zip(rates[c, "speculative"], rates[c, "target"], strict=True)]
        for c in CASES
    )
    print("speedup after the image over the speedup after text alone: " + paired(image, text))
    median = statistics.median(encode)
    print(f"encoding {n_media} image(s): {median * 1e3:.1f} ms (median of {len(encode)})")


if __name__ == "__main__":
    main()
