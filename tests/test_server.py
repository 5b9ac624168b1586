"""`specdec serve` as clients see it: a real server process on 127.0.0.1, driven by the
official openai client and by raw HTTP for what a well-behaved client never sends."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.sampling import GREEDY, SamplingParams
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.decoding.stats import Stats

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
ORIGIN = "http://page.example"
PROMPT = "Once upon a time"
N = 12  # tokens per request: small, the server's tests must stay quick
STARTUP_SECONDS = 180  # loading, and measuring on a loaded machine the first time
# One thread each: two processes running llama.cpp's thread pools (the server, and this
# one's reference engine) slow each other down badly on a small machine. Few draft
# lengths to measure costs for, and flash attention as given: a quick start-up.
LONG_CONTEXT = 2048
QUICK = ("-t", "1", "-td", "1", "-fa", "off", "--draft-max", "4")


class ServerProcess:
    """`specdec serve` in a child process, its output in a file (a pipe could fill up)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        command = [sys.executable, "-m", "specdec_cli", "serve", "--port", str(self.port)]
        command += [*QUICK, *args]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited ({self.process.returncode}): {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"the server was not ready in {STARTUP_SECONDS}s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(tmp: Path, *args: str) -> ServerProcess:
    server = ServerProcess(tmp, *args)
    try:
        server.wait_ready()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, target_model: Path, draft_model: Path
) -> Iterator[ServerProcess]:
    """With a draft model, an API key, CORS for one origin, and a chat format."""
    args = ["-m", str(target_model), "-d", str(draft_model), "--api-key", KEY, "--tree", "8"]
    args += ["--cors", ORIGIN, "--chat-template", "chatml", "--alias", "tiny"]
    proc = start(tmp_path_factory.mktemp("serve"), *args)
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def plain_server(
    tmp_path_factory: pytest.TempPathFactory, target_model: Path
) -> Iterator[ServerProcess]:
    """N-gram lookup only, no key, no CORS, one slot and nobody may wait for it, and a
    long context: a generation that fills it lasts long enough to be interrupted. Greedy
    unless asked: the page sends no temperature, and a sampled reply (a random seed)
    sometimes accepted no draft token at all."""
    args = ["-m", str(target_model), "-d", "ngram", "-np", "1", "--queue", "0"]
    args += ["--chat-template", "chatml"]
    args += ["-c", str(LONG_CONTEXT), "--temp", "0"]
    proc = start(tmp_path_factory.mktemp("serve-plain"), *args)
    yield proc
    assert proc.stop(signal.SIGINT) == 0, proc.output()  # Ctrl-C: as SIGTERM


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(target_model: Path) -> Iterator:
    """The engine's own greedy text for a prompt: target alone, as `specdec run --temp 0`."""
    options = EngineOptions(target=target_model, sampling=GREEDY, threads=1, flash_attn="off")
    with Engine(options) as engine:

        def text(prompt: str, n: int = N) -> str:
            tokens = engine.tokenize(prompt)
            return "".join(
                p.text for p in engine.pieces(tokens, n, np.random.default_rng(0), Stats())
            )

        yield text


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_greedy_completion_is_the_engines(client: openai.OpenAI, greedy) -> None:
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0)
    assert out.choices[0].text == greedy(PROMPT)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == N
    assert out.object == "text_completion"


def test_stream_concatenates_to_the_text(client: openai.OpenAI, greedy) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy(PROMPT)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


def test_seeded_sampling_is_the_same_streamed_or_not(client: openai.OpenAI) -> None:
    """Per-request temperature, seed and draft length: the same seed, the same text."""
    asked = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=N,
        temperature=1.0,
        seed=7,
        extra_body={"speculative": {"k": 3}},
    )
    whole = client.chat.completions.create(**asked)
    streamed = client.chat.completions.create(**asked, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"


def test_a_seeded_sampled_text_does_not_depend_on_its_drafts(
    client: openai.OpenAI, target_model: Path
) -> None:
    """With several slots a sampled request is coupled (SamplingParams.coupled): for a
    seed, the same text whatever it drafts, and the target's alone (`run --coupled`)."""
    texts = [
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=N,
            temperature=1.0,
            seed=5,
            extra_body={"speculative": {"k": k}},
        )
        .choices[0]
        .text
        for k in (1, 3)
    ]
    sampling = SamplingParams(temp=1.0, coupled=True)
    options = EngineOptions(target=target_model, sampling=sampling, threads=1, flash_attn="off")
    with Engine(options) as engine:
        rng, prompt = np.random.default_rng(5), engine.tokenize(PROMPT)
        alone = "".join(p.text for p in engine.pieces(prompt, N, rng, Stats()))
    assert texts == [alone, alone]


