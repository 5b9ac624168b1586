"""specdec's defaults over a matrix of pairs it was not tuned on.

Each pair is stories260K as the draft and a target `make_wide_target.py` builds from it
with another feed-forward width, depth, weight type or acceptance (eps). On each pair
`vs_llama_cpp.py` runs specdec's defaults against specdec at each fixed draft length and
against `llama-speculative-simple` at each draft length and `-fa`, alternated; this
prints one row a pair: the defaults' speed, and their paired ratio to specdec's best
fixed k and to llama.cpp's best setting, also with each alternation's best chosen on the
others (held out: see vs_llama_cpp.held_out_ratio).

    python benchmarks/pair_matrix.py STORIES --llama BIN [--pairs deep,wide] [--out DIR]
        [--prompts story,code,list] [--vs-flags "--k 2,3,4 --fa on,off --specdec-k 2,3"]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specdec_cli.commands.bench import BUILTIN_PROMPTS

HERE = Path(__file__).resolve().parent
# name: make_wide_target.py's arguments. "base" is the pair the defaults were tuned on.
PAIRS = {
    "base": [],
    "deep": ["--ffn", "4096", "--extra-layers", "48"],
    "wide": ["--ffn", "16384", "--extra-layers", "8"],
    "big": ["--ffn", "12288", "--extra-layers", "36"],
    "q4_0": ["--type", "q4_0"],
    "eps 0.3": ["--eps", "0.3"],
}


def stem(name: str) -> str:
    """The pair's file names: its target's, its record's."""
    return f"pair-{name.replace(' ', '')}"


def build(stories: Path, name: str, out: Path) -> Path:
    target = out / f"{stem(name)}.gguf"
    if not target.is_file():
        command = [sys.executable, str(HERE / "make_wide_target.py"), str(stories)]
        subprocess.run([*command, *PAIRS[name], "--out", str(target)], check=True)
    return target


def measure(args: argparse.Namespace, name: str, target: Path) -> dict:
    record = args.out / f"{stem(name)}.json"
    prompts = [arg for n in args.prompts.split(",") for arg in ("-p", BUILTIN_PROMPTS[n])]
    command = [
        sys.executable, str(HERE / "vs_llama_cpp.py"), "--llama", args.llama,
        "-m", str(target), "-d", str(args.stories), "--json", str(record), *prompts,
        *args.vs_flags.split(),
    ]  # fmt: skip
    print(f"## {name}: {' '.join(PAIRS[name]) or 'as tuned'}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(record.read_text())


def row(name: str, record: dict) -> str:
    """A markdown row: the defaults, then each side's best, specdec's paired ratio to it,
    and held out (a side not run, such as specdec's fixed k without --specdec-k, or a
    figure it had too few settings or alternations for: dashes)."""
    medians, paired = record["medians"], record["paired"]
    cells = [name, f"{medians['specdec']:.1f}"]
    for side in ("specdec -k", "llama"):
        best, held = record["best"].get(side), record.get("held_out", {}).get(side)
        cells += [f"{best} ({medians[best]:.1f})", f"{paired[best]:.3f}x"] if best else ["-", "-"]
        cells.append(f"{held:.3f}x" if held else "-")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stories", type=Path, help="stories260K.gguf: the draft, and the base")
    parser.add_argument("--llama", required=True, help="llama-speculative-simple")
    parser.add_argument("--pairs", default=",".join(PAIRS), help="which pairs (default all)")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="models and records")
    parser.add_argument(
        "--prompts", default=",".join(BUILTIN_PROMPTS), help="which of bench's built-in "
        "prompts (default all five)"
    )  # fmt: skip
    parser.add_argument("--vs-flags", default="", help="more flags for vs_llama_cpp.py")
    args = parser.parse_args()
    names = args.pairs.split(",")
    if unknown := set(names) - set(PAIRS):
        sys.exit(f"unknown pair {sorted(unknown)}: choose from {', '.join(PAIRS)}")
    if unknown := set(args.prompts.split(",")) - set(BUILTIN_PROMPTS):
        sys.exit(f"unknown prompt {sorted(unknown)}: choose from {', '.join(BUILTIN_PROMPTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    targets = {name: build(args.stories, name, args.out) for name in names}
    rows = [row(name, measure(args, name, target)) for name, target in targets.items()]
    print("| pair | defaults tok/s | specdec's best fixed k | defaults / it | held out | "
          "llama.cpp's best | defaults / it | held out |")  # fmt: skip
    print("|---|---:|---|---:|---:|---|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
