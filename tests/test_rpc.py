"""The target split over RPC workers (`--rpc`), the workers themselves (`specdec worker`),
and every fault a worker can cause: each one line, a non-zero exit, no hang.

The RPC tests need llama.cpp built with -DGGML_RPC=on: `.ci/build_rpc` builds one into
the user's cache, and every process here loads it through LLAMA_CPP_LIB_PATH (the
binding is the same version). The test process itself keeps the plain build.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from specdec_cli.errors import UserError
from specdec_cli.llamacpp import rpc

RPC_LIB_ENV = "SPECDEC_RPC_LIB"
GREEDY = ["--temp", "0", "-t", "1", "-td", "1"]
# Room for a generation that lasts until a worker is killed (the test model never
# chooses its EOS greedily from these prompts).
LONG_CTX = "65536"


def rpc_lib() -> Path | None:
    """The RPC-enabled libraries: $SPECDEC_RPC_LIB, else where .ci/build_rpc puts them."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    default = cache / "specdec" / f"llama-rpc-{version('llama-cpp-python')}" / "build" / "bin"
    folder = Path(os.environ.get(RPC_LIB_ENV) or default)
    return folder if (folder / "libllama.so").is_file() else None


needs_rpc = pytest.mark.skipif(
    rpc_lib() is None,
    reason="no llama.cpp built with RPC: run .ci/build_rpc (CI does) or set SPECDEC_RPC_LIB",
)


