"""Build a known-answer model with a drafting head, as costly as a real small model.

`--kind mtp`: a Qwen3.5 target writing a fixed cycle of tokens, whose MTP head predicts
it right after three tokens in four (tests/ggufgen.py, write_mtp_known_answer).
`--kind dflash`: a llama target writing a cycle, and a DFlash file beside it whose block
drafts the right token first after three tokens in four (write_dflash_known_answer).
`--kind assistant`: a Gemma 4 target writing a cycle, and a Gemma 4 assistant beside it,
right after three tokens in four (tests/gemma4gen.py, write_assistant_known_answer).
`--kind chained`: a MiMo-V2 target writing a cycle, with three chained MTP blocks, each
right after three tokens in four (tests/mimo2gen.py, write_chained_known_answer).
`--kind eagle3`: a llama target writing a cycle, and an EAGLE-3 head beside it whose first
draft is right after three tokens in four, its later ones never (write_eagle3_known_answer).
Acceptance is known in advance and the same for every tool. The target's blocks add
nothing to the text but are computed all the same, so --layers and --ffn set what a
target pass costs (the defaults: about 10-20 ms a token on two CPU cores, a 1-3B
model's).

    python benchmarks/make_head_model.py [--kind mtp|dflash|assistant|chained|eagle3] [--layers 8]
        [--ffn 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test-model generator
from gemma4gen import write_assistant_known_answer  # noqa: E402
from ggufgen import (  # noqa: E402
    spm_vocab,
    write_dflash_known_answer,
    write_eagle3_known_answer,
    write_mtp_known_answer,
)
from mimo2gen import write_chained_known_answer  # noqa: E402

OUT = REPO / "benchmarks" / "out"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kind", choices=["mtp", "dflash", "assistant", "chained", "eagle3"], default="mtp"
    )
    parser.add_argument("--layers", type=int, default=8, help="target layers (8)")
    parser.add_argument("--ffn", type=int, default=4096, help="target feed-forward width (4096)")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    shape = f"{args.layers} layers, ffn {args.ffn}"
    if args.kind == "mtp":
        path = OUT / "mtp-known-answer.gguf"
        tables = write_mtp_known_answer(
            path, spm_vocab(), args.seed, n_layer=args.layers, n_ff=args.ffn
        )
        print(f"{path}: {shape}, head right after {tables.good.mean():.0%} of tokens")
        return
    if args.kind == "chained":
        path = OUT / "chained-known-answer.gguf"
        write_chained_known_answer(path, spm_vocab(), args.seed, n_layer=args.layers, n_ff=args.ffn)
        print(f"{path}: {shape}, three chained MTP blocks")
        return
    if args.kind == "assistant":
        folder = OUT / "assistant-known-answer"
        folder.mkdir(exist_ok=True)
        target, head = folder / "target.gguf", folder / "assistant.gguf"
        tables = write_assistant_known_answer(
            target, head, spm_vocab(), args.seed, n_layer=args.layers, n_ff=args.ffn
        )
        print(f"{target} ({shape}), {head}: right after {tables.good.mean():.0%} of tokens")
        return
    folder = OUT / f"{args.kind}-known-answer"
    folder.mkdir(exist_ok=True)
    write = write_eagle3_known_answer if args.kind == "eagle3" else write_dflash_known_answer
    target, head, _ = write(folder, spm_vocab(), args.seed, n_layer=args.layers, n_ff=args.ffn)
    print(f"{target} ({shape}), {head}")


if __name__ == "__main__":
    main()
