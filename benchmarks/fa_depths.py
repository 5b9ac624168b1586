"""Flash attention on against off at several depths: what `-fa auto` measures, where.

Times a model's decodes (a batch of 1 and of 4 tokens, as -fa auto does) with flash
attention on and off, with each depth's tokens in the cache, the depths in alternating
order, and prints each depth's median of off's time over on's (above 1: on is faster).

    python benchmarks/fa_depths.py -m MODEL [--depths 64,128,256,512,1024] [--repeat 3] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.settings import EngineOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("--depths", default="64,128,256,512,1024")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    n_ctx = 2 * max(depths) + 16
    options = EngineOptions(
        args.model, n_ctx=n_ctx, threads=args.threads, flash_attn="off", head=False, ngram=False
    )
    ratios: dict[int, list[float]] = {d: [] for d in depths}
    with Engine(options) as engine:
        for rep in range(args.repeat):
            for depth in depths if rep % 2 == 0 else depths[::-1]:
                seconds = engine.time_flash_attn(engine.model, n_ctx, args.threads, depth)
                on, off = (sum(seconds[used].values()) for used in ("on", "off"))
                ratios[depth].append(off / on)
    for depth in depths:
        values = ", ".join(f"{r:.3f}" for r in ratios[depth])
        print(f"{depth:6d} tokens deep: off / on {statistics.median(ratios[depth]):.3f} ({values})")


if __name__ == "__main__":
    main()
