"""Speculation across a network: the target split over two RPC workers, each in a
network namespace of its own behind a veth pair, with a delay on the link.

The delay is added by a small TCP relay per worker, in this script: `tc netem` would be
the tool, but this VM's kernel has no sch_netem. The relay holds every chunk this machine
sends a worker for the delay before passing it on (what netem on this side's egress
does), so each round trip takes that much longer; the answers pass straight back. Every
RPC setting, 0 ms included, goes through the relay, so its own cost is in all of them.

For every delay, `specdec bench` measures the target alone and with speculation,
interleaved, over the two workers; and once per round on this machine alone. The
speedup is paired inside each bench (speculation over the target alone, same run). The
rounds alternate the order of the settings (local, 0, 1, 5 ms, then back), and each
setting's costs are measured afresh (a cost cache of its own), since -k auto prices
drafts with the cost of the split target at that delay.

Needs root (ip netns) and llama.cpp built with RPC (`bash .ci/build_rpc` prints
its folder). Run it on an otherwise idle machine.

    sudo python benchmarks/rpc_latency.py --lib DIR -m TARGET -d DRAFT [-k auto] \
        [--delays 0,1,5] [-n 64] [--repeat 2] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PORT = 50052
RELAY_PORT = 50160  # relay i listens on 127.0.0.1:RELAY_PORT + i
WORKERS = 2
CHUNK = 1 << 20


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def ns(i: int) -> str:
    return f"specdec-w{i}"


def worker_address(i: int) -> str:
    return f"10.201.{i}.2"


@contextmanager
def namespaces() -> Iterator[None]:
    """WORKERS namespaces, each reached from here over its own veth pair."""
    try:
        for i in range(1, WORKERS + 1):
            sh("ip", "netns", "add", ns(i))
            sh("ip", "link", "add", f"sdh{i}", "type", "veth", "peer", "name", f"sdw{i}")
            sh("ip", "link", "set", f"sdw{i}", "netns", ns(i))
            sh("ip", "addr", "add", f"10.201.{i}.1/24", "dev", f"sdh{i}")
            sh("ip", "link", "set", f"sdh{i}", "up")
            inside = ["ip", "netns", "exec", ns(i)]
            sh(*inside, "ip", "addr", "add", f"{worker_address(i)}/24", "dev", f"sdw{i}")
            sh(*inside, "ip", "link", "set", f"sdw{i}", "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
        yield
    finally:
        for i in range(1, WORKERS + 1):
            subprocess.run(["ip", "link", "del", f"sdh{i}"], stderr=subprocess.DEVNULL)
            subprocess.run(["ip", "netns", "del", ns(i)], stderr=subprocess.DEVNULL)


def relay(listen_port: int, to: tuple[str, int], delay_s: float) -> None:
    """Forward connections on 127.0.0.1:listen_port to `to`, holding what goes there for
    `delay_s` (each chunk leaves when its time comes, in order); answers pass at once."""
    server = socket.create_server(("127.0.0.1", listen_port))
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(to)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()
        threading.Thread(target=_hold, args=(client, held), daemon=True).start()
        threading.Thread(target=_release, args=(held, upstream, delay_s), daemon=True).start()
        threading.Thread(target=_pass, args=(upstream, client), daemon=True).start()


def _hold(source: socket.socket, held: queue.Queue) -> None:
    while data := source.recv(CHUNK):
        held.put((time.monotonic(), data))
    held.put((time.monotonic(), b""))


def _release(held: queue.Queue, sink: socket.socket, delay_s: float) -> None:
    while True:
        arrived, data = held.get()
        wait = arrived + delay_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if not data:
            sink.shutdown(socket.SHUT_WR)
            return
        sink.sendall(data)


def _pass(source: socket.socket, sink: socket.socket) -> None:
    while data := source.recv(CHUNK):
        sink.sendall(data)
    sink.close()


@contextmanager
def relays(delay_ms: float) -> Iterator[str]:
    """A relay per worker, with this delay; yields the --rpc value that goes through them."""
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--relay", str(RELAY_PORT + i), worker_address(i),
             str(delay_ms)]
        )
        for i in range(1, WORKERS + 1)
    ]  # fmt: skip
    time.sleep(1)
    try:
        yield ",".join(f"127.0.0.1:{RELAY_PORT + i}" for i in range(1, WORKERS + 1))
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextmanager
def workers(env: dict[str, str]) -> Iterator[None]:
    """`specdec worker` in each namespace."""
    processes = []
    for i in range(1, WORKERS + 1):
        command = ["ip", "netns", "exec", ns(i), sys.executable, "-m", "specdec_cli", "worker"]
        command += ["-H", worker_address(i), "-p", str(PORT), "--expose", "-t", "1", "-c"]
        processes.append(
            subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    time.sleep(3)
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def bench(args: argparse.Namespace, env: dict[str, str], rpc: str | None) -> dict:
    """One `specdec bench`: the target alone and with the drafter, interleaved."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        command = [sys.executable, "-m", "specdec_cli", "bench", "-m", args.model]
        command += ["-d", args.draft, "-k", args.k, "-n", str(args.n_predict)]
        command += ["--repeat", str(args.repeat), "-t", "1", "-td", "1", "--json", str(out)]
        if rpc:
            command += ["--rpc", rpc]
        cache = Path(folder) / "cache"  # costs measured at this delay, not another's
        subprocess.run(command, env=env | {"SPECDEC_CACHE_DIR": str(cache)}, check=True)
        return json.loads(out.read_text())


def summary(report: dict) -> dict[str, float]:
    base, (run, *_) = report["baseline"], report["runs"]
    return {
        "target_tok_s": base["tokens_per_second"],
        "spec_tok_s": run["tokens_per_second"],
        "speedup": run["speedup"],
        "tokens_per_pass": run["tokens_per_pass"],
        "acceptance": run["acceptance_rate"],
        "k_mean": run["k_mean"],
        # Of the speculative time: undoing rejected drafts, and the rest outside the calls.
        "rollback_share": run["time_share"]["rollback"],
        "other_share": run["time_share"]["other"],
    }


def main() -> None:
    if sys.argv[1:2] == ["--relay"]:
        port, host, delay_ms = sys.argv[2:5]
        relay(int(port), (host, PORT), float(delay_ms) / 1000)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", required=True, help="llama.cpp built with RPC (its .so folder)")
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-d", "--draft", required=True, help="a draft model, or ngram")
    parser.add_argument("-k", default="auto")
    parser.add_argument("--delays", default="0,1,5")
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = os.environ | {"LLAMA_CPP_LIB_PATH": args.lib}
    settings = ["local", *(f"{float(d):g}ms" for d in args.delays.split(","))]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    with namespaces(), workers(env):
        for round_ in range(args.rounds):
            order = settings if round_ % 2 == 0 else settings[::-1]
            for name in order:
                if name == "local":
                    report = bench(args, env, None)
                else:
                    with relays(float(name.removesuffix("ms"))) as rpc:
                        report = bench(args, env, rpc)
                results[name].append(summary(report))
                print(name, results[name][-1], flush=True)
    table = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    print(f"{'setting':>8} {'target tok/s':>13} {'spec tok/s':>11} {'speedup':>8} {'tok/pass':>9}")
    for name, row in table.items():
        print(
            f"{name:>8} {row['target_tok_s']:13.1f} {row['spec_tok_s']:11.1f} "
            f"{row['speedup']:8.3f} {row['tokens_per_pass']:9.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "runs": results, "medians": table},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
