"""A vision-language pair sized for timing, into benchmarks/out/vision-<kind>/: tests/
mtmdgen.py's known-answer target (its answer is the picture's colour, then a fixed cycle of
words) with a feed-forward as wide as asked, so that a pass costs what a real model's does
(`target.gguf`); its projector (`mmproj.gguf`); the same model with the test's narrow
feed-forward as the draft (`draft.gguf`: the same tables, so it writes the same cycle, but
it reads no picture); a red and a blue picture.

    python benchmarks/make_vision_pair.py [--mrope] [--n-ff 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test-model generator
from mtmdgen import COLORS, png, write_vision_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mrope", action="store_true", help="the Qwen2-VL pair (M-RoPE)")
    parser.add_argument("--n-ff", type=int, default=16384, help="feed-forward width (16384)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    args = parser.parse_args()
    folder = args.out / f"vision-{'qwen2vl' if args.mrope else 'llava'}"
    folder.mkdir(parents=True, exist_ok=True)
    narrow = write_vision_pair(folder, mrope=args.mrope)  # the same seed: the same tables
    narrow.target.rename(folder / "draft.gguf")
    pair = write_vision_pair(folder, mrope=args.mrope, n_ff=args.n_ff)
    for colour in ("red", "blue"):
        picture = png(pair.image_size, pair.image_size, COLORS[colour])
        (folder / f"{colour}.png").write_bytes(picture)
    print(folder)


if __name__ == "__main__":
    main()
