"""specdec against llama.cpp's own `llama-speculative-simple`, side by side.

Runs `specdec run` (with its defaults, or the flags given) and llama.cpp's tool on the
same pair, prompts and length, alternating between them, and reports each side's
median generation speed (tokens/s after the prompt, as both tools count it) and the
ratio. llama.cpp's tool is run at every `--k`, `--fa` and `--spec-type` given, so that
specdec's defaults meet llama.cpp at its best setting (`--spec-type
ngram-mod,draft-simple`: its own lookup before its draft model, as specdec's default).
Each setting's ratio is also taken paired, against specdec's neighbouring passes: the
machine's speed can shift by a third between the first and the last alternation.
`--specdec-k` adds specdec itself at each fixed draft length as rivals, so that its
defaults also meet its own best fixed setting. Each side's best is also judged held out:
at each alternation, the setting the other alternations rate best.

One measurement is a pass over every prompt (by default `specdec bench`'s built-in
five): its speed is their tokens over their seconds. A single prompt is a poor judge:
a setting that changes the logits' last bits (`-fa`) changes the greedy text, and with
it how easy the text is to draft, by more than the setting's own cost.

Without `-d`, both sides run the target alone: `specdec run -d none` against
`llama-completion` (its decode speed, `eval time`), at each `--fa`.

Build the tools from the llama.cpp tree in llama-cpp-python's source distribution
(`vendor/llama.cpp`): `cmake -B build -DLLAMA_CURL=OFF && cmake --build build
--target llama-speculative-simple llama-completion`. See benchmarks/README.md.

    python benchmarks/vs_llama_cpp.py --llama BIN -m TARGET [-d DRAFT] [--k 2,3,4] [--fa on,off]
        [--spec-type TYPES ...] [--specdec-k 2,3,4] [-p PROMPT ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from specdec_cli.commands.bench import BUILTIN_PROMPTS
from specdec_cli.llamacpp import probe

LLAMA_SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
# llama-completion's decode line (its prompt's is "prompt eval time")
LLAMA_DECODE_SPEED = re.compile(r" eval time =.*?runs.*?,\s+([\d.]+) tokens per second")


def over_prompts(speed: Callable[..., float]) -> Callable[..., float]:
    """One measurement: every prompt once, their tokens over their seconds (each prompt
    generates the same number of tokens, so that is the harmonic mean of the speeds)."""

    def measure(args: argparse.Namespace, *variant: object) -> float:
        speeds = [speed(args, prompt, *variant) for prompt in args.prompts]
        return statistics.harmonic_mean(speeds)

    return measure


@over_prompts
def specdec_speed(args: argparse.Namespace, prompt: str, *flags: str) -> float:
    """specdec run with the --specdec-flags, then these flags (the later flag wins)."""
    command = [
        sys.executable, "-m", "specdec_cli", "run", "-m", args.model, "-d", args.draft or "none",
        "-p", prompt, "-n", str(args.n), "--temp", "0", "-t", str(args.threads),
        "-c", str(args.ctx), "--json", *args.specdec_flags, *flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(json.loads(result.stdout)["tokens_per_second"])


@over_prompts
def llama_speed(args: argparse.Namespace, prompt: str, spec: str, k: int, fa: str) -> float:
    command = [
        args.llama, "-m", args.model, "-p", prompt, "-n", str(args.n), "--temp", "0",
        "-t", str(args.threads), "-fa", fa, "-c", str(args.ctx), *args.llama_flags,
    ]  # fmt: skip
    pattern = LLAMA_DECODE_SPEED
    if args.draft:
        if args.draft not in ("mtp", "ngram"):  # the target's own head, a lookup: no file
            command += ["-md", args.draft, "-td", str(args.threads)]
        command += ["--spec-type", spec, "--spec-draft-n-max", str(k)]
        pattern = LLAMA_SPEED
    else:
        command.append("-no-cnv")
    env = os.environ | {"LD_LIBRARY_PATH": args.llama_lib} if args.llama_lib else None
    for _ in range(3):  # llama.cpp's log thread now and then loses its last lines at exit
        # The generated text of a random-weight model can split a UTF-8 character.
        result = subprocess.run(
            command, capture_output=True, text=True, errors="replace", check=True, env=env
        )
        match = pattern.search(result.stderr + result.stdout)
        if match:
            return float(match.group(match.lastindex or 0))
    sys.exit(f"no speed line in llama.cpp's output:\n{result.stderr[-2000:]}")


def llama_name(spec: str, k: int, fa: str) -> str:
    return f"llama {spec} k={k} -fa {fa}" if k else f"llama-completion -fa {fa}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama", required=True, help="llama-speculative-simple (llama-completion without -d)"
    )
    parser.add_argument("-m", "--model", required=True, help="target GGUF")
    parser.add_argument(
        "-d", "--draft", help="draft GGUF, or mtp: the target's own head (none: the target "
        "alone, both sides)"
    )  # fmt: skip
    parser.add_argument(
        "-p", "--prompt", action="append", dest="prompts", help="a prompt (repeatable; "
        "default: specdec bench's five)"
    )  # fmt: skip
    parser.add_argument("-n", type=int, default=128, help="tokens to generate (128)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-c", "--ctx", type=int, default=2048, help="context, both sides (2048)")
    parser.add_argument("--k", default="2,3,4,5", help="llama.cpp draft lengths to try")
    parser.add_argument("--fa", default="on,off", help="llama.cpp -fa settings to try")
    parser.add_argument(
        "--spec-type", action="append", dest="spec_types", help="llama.cpp --spec-type "
        "value to try (repeatable; default: draft-simple, or draft-mtp with -d mtp). Lookup "
        "with the draft model: "
        "ngram-simple,draft-simple (its n-gram flags go in --llama-flags)"
    )  # fmt: skip
    parser.add_argument(
        "--specdec-k", default="", help="specdec's own fixed draft lengths to try as rivals "
        "of its defaults (e.g. 2,3,4)"
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=5, help="alternations (5)")
    parser.add_argument("--specdec-flags", default="", help="extra flags for specdec run")
    parser.add_argument("--llama-flags", default="", help="extra flags for llama.cpp")
    parser.add_argument(
        "--llama-lib",
        help="run llama.cpp's tool (built with -DBUILD_SHARED_LIBS=ON) on the libraries in "
        "this folder: llama-cpp-python's own (llama_cpp/lib), as specdec runs",
    )
    parser.add_argument("--json", type=Path, help="write every timing here")
    args = parser.parse_args()
    args.specdec_flags = args.specdec_flags.split()
    # llama.cpp's repacking as specdec chose it here (where it crashes, both run without)
    args.llama_flags = [*probe.llama_cpp_flags(), *args.llama_flags.split()]
    args.prompts = args.prompts or list(BUILTIN_PROMPTS.values())

    llama_variants = [
        (spec, int(k), fa)
        for spec in args.spec_types or ["draft-mtp" if args.draft == "mtp" else "draft-simple"]
        for k in (args.k.split(",") if args.draft else ["0"])
        for fa in args.fa.split(",")
    ]
    rivals: dict[str, Callable[[], float]] = {
        f"specdec -k {k}": partial(specdec_speed, args, "-k", k)
        for k in filter(None, args.specdec_k.split(","))
    }
    rivals |= {
        llama_name(*variant): partial(llama_speed, args, *variant) for variant in llama_variants
    }
    specdec_speed(args)  # warm-up: the first run may measure costs and -fa auto, once
    runs: dict[str, list[float]] = {"specdec": []} | {name: [] for name in rivals}
    for _ in range(args.repeat):
        runs["specdec"].append(specdec_speed(args))
        for name, speed in rivals.items():
            runs[name].append(speed())
            runs["specdec"].append(specdec_speed(args))  # alternate: drift hits both
    report(runs, args.json)


def report(runs: dict[str, list[float]], json_path: Path | None) -> None:
    """Each side's median, specdec's paired ratio to it, and the verdicts against
    llama.cpp's best setting and specdec's own best fixed one."""
    medians = {name: statistics.median(values) for name, values in runs.items()}
    by_run = paired_by_run(runs)
    paired = {name: statistics.median(ratios) for name, ratios in by_run.items()}
    for name, value in medians.items():
        spread = f"{min(runs[name]):.1f}-{max(runs[name]):.1f}"
        ratio = f"  specdec {paired[name]:.3f}x this" if name in paired else ""
        print(f"{name:42} {value:7.1f} tok/s  (min-max {spread}, {len(runs[name])} runs){ratio}")
    best, held_out = {}, {}
    for side in ("llama", "specdec -k"):
        names = [name for name in paired if name.startswith(side)]
        if names:
            best[side] = max(names, key=medians.__getitem__)
            ratio = medians["specdec"] / medians[best[side]]
            print(
                f"specdec / {side} at its best ({best[side]}): {ratio:.3f}x, "
                f"paired {paired[best[side]]:.3f}x"
            )
        if len(names) > 1 and len(runs[names[0]]) > 1:  # settings to choose, runs to judge
            held_out[side] = held_out_ratio(runs, names, by_run)
            print(f"  with its best chosen on the other alternations: {held_out[side]:.3f}x")
    closest = min(paired, key=paired.__getitem__)
    print(f"specdec / its closest rival, paired ({closest}): {paired[closest]:.3f}x")
    if json_path:
        record = {
            "runs": runs, "medians": medians, "best": best, "paired": paired,
            "held_out": held_out,
        }  # fmt: skip
        json_path.write_text(json.dumps(record, indent=1))


def paired_by_run(runs: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per rival setting, at each alternation, specdec's speed (the mean of its runs just
    before and just after) over that setting's. This machine's speed shifts by a third
    within minutes; a ratio of neighbours cancels most of that, where a ratio of medians
    taken minutes apart does not. (Their median: the setting's paired ratio.)"""
    names = [name for name in runs if name != "specdec"]  # in the order they were run
    specdec, stride = runs["specdec"], len(names) + 1  # specdec runs first and after each
    return {
        name: [
            (specdec[r * stride + j] + specdec[r * stride + j + 1]) / 2 / speed
            for r, speed in enumerate(runs[name])
        ]
        for j, name in enumerate(names)
    }


def held_out_ratio(
    runs: dict[str, list[float]], names: list[str], by_run: dict[str, list[float]]
) -> float:
    """specdec's paired ratio to a side's best setting, where each alternation's best is
    the one the other alternations rate best (leave one out), median over alternations.
    The best of several settings, chosen and judged on the same noisy runs, is flattered
    by the choice: the luckiest of several settings alike looks the fastest."""
    ratios = []
    for r in range(len(runs[names[0]])):
        rated = {name: median_without(runs[name], r) for name in names}
        ratios.append(by_run[max(rated, key=rated.__getitem__)][r])
    return statistics.median(ratios)


def median_without(values: list[float], r: int) -> float:
    return statistics.median(values[:r] + values[r + 1 :])


if __name__ == "__main__":
    main()
