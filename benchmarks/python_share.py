"""Python's share of the wall time, per sampler setting, on a real model.

Runs `specdec run --json` on a few prompts, target-only and with each drafter given,
for every sampler setting, interleaved (one run of each, then the next repeat), and
reports per setting and drafter: the share of generation time spent outside llama.cpp's
decode calls (`time_split.other / seconds`), the same in microseconds per generated
token, and tokens/s; medians over prompts and repeats. Time it on a quiet machine.

    python benchmarks/python_share.py -m MODEL [-d ngram] [-n 128] [--repeat 3] [-t 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

# Greedy, then llama.cpp's sampling defaults at temperature 0.8 and variations of them.
SETTINGS = (
    "--temp 0",
    "--temp 0.8",
    "--temp 0.8 --top-k 0",
    "--temp 0.8 --top-k 0 --top-p 1 --min-p 0",
    "--temp 0.8 --top-p 0.8 --top-k 20",
    "--temp 0.8 --min-p 0.1",
)
PROMPTS = (
    "Once upon a time, there was a little girl named Lily. She",
    "The history of the city begins in the twelfth century, when",
    "def fibonacci(n):\n    ",
)


def run(args: argparse.Namespace, drafter: str, prompt: str, setting: str, seed: int) -> dict:
    command = [
        sys.executable, "-m", "specdec_cli", "run", "-m", args.model, "-d", drafter,
        "-p", prompt, "-n", str(args.n), "-t", str(args.t), "--seed", str(seed),
        "-fa", args.fa, "--json", *setting.split(),
    ]  # fmt: skip
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-d", "--draft", action="append", default=[], help="besides none")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-t", type=int, default=2)
    parser.add_argument("-fa", default="off")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    drafters = ["none", *args.draft]
    runs: dict[tuple[str, str], list[dict]] = {(s, d): [] for s in SETTINGS for d in drafters}
    for repeat in range(args.repeat):
        for i, prompt in enumerate(PROMPTS):
            for setting in SETTINGS:
                for drafter in drafters:
                    record = run(args, drafter, prompt, setting, seed=3 + i + 10 * repeat)
                    runs[setting, drafter].append(record)
    print("setting\tdrafter\tpython share\tus/token\ttok/s")
    for (setting, drafter), records in runs.items():
        share = statistics.median(r["time_split"]["other"] / r["seconds"] for r in records)
        per_token = statistics.median(1e6 * r["time_split"]["other"] / r["tokens"] for r in records)
        speed = statistics.median(r["tokens_per_second"] for r in records)
        print(f"{setting}\t{drafter}\t{100 * share:.1f} %\t{per_token:.0f}\t{speed:.1f}")


if __name__ == "__main__":
    main()
