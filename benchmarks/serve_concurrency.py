"""A server under concurrent streaming clients: throughput and latency by load.

Each setup is a server command line. For each repeat and setup, the script starts the
server on a free port, waits until `GET /health` answers 200, sends one short warm-up
request, then for each client count C runs C threads that together send `--requests`
streamed `POST /v1/completions` (greedy, or with `--temp` sampled with the prompt's
index as its seed; prompts cycled), and stops the server (SIGINT, then kill). Per
setup and C it reports:
  - tok/s: all completion tokens of the level over its wall time (first send to last
    byte), what the server delivers in aggregate;
  - time per output token (TPOT), per request (last text chunk - first text chunk) /
    (tokens - 1), p50 and p95 across the level's requests: what each client sees;
  - time to first token (TTFT), p50: queueing and prompt processing.
Medians over repeats, and each setup's paired ratio to the first setup (the median of
per-repeat ratios, this setup's figure over the first's: above 1 is faster for tok/s,
slower for TPOT; the machine's speed drifts between repeats, less between neighbours).
The order of the setups alternates (ABC, CBA, ...) so that drift hits each alike.
With `--turns N`, every setup's server runs at once, and at each client count the setups
take turns of N requests (AB, BA, ...): they are measured seconds apart, not minutes (a
level's tok/s is then its tokens over the sum of its turns' wall times).

Correctness, cheaply: greedy (or seeded) texts for a prompt must be the same at every
client count (and repeat) within a setup, and are compared with the first setup's;
errors (non-200, a stream that breaks or ends without `[DONE]`) are counted.

`--preset specdec` builds, from -m/-d/--parallel N: `p1` (`specdec serve --parallel 1`),
`pN-off` (`--parallel N`, requests carry `"speculative": false`) and `pN-on`
(`--parallel N`); `--llama-server BIN` adds llama.cpp's server on the same pair.
`--setup NAME=COMMAND` adds any server (`{port}` in COMMAND is replaced by the port),
`--body NAME=JSON` adds fields to that setup's request bodies.

Run it on an otherwise idle machine: a server and its clients share the cores, and
anything else running changes the figures.

    python benchmarks/serve_concurrency.py --preset specdec -m TARGET -d DRAFT --parallel 4 \
        [--llama-server BIN] [--clients 1,2,4,8] [--requests 16] [-n 128] [--repeats 3] \
        [--prompts FILE --fresh] [--vary-length] [--json out.json]
    python benchmarks/serve_concurrency.py --setup a='specdec serve -m T --port {port}' \
        --setup b='llama-server -m T --port {port}' --body a='{"speculative": false}'
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdec_cli.commands.bench import BUILTIN_PROMPTS as BENCH_PROMPTS
from specdec_cli.llamacpp import probe

# Short prompts of different kinds: drafting pays differently on stories, code and lists.
# specdec bench's story, code, list and factual prompts, and four more.
PROMPTS = [
    *(BENCH_PROMPTS[name] for name in ("story", "code", "list", "factual")),
    "Rewrite the list, changing red to blue.\n- a red ball\n- a red car\nRewritten:\n- a blue",
    'Tom said to his mom, "Can we go to the park today?" His mom',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Steps to make a cup of tea:\n1. Boil the water.\n2.",
]
HEALTH_POLL_SECONDS = 0.25
# --vary-length: a prompt's max_tokens is -n times one of these (mean 1), by its index.
LENGTH_FACTORS = (0.75, 1.25, 0.875, 1.125, 1.0, 0.625, 1.375)
WARMUP_TOKENS = 8


@dataclass
class Setup:
    name: str
    command: str  # shell-like; "{port}" is replaced by the port the script picks
    body: dict[str, Any] = field(default_factory=dict)  # merged into every request body


@dataclass
class RequestRecord:
    prompt_index: int
    sent: float  # seconds since the level started, as are the times below
    ended: float = math.nan
    status: int | None = None
    error: str | None = None
    # (arrival, characters of text) for every `data:` chunk: chunks without text (the
    # final one with usage/timings) are kept but do not count as tokens' arrivals
    chunks: list[tuple[float, int]] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    token_source: str = ""  # "usage", "timings" or "chunks": where `tokens` came from

    def text_times(self) -> list[float]:
        return [at for at, chars in self.chunks if chars]

    def ttft(self) -> float | None:
        times = self.text_times()
        return times[0] - self.sent if times else None

    def tpot(self) -> float | None:
        times = self.text_times()
        if self.tokens < 2 or len(times) < 2:
            return None
        return (times[-1] - times[0]) / (self.tokens - 1)


# --- the server ------------------------------------------------------------------------


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def health_ok(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=5)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False  # not listening yet, or 503 while loading
    finally:
        connection.close()


def log_tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def wait_healthy(
    process: subprocess.Popen, host: str, port: int, timeout: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}:\n{log_tail(log)}")
        if health_ok(host, port):
            return
        time.sleep(HEALTH_POLL_SECONDS)
    stop(process, 10)
    raise SystemExit(f"no 200 from /health after {timeout:.0f} s:\n{log_tail(log)}")


def stop(process: subprocess.Popen, timeout: float) -> None:
    """SIGINT first: both servers finish their streams and exit cleanly on it."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running(setup: Setup, args: argparse.Namespace, log_dir: Path, tag: str) -> Iterator[int]:
    """The setup's server, healthy, on a free port; stopped on the way out."""
    port = free_port(args.host)
    # Replace before splitting: str.format would trip on the braces of JSON in a command.
    argv = shlex.split(setup.command.replace("{port}", str(port)))
    log = log_dir / f"{setup.name}-{tag}.log"
    with log.open("wb") as sink:
        # The server's output goes to a log, so that stdout carries only the report.
        try:
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        except OSError as error:
            raise SystemExit(f"{setup.name}: cannot start {argv[0]}: {error}") from None
    try:
        wait_healthy(process, args.host, port, args.startup_timeout, log)
        yield port
    finally:
        stop(process, args.stop_timeout)