def test_sampling_settings_are_per_request(http: httpx.Client, greedy) -> None:
    """top_k 1 samples the argmax at any temperature: greedy text, though the server
    samples at 0.8 with top-k 40 by default; and with speculation off nothing is drafted."""
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 1.5, "top_k": 1, "seed": 1}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == greedy(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "speculative": False}
    out = http.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == greedy(PROMPT)
    assert out["timings"]["draft_n"] == 0 and out["timings"]["predicted_n"] == N


def test_speculative_figures_and_stop(http: httpx.Client, greedy) -> None:
    expected = greedy(PROMPT, 2 * N)
    body = {"prompt": PROMPT, "max_tokens": 2 * N, "temperature": 0, "speculative": {"k": 4}}
    timings = http.post("/v1/completions", json=body).json()["timings"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert timings["tokens_per_pass"] == pytest.approx(2 * N / timings["target_passes"])
    stop = expected[len(expected) // 2 :][:3]
    out = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == expected[: expected.index(stop)]


def test_a_request_drafts_a_tree(http: httpx.Client, greedy) -> None:
    """Per request, a tree as wide as the server was started with: the same greedy text,
    with more tokens drafted per round than the chain of the same k."""
    body = {"prompt": PROMPT, "max_tokens": 2 * N, "temperature": 0}
    chain = http.post("/v1/completions", json={**body, "speculative": {"k": 3, "tree": "off"}})
    beside_before = metric(http, "specdec:spec_decode_num_accepted_beside_chain_total")
    tree = http.post("/v1/completions", json={**body, "speculative": {"k": 3, "tree": 8}})
    assert tree.json()["choices"][0]["text"] == greedy(PROMPT, 2 * N)
    per_round = [
        r.json()["timings"]["draft_n"] / r.json()["timings"]["target_passes"] for r in (chain, tree)
    ]
    assert tree.json()["timings"]["tree"] == "8"
    assert per_round[1] > per_round[0]
    # What the branches won is reported per request and counted in /metrics.
    assert chain.json()["timings"]["accepted_beside_chain"] == 0
    beside = tree.json()["timings"]["accepted_beside_chain"]
    assert metric(http, "specdec:spec_decode_num_accepted_beside_chain_total") == (
        beside_before + beside
    )


def test_stream_chunks_say_where_their_tokens_came_from(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3 * N, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json={**body, "speculative": {"k": 4}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    figures = [c["specdec"] for c in chunks if "specdec" in c]
    assert {f["source"] for f in figures} == {"draft", "target"}  # ~60% of drafts accepted
    assert figures[-1]["draft_n_accepted"] == chunks[-1]["timings"]["draft_n_accepted"]


def test_multi_turn_chat_reuses_the_cached_prefix(http: httpx.Client) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = http.post("/v1/chat/completions", json={"messages": turns, "max_tokens": N}).json()
    turns += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    second = http.post("/v1/chat/completions", json={"messages": turns, "max_tokens": N}).json()
    # The whole first prompt is still in the cache, and the reply after it (give or take
    # the tokens where its text meets the next turn's markers).
    assert second["timings"]["cache_n"] >= first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["timings"]["cache_n"]
    assert (
        second["timings"]["prompt_n"]
        == second["usage"]["prompt_tokens"] - second["timings"]["cache_n"]
    )


def test_concurrent_streams_each_get_their_own_text(server: ServerProcess, greedy) -> None:
    """8 clients, 32 streamed requests in all: every one complete, none mixed with another."""
    prompts = [f"{PROMPT} {word} {i}" for i, word in enumerate(["cat", "dog", "sun", "sea"] * 8)]

    def ask(prompt: str) -> str:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == [greedy(p, 6) for p in prompts]


def test_slots_and_metrics_agree_with_what_was_sent(http: httpx.Client) -> None:
    """4 requests at once on a server of 4 slots: /metrics counts them, their tokens and
    the decode calls that held several slots; /slots shows every slot idle again."""
    names = ["requests_total", "generation_tokens_total", "decode_total"]
    before = {name: metric(http, f"specdec:{name}") for name in names}

    def ask(i: int) -> int:
        body = {"prompt": f"{PROMPT} {i}", "max_tokens": 12, "temperature": 0}
        return http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as pool:
        tokens = sum(pool.map(ask, range(4)))
    assert wait_for_metric(http, "specdec:requests_total", before["requests_total"] + 4)
    assert (
        metric(http, "specdec:generation_tokens_total")
        == before["generation_tokens_total"] + tokens
    )
    assert metric(http, "specdec:decode_total") > before["decode_total"]
    assert metric(http, "specdec:n_busy_slots_per_decode") > 1.0  # some calls held several
    assert metric(http, "specdec:requests_processing") == 0
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["state"] == "idle" and s["n_ctx"] > 0 for s in slots)
    assert sum(s["n_cached"] > 0 for s in slots) >= 2  # the requests went to several slots


BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/completions", b""),
    ("/v1/completions", b"{"),
    ("/v1/completions", b"not json"),
    ("/v1/completions", b"\xff\xfe\x00garbage"),
    ("/v1/completions", b'{"prompt": "caf\xe9"}'),  # Latin-1, not UTF-8
    ("/v1/completions", b"[1, 2, 3]"),
    ("/v1/completions", b"null"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),  # > int digits
    ("/v1/completions", b'{"prompt": "\\ud800"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
]
BAD_FIELDS: list[tuple[str, dict]] = [
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": None}),
    ("/v1/completions", {"prompt": 42}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"prompt": [1, "a"]}),
    ("/v1/completions", {"prompt": [10**9]}),
    ("/v1/completions", {"prompt": [-1]}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "x", "top_p": 2}),
    ("/v1/completions", {"prompt": "x", "top_k": -3}),
    ("/v1/completions", {"prompt": "x", "min_p": -0.1}),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}),
    ("/v1/completions", {"prompt": "x", "stop": 5}),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 100}),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": []}),
    ("/v1/completions", {"prompt": "x", "n": 2}),
    ("/v1/completions", {"prompt": "x", "best_of": 3}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "echo": True}),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100}}),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1}),
    ("/v1/completions", {"prompt": "x", "speculative": {"k": 0}}),
    ("/v1/completions", {"prompt": "x", "speculative": {"k": "many"}}),
    ("/v1/completions", {"prompt": "x", "speculative": {"draft": 3}}),
    ("/v1/completions", {"prompt": "x", "speculative": 3}),
    ("/v1/completions", {"prompt": "x", "speculative": {"tree": 1}}),
    ("/v1/completions", {"prompt": "x", "speculative": {"tree": "wide"}}),
    ("/v1/completions", {"prompt": "x", "speculative": {"tree": 9}}),  # the server drafts 8
    ("/v1/completions", {"prompt": "story " * 400}),  # longer than the context (256)
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": ["hi"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
        },
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long " * 400}]}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    ),
]


