"""Spec-Bench's questions (or any file in its format) through OpenAI's client, per category:
llama-server alone, with its lookup (`--spec-type ngram-mod`) and with a draft (`-md`),
against `specdec serve` alone, with `-d ngram` and with the draft.

Every setup's server starts at once and loads its models once; specdec's target alone
is its lookup server's command, asked with `"speculative": false`, in a process of its own
(a shared prompt cache would favour whichever asks second). For each repeat and question
the setups take turns, in rotated order (ABC, BCA, CAB, ...), so that the machine's
drifting speed hits them alike, seconds apart. Each asks the question's turns as a
conversation, greedy, `max_tokens` -n, through `client.chat.completions.create` (not
streamed): turn 2 after the setup's own answer to turn 1, as `specdec bench` and
Spec-Bench's inference loop ask it. A turn's time is the request's wall time, prompt
included (Spec-Bench's timer includes it too).

Per category and setup, in each repeat: completion tokens over wall seconds, summed over
the category's questions; the median over repeats. Speedups: each drafter over its own
server's target alone (the median of per-repeat ratios), and specdec over llama-server
with the same drafter (the same). Greedy answers should match the same server's target
alone: the count of those that do is printed (quantized models may part at near-ties).

With `--mmproj` and `--image`, every server loads the projector and every question's
first turn carries the pictures before its text (as `image_url` data URLs): speculation
on the text after an image, against each server's target alone.

Run it on an otherwise idle machine: anything else running changes the figures.

    python benchmarks/spec_bench_servers.py -m TARGET.gguf [-d DRAFT.gguf] \\
        --llama-server BIN [--prompts question.jsonl] [--per-category 2] [-n 128] \\
        [--repeats 3] [-t N] [--mmproj MMPROJ --image pic.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_concurrency import (  # noqa: E402
    Setup,
    llama_server_setup,
    median,
    paired_ratio,
    running,
    threads_flags,
)

from specdec_cli.commands.workload import Question, choose_workload  # noqa: E402

WARMUP = [{"role": "user", "content": "Say hello."}]
WARMUP_TOKENS = 8


@dataclass
class TurnRecord:
    """One request: a question's turn, as one setup answered it."""

    setup: str
    repeat: int
    question: str
    category: str
    turn: int
    seconds: float
    tokens: int
    answer: str
    timings: dict[str, Any] = field(default_factory=dict)  # the server's own, if it says


def build_setups(args: argparse.Namespace) -> list[Setup]:
    """llama-alone, llama-ngram (and llama-draft), specdec-alone, specdec-ngram (and
    specdec-draft): each drafter after its own target alone."""
    drafters = {"alone": "none", "ngram": "ngram", **({"draft": args.draft} if args.draft else {})}
    setups = []
    for name, draft in drafters.items():
        llama = llama_server_setup(argparse.Namespace(**{**vars(args), "draft": draft}))
        setups.append(Setup(f"llama-{name}", llama.command))
    for name, draft in drafters.items():
        body = {"speculative": False} if name == "alone" else {}
        setups.append(Setup(f"specdec-{name}", serve_command(args, draft), body))
    return setups


def serve_command(args: argparse.Namespace, draft: str) -> str:
    """`specdec serve` with one slot; for the target alone, the lookup's command, asked with
    "speculative": false."""
    serve = [sys.executable, "-m", "specdec_cli", "serve", "-m", args.model, "-c", str(args.ctx)]
    serve += ["-d", "ngram" if draft == "none" else draft, "--parallel", "1"]
    serve += [*threads_flags(args, "-t"), *shlex.split(args.specdec_flags)]
    return shlex.join(serve) + " --port {port}"


def ask(client: openai.OpenAI, setup: Setup, messages: list[dict], n: int) -> tuple[float, Any]:
    """One greedy chat request; its wall time and the reply."""
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model="any", messages=messages, max_tokens=n, temperature=0, extra_body=setup.body
    )
    return time.perf_counter() - start, reply