# --- the clients -----------------------------------------------------------------------


def max_tokens(prompt_index: int, args: argparse.Namespace) -> int:
    """-n, or with --vary-length -n times the prompt's factor: the same prompt always
    asks for as many tokens, so that its greedy texts can be compared."""
    if not args.vary_length:
        return args.n
    return max(1, round(args.n * LENGTH_FACTORS[prompt_index % len(LENGTH_FACTORS)]))


def request_body(
    setup: Setup, prompt: str, max_tokens: int, temp: float = 0.0, seed: int = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temp,
        "stream": True,
        # Asks for `usage` in the last chunk: llama-server sends it only when asked.
        "stream_options": {"include_usage": True},
    }
    if temp > 0:
        body["seed"] = seed
    return body | setup.body


def chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []  # the usage chunk may have none
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def read_stream(response: http.client.HTTPResponse, record: RequestRecord, t0: float) -> None:
    parts: list[str] = []
    usage_tokens = timings_tokens = None
    done = False
    for raw in response:
        arrived = time.perf_counter() - t0
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            record.error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
            break
        text = chunk_text(chunk)
        record.chunks.append((arrived, len(text)))
        parts.append(text)
        usage_tokens = (chunk.get("usage") or {}).get("completion_tokens", usage_tokens)
        timings_tokens = (chunk.get("timings") or {}).get("predicted_n", timings_tokens)
    record.text = "".join(parts)
    if not done and record.error is None:
        record.error = "the stream ended without [DONE]"
    record.tokens, record.token_source = count_tokens(usage_tokens, timings_tokens, record)


def count_tokens(usage: int | None, timings: int | None, record: RequestRecord) -> tuple[int, str]:
    """The server's own count where it gives one: a chunk may carry several tokens."""
    if usage is not None:
        return int(usage), "usage"
    if timings is not None:
        return int(timings), "timings"
    return len(record.text_times()), "chunks"