# Values of the wrong type or out of range for each field, for the seeded mix below.
WRONG_VALUES: dict[str, list[object]] = {
    "prompt": [5, {"a": 1}, [1.5], [[]]],
    "max_tokens": ["10", [], {"a": 1}, 1.5],
    "temperature": ["hot", [], {}, -1],
    "top_p": ["x", [], {}],
    "top_k": ["x", [], 1.5],
    "min_p": ["x", [], {}],
    "stop": [5, [1, 2], {"a": 1}],
    "seed": ["x", 1.5, []],
    "stream": ["yes", [], {}],
    "speculative": ["x", [], {"k": -3}],
    "logprobs": ["x", True, 1.5, 21, -1],
}


def mixed_bad_requests(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """n requests, each a good completion body with one field made wrong, or bytes
    that are no JSON at all: drawn from a seeded generator, so a failure reproduces."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.2:
            out.append(("/v1/completions", bytes(rng.randrange(256) for _ in range(40))))
            continue
        field = rng.choice(sorted(WRONG_VALUES))
        body = {"prompt": PROMPT, "max_tokens": 4, field: rng.choice(WRONG_VALUES[field])}
        out.append(("/v1/completions", json.dumps(body).encode()))
    return out


def fields_of(body: bytes) -> set[str]:
    """A body's top-level fields, where it is a JSON object."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's parser
        return set()
    return set(value) if isinstance(value, dict) else set()


def test_malformed_requests_get_4xx_and_the_server_goes_on(http: httpx.Client) -> None:
    requests = [(path, body) for path, body in BAD_BODIES]
    requests += [(path, json.dumps(fields).encode()) for path, fields in BAD_FIELDS]
    requests += mixed_bad_requests(200 - len(requests))
    headers = {"Content-Type": "application/json"}
    for path, body in requests:
        response = http.post(path, content=body, headers=headers)
        assert 400 <= response.status_code < 500, (path, body[:80], response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"], (path, body[:80])
        fields = fields_of(body)
        if fields:  # a JSON object: the error names the field it refuses
            required = "messages" if path.endswith("chat/completions") else "prompt"
            named = (error["param"] or "").split(".")[0].split("[")[0]
            assert named in {*fields, required}, (path, body[:200], error)
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/no/such/path").status_code == 404
    assert http.get("/health").json() == {"status": "ok"}
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_an_image_to_a_server_without_a_projector(http: httpx.Client) -> None:
    """A 400 naming the part (test_serve_vision has a server that takes images)."""
    url = "data:image/gif;base64," + base64.b64encode(b"GIF89a\x10\x00\x10\x00").decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert "takes no images or audio (it was started without --mmproj)" in error["message"]


def test_huge_max_tokens_stops_at_the_context(http: httpx.Client) -> None:
    body = {"prompt": "story " * 44, "max_tokens": 10**30, "temperature": 0}  # ~220 tokens
    out = http.post("/v1/completions", json=body).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == 256  # the context, full


def test_api_key_on_every_endpoint_but_health(server: ServerProcess) -> None:
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(server.url + path, headers=wrong).status_code == 401
    no_key = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_models_metrics_and_page(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    metrics = http.get("/metrics").text
    for name in (
        "requests_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_per_output_token_seconds_count",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):
        assert f"\nspecdec:{name} " in metrics
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert values["specdec:requests_total"] > 0
    per_position = sum(v for k, v in values.items() if "accepted_tokens_per_pos" in k)
    assert per_position == values["specdec:spec_decode_num_accepted_tokens_total"] > 0
    page = httpx.get(http.base_url.join("/")).text  # no key needed: the page asks for it
    assert "<script>" in page and "tiny" in page and "src=" not in page and "href=" not in page


def test_cors_only_for_the_origin_given(server: ServerProcess, plain_server: ServerProcess) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert allowed.headers.get("access-control-allow-origin") == ORIGIN
    other = {**preflight, "Origin": "http://elsewhere.example"}
    assert (
        "access-control-allow-origin"
        not in httpx.options(f"{server.url}/v1/completions", headers=other).headers
    )
    plain = httpx.get(f"{plain_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_busy_then_a_disconnect_stops_the_generation(plain_server: ServerProcess) -> None:
    """-np 1 --queue 0: a second request while one streams gets 503 with Retry-After; the first
    client hangs up and its generation stops (it asked for the whole context)."""
    url = plain_server.url
    with httpx.Client(timeout=60) as first:
        body = {"prompt": PROMPT, "temperature": 0, "stream": True}
        with first.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: closing it would close the response
            next(lines)  # generating now
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            assert busy.status_code == 503 and busy.headers["retry-after"].isdigit()
            assert busy.json()["error"]["code"] == "server_busy"
    assert wait_for_metric(url, "specdec:requests_cancelled_total", 1.0)
    generated = metric(url, "specdec:generation_tokens_total")
    assert 0 < generated < LONG_CONTEXT - 10
    again = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert again.status_code == 200


def metric(server: str | httpx.Client, name: str) -> float:
    """One unlabelled sample of /metrics, from a server's URL or a client (with its key)."""
    get = server.get if isinstance(server, httpx.Client) else httpx.Client(base_url=server).get
    for line in get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for_metric(url: str, name: str, value: float, seconds: float = 60) -> bool:
    """Poll /metrics until `name` reaches `value` (a deadline, not a timing claim)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metric(url, name) >= value:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_ends_streams_with_a_last_chunk_and_exits_0(
    tmp_path: Path, target_model: Path
) -> None:
    proc = start(tmp_path, "-m", str(target_model), "-d", "ngram", "-c", str(LONG_CONTEXT))
    try:
        body = {"prompt": PROMPT, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.process.send_signal(signal.SIGTERM)
            events = [first[6:], *(line[6:] for line in lines if line.startswith("data: "))]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "stop"
        assert last["timings"]["predicted_n"] < LONG_CONTEXT - 10
        assert proc.process.wait(timeout=60) == 0, proc.output()
    finally:
        proc.stop(signal.SIGKILL)


def test_a_taken_port_is_refused_in_one_line(target_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec_cli",
                "serve",
                "-m",
                str(target_model),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    assert result.returncode == 2
    assert result.stderr.startswith("specdec: error: cannot listen on 127.0.0.1:")
    assert "Traceback" not in result.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    it reads commands on fd 3 and answers on fd 4, NUL-terminated JSON), no extra package."""

    def __init__(self, binary: str) -> None:
        self._commands_in, self._commands = os.pipe()
        self._answers, self._answers_out = os.pipe()
        child_fds = (self._commands_in, self._answers_out)

        def on_fds_3_and_4() -> None:
            os.dup2(child_fds[0], 3)
            os.dup2(child_fds[1], 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe"]
        self.process = subprocess.Popen(
            [binary, *flags, "about:blank"],
            preexec_fn=on_fds_3_and_4,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(self._commands_in)
        os.close(self._answers_out)
        self._next_id = 0
        self._buffer = b""
        self.session: str | None = None

    def send(self, method: str, **params: object) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._read()
            if answer.get("id") == self._next_id:
                assert "error" not in answer, answer
                return answer["result"]

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            data = os.read(self._answers, 1 << 16)
            assert data, "chromium closed its DevTools pipe"
            self._buffer += data
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", url=url)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def evaluate(self, expression: str) -> object:
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def close(self) -> None:
        self.session = None
        with contextlib.suppress(AssertionError, OSError):  # it may be gone already
            self.send("Browser.close")
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._commands)
        os.close(self._answers)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_page_streams_a_reply_with_draft_tokens_coloured(
    plain_server: ServerProcess, tmp_path: Path
) -> None:
    """The page in headless Chromium: ?prompt= sends at once. After the streamed reply,
    the DOM holds it as spans marked draft or target, and the final figures."""
    browser = Browser(CHROMIUM)
    try:
        prompt = "Once upon a time there was a ball. Once upon a time there was a ball."
        browser.open(f"{plain_server.url}/?max_tokens=64&prompt={prompt.replace(' ', '%20')}")
        deadline = time.monotonic() + 60
        done = 'document.getElementById("stats").dataset.done === "1"'
        while not browser.evaluate(done) and time.monotonic() < deadline:
            time.sleep(0.2)
        spans = browser.evaluate(
            'Array.from(document.querySelectorAll(".assistant span"), s => s.className)'
        )
        stats = browser.evaluate('Object.assign({}, document.getElementById("stats").dataset)')
        text = browser.evaluate('document.getElementById("stats").textContent')
        shot = browser.send("Page.captureScreenshot", format="png")["data"]
        (tmp_path / "page.png").write_bytes(base64.b64decode(shot))  # to look at, if need be
    finally:
        browser.close()
    assert stats["done"] == "1", text
    assert set(spans) == {"draft", "target"}  # n-gram lookup drafts on a repeated prompt
    assert int(stats["tokens"]) == 64 and 0 < int(stats["accepted"]) <= int(stats["drafted"])
    assert "tok/s" in text and f"accepted {stats['accepted']}/{stats['drafted']}" in text