def image_parts(paths: list[Path]) -> list[dict[str, Any]]:
    """OpenAI content parts for the pictures, as data URLs."""
    parts = []
    for path in paths:
        kind = mimetypes.guess_type(path.name)[0] or "image/png"
        url = f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def ask_question(
    client: openai.OpenAI,
    setup: Setup,
    question: Question,
    repeat: int,
    n: int,
    pictures: list[dict[str, Any]],
) -> list[TurnRecord]:
    """The question's turns as one conversation, each after the setup's own answers; the
    first turn shows the pictures (if any) before its text."""
    messages: list[dict[str, Any]] = []
    records = []
    for turn, text in enumerate(question.turns):
        content = [*pictures, {"type": "text", "text": text}] if turn == 0 and pictures else text
        messages.append({"role": "user", "content": content})
        seconds, reply = ask(client, setup, messages, n)
        answer = (reply.choices[0].message.content or "").strip()
        messages.append({"role": "assistant", "content": answer})
        timings = (reply.model_extra or {}).get("timings") or {}
        tokens = reply.usage.completion_tokens if reply.usage else 0
        records.append(
            TurnRecord(
                setup.name, repeat, question.name, question.category or "", turn, seconds,
                tokens, answer, timings,
            )
        )  # fmt: skip
    return records


def measure(args: argparse.Namespace, setups: list[Setup], questions: list[Question]) -> list:
    """Every setup on every question, `--repeats` times, taking turns."""
    log_dir = Path(tempfile.mkdtemp(prefix="spec_bench_servers-"))
    print(f"Timing: nothing else may run on this machine while this measures. Logs: {log_dir}")
    records: list[TurnRecord] = []
    pictures = image_parts(args.image)
    with ExitStack() as stack:
        # A server each, even where two share a command: a shared prompt cache would
        # spare the second of them the prompt that the first had just read.
        clients = {}
        for setup in setups:
            port = stack.enter_context(running(setup, args, log_dir, "all"))
            url = f"http://{args.host}:{port}/v1"
            clients[setup.name] = openai.OpenAI(
                base_url=url, api_key="none", timeout=args.request_timeout
            )
        for setup in setups:
            ask(clients[setup.name], setup, WARMUP, WARMUP_TOKENS)
        rotation = 0
        for repeat in range(args.repeats):
            for question in questions:
                shift = rotation % len(setups)
                rotation += 1
                for setup in setups[shift:] + setups[:shift]:
                    client = clients[setup.name]
                    records += ask_question(client, setup, question, repeat, args.n, pictures)
            print(f"repeat {repeat + 1} of {args.repeats} done", file=sys.stderr)
    return records


def speeds(records: list[TurnRecord], setup: str, repeats: int, category: str | None) -> list:
    """Each repeat's tokens over seconds, over the category's turns (None: every turn)."""
    out = []
    for repeat in range(repeats):
        mine = [
            r for r in records
            if r.setup == setup and r.repeat == repeat and category in (None, r.category)
        ]  # fmt: skip
        seconds = sum(r.seconds for r in mine)
        out.append(sum(r.tokens for r in mine) / seconds if seconds else float("nan"))
    return out


def summarise(records: list[TurnRecord], setups: list[Setup], repeats: int) -> list[dict]:
    """A row per category (and one for all): each setup's median tok/s and the ratios."""
    names = [setup.name for setup in setups]
    categories = list(dict.fromkeys(r.category for r in records))
    rows = []
    for category in [*categories, None]:
        series = {name: speeds(records, name, repeats, category) for name in names}
        row: dict[str, Any] = {"category": category or "all"}
        row |= {name: median(values) for name, values in series.items()}
        for name in names:
            server, drafter = name.split("-")
            if drafter != "alone":
                row[f"{name}/alone"] = paired_ratio(series[name], series[f"{server}-alone"])
            if server == "specdec" and f"llama-{drafter}" in series:
                row[f"{name}/llama"] = paired_ratio(series[name], series[f"llama-{drafter}"])
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    columns = list(rows[0])
    print("\t".join(columns))
    for row in rows:
        cells = [row["category"]]
        for column in columns[1:]:
            value = row[column]
            cells.append(f"{value:.3f}x" if "/" in column else f"{value:.1f}")
        print("\t".join(cells))


