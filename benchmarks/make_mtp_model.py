"""Build a known-answer Qwen3.5 model with an MTP head, as costly as a real small model.

The target writes a fixed cycle of tokens and its MTP head predicts it right after three
tokens in four (see tests/ggufgen.py, write_mtp_known_answer): acceptance is known in
advance and the same for every tool. Its trunk's blocks add nothing to the text but are
computed all the same, so --layers and --ffn set what a target pass costs (the defaults:
about 10-20 ms a token on two CPU cores, a 1-3B model's); the head is one block as wide.

    python benchmarks/make_mtp_model.py [--layers 8] [--ffn 4096] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test-model generator
from ggufgen import spm_vocab, write_mtp_known_answer  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "out" / "mtp-known-answer.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="trunk layers (8)")
    parser.add_argument("--ffn", type=int, default=4096, help="trunk feed-forward width (4096)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tables = write_mtp_known_answer(
        args.out, spm_vocab(), args.seed, n_layer=args.layers, n_ff=args.ffn
    )
    print(
        f"{args.out}: {args.layers} layers, ffn {args.ffn}, head right after "
        f"{tables.good.mean():.0%} of tokens"
    )


if __name__ == "__main__":
    main()