def one_request(
    host: str, port: int, body: dict[str, Any], index: int, t0: float, timeout: float
) -> RequestRecord:
    record = RequestRecord(prompt_index=index, sent=time.perf_counter() - t0)
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        connection.request("POST", "/v1/completions", json.dumps(body), headers)
        response = connection.getresponse()
        record.status = response.status
        if response.status == 200:
            read_stream(response, record, t0)
        else:
            record.error = f"HTTP {response.status}: {response.read(200)!r}"
    except (OSError, http.client.HTTPException, ValueError) as error:
        # ValueError: a chunk that is not JSON, i.e. a broken stream
        record.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
        record.ended = time.perf_counter() - t0
    return record


Turn = list[RequestRecord]  # one setup's requests in one turn, timed from its start


def run_turn(
    port: int, setup: Setup, clients: int, args: argparse.Namespace, first: int, count: int
) -> Turn:
    """`count` requests, `clients` in flight at a time: each thread takes the next
    request as soon as its last one ends, as a client with a backlog would. The prompts
    are cycled from the `first`."""
    prompts = args.prompts
    t0 = time.perf_counter()

    def send(i: int) -> RequestRecord:
        index = (first + i) % len(prompts)
        body = request_body(setup, prompts[index], max_tokens(index, args), args.temp, index)
        return one_request(args.host, port, body, index, t0, args.request_timeout)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(send, range(count)))


def run_level(
    group: list[Setup], ports: list[int], clients: int, level: int, args: argparse.Namespace
) -> list[list[Turn]]:
    """Each setup's turns at one client count: `--requests` requests each, in turns of
    `--turns` (all of them in one turn without), the setups of the group taking turns in
    alternating order (AB, BA, ...)."""
    size = args.turns or args.requests
    first = 1 + level * args.requests if args.fresh else 0  # past the warm-up's prompt
    turns: list[list[Turn]] = [[] for _ in group]
    for t, start in enumerate(range(0, args.requests, size)):
        count = min(size, args.requests - start)
        for i in range(len(group)) if t % 2 == 0 else reversed(range(len(group))):
            turns[i].append(run_turn(ports[i], group[i], clients, args, first + start, count))
    return turns


def warm_up(port: int, setup: Setup, args: argparse.Namespace) -> None:
    """One short request first: a server's first generation can pay one-off costs."""
    body = request_body(setup, args.prompts[0], WARMUP_TOKENS, args.temp)
    record = one_request(args.host, port, body, 0, time.perf_counter(), args.request_timeout)
    if record.error:
        print(f"warning: {setup.name}: the warm-up failed: {record.error}", file=sys.stderr)


# --- figures ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """numpy's (linear between closest ranks); NaN if empty."""
    return float(np.percentile(values, q)) if values else math.nan


def level_figures(turns: list[Turn]) -> dict[str, float]:
    """A level's figures over its turns: their tokens over the sum of their wall times."""
    records = [r for turn in turns for r in turn]
    ok = [r for r in records if r.error is None]
    wall = sum(max(r.ended for r in turn) - min(r.sent for r in turn) for turn in turns)
    tpots = [t for r in ok if (t := r.tpot()) is not None]
    ttfts = [t for r in ok if (t := r.ttft()) is not None]
    tokens = sum(r.tokens for r in ok)
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else math.nan,
        "tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "tpot_p95_ms": percentile(tpots, 95) * 1e3,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "errors": len(records) - len(ok),
    }


def median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def paired_ratio(values: list[float], reference: list[float]) -> float:
    """Median over repeats of value / the first setup's value in the same repeat."""
    ratios = [v / r for v, r in zip(values, reference, strict=True) if r and not math.isnan(v)]
    return median([r for r in ratios if not math.isnan(r)])


# --- setups ----------------------------------------------------------------------------


