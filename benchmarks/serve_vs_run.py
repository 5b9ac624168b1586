"""`specdec serve` against `specdec run`: the server's overhead, and prefix reuse.

For each built-in prompt, greedy, the same models and draft length:
  - `specdec run --json`: its tokens/s (generation only, as it reports it);
  - the server's own `timings.predicted_per_second`, and the tokens/s a client sees
    (completion tokens over the request's wall time, HTTP and prompt included);
  - whether the texts are identical (they must be).
Then a two-turn chat with a long first user message: time to the first streamed token
of each turn, and the second turn's `cache_n` (prompt tokens reused from the cache).

Run it on an otherwise idle machine: two llama.cpp processes at once slow each other
down (see ../shared/NOTES.md), and so does anything else running.

    python benchmarks/serve_vs_run.py TARGET.gguf DRAFT.gguf [-k 3] [-n 128] [--history 1000]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx

from specdec_cli.commands.bench import BUILTIN_PROMPTS

STARTUP_SECONDS = 600


def specdec(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec_cli", *args]


def run_json(models: list[str], k: str, n: int, prompt: str) -> dict:
    command = specdec("run", *models, "-k", k, "-n", str(n), "--temp", "0", "--json", "-p", prompt)
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(models: list[str], k: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(specdec("serve", *models, "-k", k, "--port", str(port), *extra))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit("the server did not start")


def completion(url: str, prompt: str, n: int) -> tuple[dict, float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    start = time.perf_counter()
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    return out, time.perf_counter() - start


def first_token_seconds(url: str, messages: list[dict], n: int) -> tuple[float, dict, str]:
    """Time to the first streamed text of a chat turn; its timings; its whole text."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first, timings, parts = None, {}, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if text:
                first = first or time.perf_counter() - start
                parts.append(text)
            timings = chunk.get("timings", timings)
    return first or float("nan"), timings, "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("-k", default="3")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--history", type=int, default=1000, help="words in the first turn")
    parser.add_argument("--chat-template", default="chatml")
    args = parser.parse_args()
    models = ["-m", args.target, "-d", args.draft]

    runs = {name: run_json(models, args.k, args.n, text) for name, text in BUILTIN_PROMPTS.items()}
    server, url = start_server(models, args.k, ["--chat-template", args.chat_template])
    try:
        print(f"{'prompt':10} {'run tok/s':>10} {'serve tok/s':>12} {'client tok/s':>13} same")
        for name, text in BUILTIN_PROMPTS.items():
            completion(url, text, 4)  # warm: not the first request after a prefix change
            out, seconds = completion(url, text, args.n)
            served = out["timings"]["predicted_per_second"]
            client = out["usage"]["completion_tokens"] / seconds
            same = out["choices"][0]["text"] == runs[name]["text"]
            print(
                f"{name:10} {runs[name]['tokens_per_second']:10.1f} {served:12.1f} "
                f"{client:13.1f} {same}"
            )
        history = " ".join(["the"] * args.history)
        turns = [{"role": "user", "content": f"Summarise this: {history}"}]
        first, timings_1, reply = first_token_seconds(url, turns, 16)
        turns += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
        second, timings_2, _ = first_token_seconds(url, turns, 16)
        print(
            f"chat: first turn {timings_1.get('prompt_n')} prompt tokens, first token after "
            f"{first * 1e3:.1f} ms; second turn cache_n {timings_2.get('cache_n')}, "
            f"prompt_n {timings_2.get('prompt_n')}, first token after {second * 1e3:.1f} ms "
            f"({second / first:.0%} of the first)"
        )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