def matching_answers(records: list[TurnRecord]) -> dict[str, str]:
    """Per drafter setup: its answers identical to its server's target alone's (the same
    repeat, question and turn), out of all."""
    key = {(r.setup, r.repeat, r.question, r.turn): r.answer for r in records}
    out = {}
    for setup in dict.fromkeys(r.setup for r in records):
        server, drafter = setup.split("-")
        if drafter == "alone":
            continue
        mine = [(k, a) for k, a in key.items() if k[0] == setup]
        same = sum(a == key.get((f"{server}-alone", *k[1:])) for k, a in mine)
        out[setup] = f"{same} of {len(mine)}"
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", required=True, help="target GGUF (a chat model)")
    parser.add_argument("-d", "--draft", help="draft GGUF: adds llama-draft and specdec-draft")
    parser.add_argument("--llama-server", required=True, metavar="BIN", help="llama-server")
    parser.add_argument("--prompts", type=Path, help="a question file (default: Spec-Bench's)")
    parser.add_argument(
        "--per-category", type=int, help="first N a category (2 of Spec-Bench's; a file's: all)"
    )
    parser.add_argument("-n", "--max-tokens", dest="n", type=int, default=128, help="(128)")
    parser.add_argument("--repeats", type=int, default=3, help="(3)")
    parser.add_argument("-c", "--ctx", type=int, default=4096, help="context, each server (4096)")
    parser.add_argument("-t", "--threads", type=int, help="threads, every server (their default)")
    parser.add_argument("--specdec-flags", default="", help="more flags for specdec serve")
    parser.add_argument("--llama-flags", default="", help="more flags for llama-server")
    parser.add_argument("--mmproj", help="a projector, for every server")
    parser.add_argument(
        "--image", type=Path, action="append", default=[], help="a picture (repeatable)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds (600)")
    parser.add_argument("--stop-timeout", type=float, default=30, help="SIGINT, then kill (30)")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds (600)")
    parser.add_argument("--show", action="store_true", help="print the setups, start nothing")
    parser.add_argument("--json", type=Path, help="write every turn's figures here")
    args = parser.parse_args()
    args.parallel = 1  # llama_server_setup's slots: one client, one slot
    if args.image and not args.mmproj:
        parser.error("--image needs --mmproj")
    if args.mmproj:
        args.specdec_flags += f" --mmproj {shlex.quote(args.mmproj)}"
        args.llama_flags += f" --mmproj {shlex.quote(args.mmproj)}"
    return args


def main() -> None:
    args = parse_args()
    suite = None if args.prompts else "spec-bench"
    per_category = args.per_category if args.per_category is not None else (2 if suite else None)
    questions = list(choose_workload(args.prompts, suite, per_category, {}).questions)
    setups = build_setups(args)
    for setup in setups:
        extra = f"  body + {json.dumps(setup.body)}" if setup.body else ""
        print(f"{setup.name}: {setup.command}{extra}")
    if args.show:
        return
    records = measure(args, setups, questions)
    rows = summarise(records, setups, args.repeats)
    print()
    print_table(rows)
    matching = matching_answers(records)
    print("\ngreedy answers identical to the same server's target alone: " + ", ".join(
        f"{name} {count}" for name, count in matching.items()
    ))  # fmt: skip
    if args.json:
        record = {
            "argv": sys.argv,
            "setups": [asdict(setup) for setup in setups],
            "questions": [asdict(q) for q in questions],
            "summary": rows,
            "matching_answers": matching,
            "turns": [asdict(r) for r in records],
        }
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