def parse_named(items: list[str], what: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SystemExit(f"{what} {item!r}: expected NAME=VALUE")
        pairs.append((name.strip(), value.strip()))
    return pairs


def specdec_setups(args: argparse.Namespace) -> list[Setup]:
    """p1, pN-off, pN-on: does N slots beat one, and does speculation still pay at N?"""
    serve = [sys.executable, "-m", "specdec_cli", "serve", "-m", args.model]
    if args.draft:
        serve += ["-d", args.draft]
    serve += [*threads_flags(args, "-t"), *shlex.split(args.specdec_flags)]
    n = args.parallel

    def command(parallel: int) -> str:
        # specdec's -c is every slot's together, as llama-server's: each slot gets --ctx.
        sized = [*serve, "-c", str(args.ctx * parallel), "--parallel", str(parallel)]
        return shlex.join(sized) + " --port {port}"

    return [
        Setup("p1", command(1)),
        Setup(f"p{n}-off", command(n), {"speculative": False}),
        Setup(f"p{n}-on", command(n)),
    ]


def threads_flags(args: argparse.Namespace, flag: str) -> list[str]:
    return [flag, str(args.threads)] if args.threads else []


def llama_server_setup(args: argparse.Namespace) -> Setup | None:
    """llama.cpp's server on the same pair and slots. Its -c is shared by the slots
    (without --kv-unified, which --parallel N turns off), so each slot gets --ctx."""
    argv = [args.llama_server, "-m", args.model, "--parallel", str(args.parallel)]
    argv += ["-c", str(args.ctx * args.parallel), *threads_flags(args, "-t")]
    if args.draft == "ngram":
        # llama.cpp's lookup closest to specdec's -d ngram (its README names ngram-mod)
        argv += ["--spec-type", "ngram-mod"]
    elif args.draft and args.draft != "none":
        # --draft-max was removed from llama.cpp; --spec-draft-n-max replaced it.
        argv += ["-md", args.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", "3"]
        argv += threads_flags(args, "-td")
    else:
        print("note: no draft given, llama-server runs the target alone")
    argv += [*probe.llama_cpp_flags(), *shlex.split(args.llama_flags)]
    return Setup(f"llama-np{args.parallel}", shlex.join(argv) + " --port {port}")


def build_setups(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Setup]:
    setups: list[Setup] = []
    if (args.preset == "specdec" or args.llama_server) and not args.model:
        parser.error("--preset specdec and --llama-server need -m TARGET")
    if args.preset == "specdec":
        if not args.draft or args.draft == "none":
            print("note: no draft given: the -on and -off setups both run the target alone")
        setups += specdec_setups(args)
    if args.llama_server:
        setups.append(llama_server_setup(args))
    setups += [Setup(name, command) for name, command in parse_named(args.setup, "--setup")]
    add_bodies(setups, parse_named(args.body, "--body"), parser)
    check_setups(setups, parser)
    return setups


def add_bodies(
    setups: list[Setup], bodies: list[tuple[str, str]], parser: argparse.ArgumentParser
) -> None:
    by_name = {setup.name: setup for setup in setups}
    for name, text in bodies:
        if name not in by_name:
            parser.error(f"--body {name}: no setup of that name ({', '.join(by_name)})")
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as error:
            parser.error(f"--body {name}: not JSON ({error})")
        if not isinstance(extra, dict):
            parser.error(f"--body {name}: expected a JSON object")
        by_name[name].body |= extra


def check_setups(setups: list[Setup], parser: argparse.ArgumentParser) -> None:
    if not setups:
        parser.error("no setups: give --preset specdec, --llama-server or --setup NAME=COMMAND")
    names = [setup.name for setup in setups]
    if len(set(names)) != len(names):
        parser.error(f"setup names must differ: {', '.join(names)}")
    for setup in setups:
        if "{port}" not in setup.command:
            parser.error(f"--setup {setup.name}: the command needs {{port}}")


def read_prompts(path: Path | None) -> list[str]:
    """One prompt a line; a literal \\n stands for a newline (code, lists)."""
    if path is None:
        return PROMPTS
    lines = path.read_text().splitlines()
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


# --- the grid and the report ------------------------------------------------------------


Results = dict[tuple[str, int], list[dict[str, float]]]  # (setup, clients) -> per repeat


def measure(args: argparse.Namespace, setups: list[Setup], log_dir: Path) -> tuple[Results, list]:
    results: Results = {(s.name, c): [] for s in setups for c in args.clients}
    raw: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        # ABC, CBA, ABC...: a drift in the machine's speed then falls on each setup alike.
        order = setups if repeat % 2 == 0 else setups[::-1]
        # --turns: every server at once, each level's turns alternating between them;
        # else one server at a time, each through every level.
        for group in [order] if args.turns else [[setup] for setup in order]:
            with ExitStack() as stack:
                tag = f"r{repeat}"
                ports = [stack.enter_context(running(s, args, log_dir, tag)) for s in group]
                for setup, port in zip(group, ports, strict=True):
                    warm_up(port, setup, args)
                for level, clients in enumerate(args.clients):
                    level_turns = run_level(group, ports, clients, level, args)
                    for setup, turns in zip(group, level_turns, strict=True):
                        figures = level_figures(turns)
                        results[(setup.name, clients)].append(figures)
                        raw.append(raw_entry(repeat, setup, clients, figures, turns))
                        progress(repeat, setup, clients, figures)
    return results, raw


def raw_entry(
    repeat: int, setup: Setup, clients: int, figures: dict, turns: list[Turn]
) -> dict[str, Any]:
    return {
        "repeat": repeat,
        "setup": setup.name,
        "clients": clients,
        **figures,
        "turns": [[asdict(record) for record in turn] for turn in turns],
    }


def entry_requests(entry: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A raw entry's requests, turn after turn."""
    return (record for turn in entry["turns"] for record in turn)


def progress(repeat: int, setup: Setup, clients: int, figures: dict[str, float]) -> None:
    # stderr: stdout keeps the report alone, for pasting
    print(
        f"  repeat {repeat + 1} {setup.name} C={clients}: {figures['tok_s']:.1f} tok/s, "
        f"TPOT p50 {figures['tpot_p50_ms']:.2f} ms, {figures['errors']} errors",
        file=sys.stderr,
    )


def summarise(results: Results, setups: list[Setup], clients: list[int]) -> list[dict]:
    first = setups[0].name
    rows = []
    for c in clients:
        reference = results[(first, c)]
        for setup in setups:
            runs = results[(setup.name, c)]
            rows.append(summary_row(setup.name, c, runs, reference))
    return rows


def summary_row(name: str, clients: int, runs: list[dict], reference: list[dict]) -> dict:
    def series(runs: list[dict], key: str) -> list[float]:
        return [run[key] for run in runs]

    tok_s = series(runs, "tok_s")
    return {
        "setup": name,
        "clients": clients,
        "tok_s": median(tok_s),
        "tok_s_min": min(tok_s),
        "tok_s_max": max(tok_s),
        "tok_s_vs_first": paired_ratio(tok_s, series(reference, "tok_s")),
        "tpot_p50_ms": median(series(runs, "tpot_p50_ms")),
        "tpot_p95_ms": median(series(runs, "tpot_p95_ms")),
        "tpot_p50_vs_first": paired_ratio(
            series(runs, "tpot_p50_ms"), series(reference, "tpot_p50_ms")
        ),
        "ttft_p50_ms": median(series(runs, "ttft_p50_ms")),
        "errors": sum(int(run["errors"]) for run in runs),
    }


def fmt(value: float, digits: int = 1, suffix: str = "") -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}{suffix}"


def print_table(rows: list[dict], first: str) -> None:
    print(
        f"| clients | setup | tok/s | min-max | tok/s vs {first} | TPOT p50 ms | TPOT p95 ms "
        f"| TPOT vs {first} | TTFT p50 ms | errors |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['clients']} | {row['setup']} | {fmt(row['tok_s'])} "
            f"| {fmt(row['tok_s_min'])}-{fmt(row['tok_s_max'])} "
            f"| {fmt(row['tok_s_vs_first'], 3, 'x')} | {fmt(row['tpot_p50_ms'], 2)} "
            f"| {fmt(row['tpot_p95_ms'], 2)} | {fmt(row['tpot_p50_vs_first'], 3, 'x')} "
            f"| {fmt(row['ttft_p50_ms'])} | {row['errors']} |"
        )


def repeatable_texts(
    raw: list[dict], setups: list[Setup], temp: float
) -> dict[str, dict[int, set[str]]]:
    """Per setup, per prompt: every text a greedy or seeded request got, at any level
    and repeat."""
    bodies = {s.name: request_body(s, "", 1, temp) for s in setups}
    repeatable = {name for name, b in bodies.items() if b.get("temperature") == 0 or "seed" in b}
    texts: dict[str, dict[int, set[str]]] = {name: {} for name in repeatable}
    for entry in raw:
        if entry["setup"] not in repeatable:
            continue
        for record in entry_requests(entry):
            if record["error"] is None:
                texts[entry["setup"]].setdefault(record["prompt_index"], set()).add(record["text"])
    return texts


def consistency(raw: list[dict], setups: list[Setup], temp: float) -> dict[str, dict[str, Any]]:
    texts = repeatable_texts(raw, setups, temp)
    reference = texts.get(setups[0].name, {})
    facts = {}
    for name, by_prompt in texts.items():
        varying = sorted(i for i, seen in by_prompt.items() if len(seen) > 1)
        unlike_first = sorted(i for i, seen in by_prompt.items() if seen != reference.get(i))
        facts[name] = {"prompts": len(by_prompt), "varying": varying, "unlike_first": unlike_first}
    return facts


def print_consistency(facts: dict[str, dict[str, Any]], setups: list[Setup], raw: list) -> None:
    first = setups[0].name
    for setup in setups:
        errors = sum(entry["errors"] for entry in raw if entry["setup"] == setup.name)
        if setup.name not in facts:
            print(f"{setup.name}: not seeded, texts not compared; {errors} errors", end="")
            print(first_error(raw, setup))
            continue
        fact = facts[setup.name]
        same = "identical" if not fact["varying"] else f"DIFFER for prompts {fact['varying']}"
        line = f"{setup.name}: texts across client counts and repeats {same}"
        if setup.name != first and first in facts:
            unlike = fact["unlike_first"]
            line += f"; as {first}'s: " + ("yes" if not unlike else f"NO for prompts {unlike}")
        print(f"{line} ({fact['prompts']} prompts); {errors} errors{first_error(raw, setup)}")


def first_error(raw: list[dict], setup: Setup) -> str:
    """The first error's message: the JSON file has them all."""
    entries = [entry for entry in raw if entry["setup"] == setup.name]
    errors = [r["error"] for entry in entries for r in entry_requests(entry) if r["error"]]
    return f" (first: {errors[0][:120]})" if errors else ""


# --- the command line ------------------------------------------------------------------


def client_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers, e.g. 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("client counts must be at least 1")
    return counts


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_setup_args(parser)
    add_load_args(parser)
    args = parser.parse_args()
    if args.requests < max(args.clients):
        parser.error("--requests must be at least the largest --clients (else fewer run at once)")
    if args.parallel < 1 or args.repeats < 1 or args.n < 1:
        parser.error("--parallel, --repeats and -n must be at least 1")
    return args, parser


def add_setup_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["specdec"], help="p1, pN-off, pN-on from -m/-d")
    parser.add_argument("-m", "--model", help="target GGUF (for --preset and --llama-server)")
    parser.add_argument("-d", "--draft", help="draft GGUF, or ngram (default: the target alone)")
    parser.add_argument(
        "--parallel", "-np", type=int, default=4, help="N, the slots of the pN setups (4)"
    )
    parser.add_argument("--llama-server", metavar="BIN", help="add llama.cpp's llama-server")
    parser.add_argument("-c", "--ctx", type=int, default=2048, help="context per slot (2048)")
    parser.add_argument("-t", "--threads", type=int, help="threads, both servers (their default)")
    parser.add_argument("--specdec-flags", default="", help="more flags for specdec serve")
    parser.add_argument("--llama-flags", default="", help="more flags for llama-server")
    parser.add_argument(
        "--setup", action="append", default=[], metavar="NAME=COMMAND",
        help="a server command line with {port} (repeatable; after the preset's)",
    )  # fmt: skip
    parser.add_argument(
        "--body", action="append", default=[], metavar="NAME=JSON",
        help="fields added to that setup's request bodies (repeatable)",
    )  # fmt: skip
    parser.add_argument("--show", action="store_true", help="print the setups, start nothing")


def add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=client_counts, default=[1, 2, 4, 8], help="(1,2,4,8)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (16)")
    parser.add_argument(
        "--vary-length", action="store_true", help="each prompt asks for -n times a factor "
        "of 0.625-1.375 (mean 1): requests then end at different times, as real ones do. "
        "Of equal length, target-only slots run in step and never wait for a turnover, while "
        "speculation makes requests end at different steps"
    )  # fmt: skip
    parser.add_argument(
        "--fresh", action="store_true", help="send no prompt twice to one server: each level "
        "takes the next prompts (needs 1 + levels x requests of them, with --prompts), so a "
        "server that remembers earlier texts drafts only from each request's own"
    )  # fmt: skip
    parser.add_argument(
        "--turns", type=int, default=0, metavar="N", help="run every setup's server at once "
        "(each needs its memory) and let the setups take turns of N requests a level, in "
        "alternating order: they are then measured seconds apart, not minutes, and the "
        "machine's speed, which can swing by tens of percent from one stretch of seconds "
        "to the next, hits them alike (0: one server at a time, each through every level)"
    )  # fmt: skip
    parser.add_argument("-n", "--max-tokens", dest="n", type=int, default=128, help="(128)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the whole grid (3)")
    parser.add_argument(
        "--temp", type=float, default=0.0, help="sample at T, seeded by prompt (0: greedy)"
    )
    parser.add_argument(
        "--prompts", type=Path, help="a prompt a line, \\n for newlines (default: 8 built in)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds (600)")
    parser.add_argument("--stop-timeout", type=float, default=30, help="SIGINT, then kill (30)")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds (600)")
    parser.add_argument("--json", type=Path, help="write every raw figure here")