def rpc_env() -> dict[str, str]:
    lib = rpc_lib()
    assert lib is not None
    return os.environ | {"LLAMA_CPP_LIB_PATH": str(lib)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specdec(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specdec_cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env or rpc_env(),
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("specdec: error:"), result.stderr
    for word in words:
        assert word in last, last
    return last


class Worker:
    """A `specdec worker` process on a free loopback port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdec_cli", "worker", "-p", str(self.port), "-t", "1"],
            env=rpc_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.worker_protocol(self.endpoint, timeout=5)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start: {self.output()}") from None
                time.sleep(0.1)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def output(self) -> str:
        self.kill()
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")


@pytest.fixture
def workers() -> Iterator[Callable[[int], list[Worker]]]:
    started: list[Worker] = []

    def start(n: int) -> list[Worker]:
        started.extend(Worker() for _ in range(n))
        return started[-n:]

    yield start
    for worker in started:
        worker.kill()


def endpoints(workers: list[Worker]) -> str:
    return ",".join(w.endpoint for w in workers)


def run_json(*args: str) -> dict[str, object]:
    result = specdec("run", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- split over two workers: exact, and reproducible ------------------------------------


@needs_rpc
def test_worker_speaks_the_protocol_specdec_expects(workers) -> None:
    (worker,) = workers(1)
    assert rpc.worker_protocol(worker.endpoint)[:2] == rpc.PROTOCOL


@needs_rpc
def test_split_target_is_exact_greedy_and_reproducible_sampled(
    workers, target_model: Path, draft_model: Path
) -> None:
    prompt = ["-m", str(target_model), "-p", "Once upon a time", "-n", "48"]
    draft = ["-d", str(draft_model)]
    split = endpoints(workers(2))
    for drafting in (["-d", "none"], [*draft, "-k", "3"], [*draft, "-k", "auto"]):
        local = run_json(*prompt, *drafting, *GREEDY)
        remote = run_json(*prompt, *drafting, *GREEDY, "--rpc", split)
        assert remote["text"] == local["text"], drafting
        assert remote["tokens"] == local["tokens"] == 48
    sampled = [*prompt, *draft, "-k", "3", "--temp", "0.8", "-t", "1", "--rpc", split]
    first, again = (run_json(*sampled, "--seed", "7") for _ in range(2))
    assert first["text"] == again["text"]
    assert run_json(*sampled, "--seed", "8")["text"] != first["text"]


@needs_rpc
def test_target_layers_go_to_both_workers_and_the_draft_stays_here(
    workers, target_model: Path, draft_model: Path
) -> None:
    two = workers(2)
    result = specdec(
        "run", "-m", str(target_model), "-d", str(draft_model), "-p", "Hi", "-n", "4",
        *GREEDY, "--rpc", endpoints(two), "--verbose",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # llama.cpp's load log: a model buffer on each worker's device for the target only.
    buffers = [line for line in result.stderr.splitlines() if "model buffer size" in line]
    remote = [line for line in buffers if "RPC" in line]  # "RPC0[HOST:PORT] model buffer"
    assert {w.endpoint for w in two if any(w.endpoint in line for line in remote)} == {
        w.endpoint for w in two
    }, buffers
    assert len(remote) == 2, buffers  # the draft put nothing on them


# --- faults: one line each ----------------------------------------------------------------


@needs_rpc
def test_a_worker_that_is_not_there_is_named(target_model: Path) -> None:
    port = free_port()
    result = specdec("run", "-m", str(target_model), "-p", "Hi", "--rpc", f"127.0.0.1:{port}")
    assert_one_line_error(result, f"127.0.0.1:{port}", "not there", "specdec worker")


def fake_worker(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A server that takes the handshake and answers it with `answer`."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with client:
                client.recv(1 + 8 + 24)
                answer(client)

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{port}"
    server.close()


@pytest.fixture
def older_worker() -> Iterator[str]:
    """A worker of protocol 6.1.0: same handshake, another major version."""
    yield from fake_worker(
        lambda c: c.sendall(struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24))
    )


@pytest.fixture
def ancient_worker() -> Iterator[str]:
    """A worker that hangs up on this handshake (as protocol 3 did on its size)."""
    yield from fake_worker(lambda c: None)


@needs_rpc
def test_a_worker_of_another_version_is_named(
    older_worker: str, ancient_worker: str, target_model: Path
) -> None:
    result = specdec("run", "-m", str(target_model), "-p", "Hi", "--rpc", older_worker)
    assert_one_line_error(result, older_worker, "6.1.0", "7.0", "same specdec")
    result = specdec("run", "-m", str(target_model), "-p", "Hi", "--rpc", ancient_worker)
    assert_one_line_error(result, ancient_worker, "another llama.cpp version")


def test_the_version_check_needs_no_rpc_build(older_worker: str) -> None:
    with pytest.raises(UserError, match=r"protocol 6\.1\.0"):
        rpc.check_worker(older_worker)


@needs_rpc
def test_a_worker_lost_mid_generation_ends_run_with_its_name_and_the_text_so_far(
    workers, target_model: Path
) -> None:
    first, second = workers(2)
    process = subprocess.Popen(
        [
            sys.executable, "-m", "specdec_cli", "run", "-m", str(target_model), "-d", "none",
            "-p", "Once", "-n", "-1", "-c", LONG_CTX, "-q", *GREEDY,
            "--rpc", endpoints([first, second]),
        ],
        env=rpc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    shown = process.stdout.read(64)  # text is coming: the worker dies mid-generation
    second.kill()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1, err
    assert "Traceback" not in err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("specdec: error:") and second.endpoint in last, err
    assert first.endpoint not in last
    assert len(shown + out) >= 64  # what was generated stays on stdout


@needs_rpc
def test_json_keeps_the_text_so_far_when_a_worker_is_lost(
    workers, target_model: Path, tmp_path: Path
) -> None:
    (worker,) = workers(1)
    process = subprocess.Popen(
        [
            sys.executable, "-m", "specdec_cli", "run", "-m", str(target_model), "-d", "none",
            "-p", "Once", "-n", "-1", "-c", LONG_CTX, "--json", *GREEDY, "--rpc", worker.endpoint,
        ],
        env=rpc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(3)  # loaded, and generating (it generates until the context is full)
    worker.kill()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1, err
    record = json.loads(out)
    assert record["stop_reason"] == "worker lost"
    assert record["tokens"] > 0 and record["text"]
    assert worker.endpoint in err.decode().strip().splitlines()[-1]


# --- serve: 503 while a worker is away, and back when it returns -------------------------


@needs_rpc
def test_serve_answers_503_while_a_worker_is_away_and_recovers(workers, target_model: Path) -> None:
    (worker,) = workers(1)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "specdec_cli", "serve", "-m", str(target_model), "-d", "none",
            "--port", str(port), "-np", "1", "-c", LONG_CTX, "-t", "1", "--rpc", worker.endpoint,
        ],
        env=rpc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        body = {"prompt": "Once", "max_tokens": 8, "temperature": 0}
        before = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        # A long request is running when the worker dies: it gets a 503.
        long = {"prompt": "Once", "max_tokens": 100000, "temperature": 0}
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{url}/v1/completions", json=long, timeout=60)
            )
        )
        thread.start()
        time.sleep(2)
        worker.kill()
        thread.join(60)
        assert answers and answers[0].status_code == 503, answers
        assert worker.endpoint in answers[0].json()["error"]["message"]
        # The server is up, and says why it cannot answer.
        wait_for(lambda: worker.endpoint in httpx.get(f"{url}/health").text)
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert server.poll() is None
        # The worker returns on the same port: the server loads again and answers.
        workers_back = Worker(worker.port)
        try:
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
            after = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert after["choices"][0]["text"] == before["choices"][0]["text"]
        finally:
            workers_back.kill()
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)


def wait_for(condition: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("timed out")


# --- without an RPC build, and bad input ---------------------------------------------------


def test_rpc_without_an_rpc_build_names_the_rebuild(target_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    result = specdec("run", "-m", str(target_model), "-p", "Hi", "--rpc", "127.0.0.1:1", env=env)
    if "RPC: built in" in specdec("--version", env=env).stdout:
        pytest.skip("this install's llama.cpp has RPC built in")
    assert_one_line_error(result, "without RPC", "-DGGML_RPC=on")


@pytest.mark.parametrize(
    ("value", "words"),
    [("", "needs HOST:PORT"), ("host", "not HOST:PORT"), ("h:99999", "not HOST:PORT"),
     ("a:1,a:1", "twice")],
)  # fmt: skip
def test_bad_endpoints_are_refused(value: str, words: str) -> None:
    with pytest.raises(UserError, match=words):
        rpc.parse_endpoints(value)


def test_a_worker_beyond_loopback_needs_expose() -> None:
    result = specdec("worker", "-H", "0.0.0.0", env=dict(os.environ))
    assert_one_line_error(result, "--expose", "SSH tunnel")
    assert rpc.check_host("127.0.0.1", expose=False) is None
    assert "never expose" in (rpc.check_host("0.0.0.0", expose=True) or "")


@needs_rpc
def test_bench_records_the_workers(workers, target_model: Path, tmp_path: Path) -> None:
    (worker,) = workers(1)
    out = tmp_path / "bench.json"
    result = specdec(
        "bench", "-m", str(target_model), "-d", "ngram", "-k", "2", "-n", "8", "--repeat", "1",
        "--prompts", str(prompts(tmp_path)), "-t", "1", "--rpc", worker.endpoint,
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (recorded,) = json.loads(out.read_text())["settings"]["rpc"]
    assert recorded[0] == worker.endpoint  # the worker, and its device's memory
    assert isinstance(recorded[1], int)


def prompts(folder: Path) -> Path:
    path = folder / "prompts.txt"
    path.write_text("Once upon a time\n")
    return path