def without_nan(value: Any) -> Any:
    """NaN (no request to take a figure from) as null: NaN is not JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: without_nan(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [without_nan(item) for item in value]
    return value


def main() -> None:
    args, parser = parse_args()
    args.prompts = read_prompts(args.prompts)
    needed = 1 + len(args.clients) * args.requests
    if args.turns < 0:
        parser.error("--turns must be 0 (one server at a time) or a number of requests")
    if args.fresh and len(args.prompts) < needed:
        parser.error(
            f"--fresh needs {needed} prompts (1 + levels x requests); give more with --prompts"
        )
    setups = build_setups(args, parser)
    for setup in setups:
        extra = f"  body + {json.dumps(setup.body)}" if setup.body else ""
        print(f"{setup.name}: {setup.command}{extra}")
    if args.show:
        return
    log_dir = Path(tempfile.mkdtemp(prefix="serve_concurrency-"))
    print(f"Timing: nothing else may run on this machine while this measures. Logs: {log_dir}")
    results, raw = measure(args, setups, log_dir)

    rows = summarise(results, setups, args.clients)
    print()
    print_table(rows, setups[0].name)
    print()
    facts = consistency(raw, setups, args.temp)
    print_consistency(facts, setups, raw)
    if args.json:
        record = {
            "argv": sys.argv,
            "setups": [asdict(setup) for setup in setups],
            "prompts": args.prompts,
            "summary": rows,
            "consistency": facts,
            "runs": raw,
        }
        args.json.write_text(json.dumps(without_nan(record), indent=1))


if __name__ == "__main__":
    main()
