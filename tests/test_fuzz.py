"""A fuzzer for what reaches specdec from outside: request bodies for every endpoint of a
running `specdec serve`, and the values of `specdec run`'s flags, drawn by hypothesis.

Every answer is a 200, or a 4xx whose error names the field it refuses; never a 500, a
traceback in the server's log, or a stall of the other slots: a stream on another slot
goes on producing tokens while the hostile requests arrive. A fixed number of examples
and a fixed seed in CI (derandomized, so a failure reproduces); more with
SPECDEC_FUZZ_EXAMPLES=N.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_server import ROOT, ServerProcess, start

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 150,
    derandomize=True,  # the same examples on every run: a failure in CI reproduces here
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],  # no shrinking: minutes against a server
)
CLI_FUZZ = settings(FUZZ, max_examples=EXAMPLES or 20)  # each example is a process
CONTEXT = 1024  # every slot's together: a request without max_tokens ends soon
SLOW_SECONDS = 2.0  # a request that takes this long must not have stalled the stream


# --- values: each field's good ones, wrong ones and hostile ones ----------------------------

TEXT = st.text(max_size=40)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN and Infinity
    st.sampled_from([0, 1, -1, 0.5, 1e308, -0.0]),
)
ANY_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


def _nested(depth: int, opening: str, closing: str) -> str:
    return opening * depth + closing * depth


GRAMMARS = st.one_of(
    st.sampled_from(
        [
            'root ::= "yes" | "no"',
            "root ::= [a-z]+",
            "root ::= root",
            'root ::= "a" root',
            "start: /[0-9]+/",
            "root ::= " + "[" * 5000,
            'root ::= "' + '\\"' * 5000,
            "root ::= " + _nested(2000, "(", ")") + ' "x"',
            "root ::= %json {",
            'root ::= %json {"type": "object"}',
            "",
        ]
    ),
    TEXT.map(lambda body: "root ::= " + body),
    TEXT,
)
SCHEMAS = st.one_of(
    st.sampled_from(
        [
            {},
            {"type": "object"},
            {"type": "string", "enum": ["a", "b"]},
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"$ref": "#"},
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            },
            {"type": "array", "minItems": 10**9},
            {"type": 5},
            {"pattern": "("},
            True,
            False,
        ]
    ),
    st.integers(1, 600).map(lambda n: json.loads('{"items":' * n + "{}" + "}" * n)),
    ANY_JSON,
)
SPECULATIVE = st.one_of(
    st.booleans(),
    st.fixed_dictionaries(
        {},
        optional={
            "k": st.one_of(st.integers(-3, 40), st.just("auto"), TEXT, NUMBERS),
            "tree": st.one_of(st.integers(-3, 40), st.sampled_from(["off", "auto"]), TEXT),
        },
    ),
    ANY_JSON,
)
MAX_TOKENS = st.one_of(st.integers(0, 12), st.integers(-5, -1), NUMBERS, TEXT, st.none())
SAMPLING = {
    "temperature": st.one_of(st.floats(0, 2), NUMBERS, TEXT),
    "top_p": st.one_of(st.floats(0, 1), NUMBERS),
    "top_k": st.one_of(st.integers(0, 100), NUMBERS),
    "min_p": st.one_of(st.floats(0, 1), NUMBERS),
    "seed": st.one_of(st.integers(-1, 2**64), NUMBERS, TEXT),
}
COMMON = {
    "max_tokens": MAX_TOKENS,
    **SAMPLING,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=6), ANY_JSON),
    "stream": st.one_of(st.booleans(), ANY_JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), ANY_JSON),
    "speculative": SPECULATIVE,
    "n": st.one_of(st.integers(-1, 3), ANY_JSON),
    "grammar": GRAMMARS,
    "json_schema": SCHEMAS,
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}]),
        SCHEMAS.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
        ANY_JSON,
    ),
    "logit_bias": st.one_of(st.dictionaries(TEXT, NUMBERS, max_size=2), ANY_JSON),
    "presence_penalty": NUMBERS,
    "echo": st.booleans(),
    "post_sampling_probs": st.booleans(),
    "unknown_field": ANY_JSON,
}
TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "other"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "add", ""])},
            optional={"parameters": SCHEMAS, "description": TEXT},
        ),
    }
)
CONTENT = st.one_of(
    TEXT,
    st.none(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
            st.fixed_dictionaries(
                {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": TEXT})}
            ),
            ANY_JSON,
        ),
        max_size=3,
    ),
    ANY_JSON,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
        optional={"content": CONTENT, "tool_calls": ANY_JSON, "name": TEXT},
    ),
    ANY_JSON,
)
CHAT = {
    **COMMON,
    "messages": st.one_of(
        st.lists(MESSAGE, min_size=1, max_size=4),
        st.just([{"role": "user", "content": "Once upon a time"}]),
        ANY_JSON,
    ),
    "tools": st.one_of(st.lists(TOOL, max_size=3), ANY_JSON),
    "tool_choice": st.one_of(
        st.sampled_from(["auto", "none", "required", "x"]),
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}
        ),
        ANY_JSON,
    ),
    "parallel_tool_calls": st.one_of(st.booleans(), ANY_JSON),
    "logprobs": st.one_of(st.booleans(), ANY_JSON),
    "top_logprobs": st.one_of(st.integers(-2, 25), ANY_JSON),
    "chat_template_kwargs": st.one_of(st.dictionaries(TEXT, ANY_JSON, max_size=3), ANY_JSON),
    "max_completion_tokens": MAX_TOKENS,
}
COMPLETION = {
    **COMMON,
    "prompt": st.one_of(
        TEXT,
        st.just("Once upon a time"),
        st.lists(st.integers(-5, 600), max_size=8),
        st.lists(TEXT, max_size=3),
        ANY_JSON,
    ),
    "logprobs": st.one_of(st.integers(-2, 25), ANY_JSON),
    "suffix": TEXT,
}


def bodies(fields: dict[str, st.SearchStrategy], required: str) -> st.SearchStrategy:
    """Bodies of up to six fields, nearly always with the required one, each field drawn
    from its good, wrong and hostile values."""
    others = sorted(set(fields) - {required})
    names = st.tuples(
        st.sampled_from([[required]] * 9 + [[]]),
        st.lists(st.sampled_from(others), max_size=5, unique=True),
    ).map(lambda parts: parts[0] + parts[1])
    return names.flatmap(lambda chosen: st.fixed_dictionaries({n: fields[n] for n in chosen}))


REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
REQUESTS = st.one_of(
    *(
        st.tuples(st.just(path), bodies(fields, REQUIRED[path]))
        for path, fields in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT))
    ),
)


# --- the server and a stream beside the fuzzing ---------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(
    tmp_path_factory: pytest.TempPathFactory, target_model: Path
) -> Iterator[ServerProcess]:
    """Two slots: one for the stream that must go on, one for what the fuzzer sends."""
    args = ["-m", str(target_model), "-d", "ngram", "-np", "2", "-c", str(CONTEXT)]
    args += ["--tree", "8", "--chat-template", "chatml"]
    proc = start(tmp_path_factory.mktemp("serve-fuzz"), *args)
    yield proc
    assert proc.stop() == 0, proc.output()


class Stream(threading.Thread):
    """Streams one greedy completion after another, noting when each chunk arrives."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.arrivals: list[float] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
        try:
            with httpx.Client(base_url=self.url, timeout=120) as http:
                while not self.stopping.is_set():
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                self.arrivals.append(time.monotonic())
                            if self.stopping.is_set():
                                return
        except BaseException as error:  # reported by the test, not lost in a thread
            self.error = error

    def produced_during(self, begin: float, end: float) -> bool:
        return any(begin <= at <= end for at in self.arrivals)


@pytest.fixture(scope="module")
def stream(fuzz_server: ServerProcess) -> Iterator[Stream]:
    beside = Stream(fuzz_server.url)
    beside.start()
    yield beside
    beside.stopping.set()
    beside.join(timeout=120)


@pytest.fixture(scope="module")
def http(fuzz_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=300) as client:
        yield client


def field_of(param: str) -> str:
    """The body's top-level field that an error's param names ("messages[0].content",
    "stream_options.include_usage", "speculative.k")."""
    return param.split(".")[0].split("[")[0]


def check_answer(path: str, body: dict[str, Any], response: httpx.Response) -> None:
    status = response.status_code
    assert status == 200 or 400 <= status < 500, (status, body, response.text[:500])
    if status == 200:
        return
    error = response.json()["error"]
    message, param = error["message"], error.get("param")
    assert message and "\n" not in message and "Traceback" not in message, error
    assert param is not None and field_of(param) in {*body, REQUIRED[path]}, (body, error)


@FUZZ
@given(request=REQUESTS)
def test_every_request_gets_a_200_or_a_4xx_naming_its_field(
    http: httpx.Client, stream: Stream, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    data = json.dumps(body, allow_nan=True).encode()  # Python's NaN and Infinity included
    begin = time.monotonic()
    response = http.post(path, content=data, headers={"Content-Type": "application/json"})
    end = time.monotonic()
    check_answer(path, body, response)
    if end - begin > SLOW_SECONDS:  # a slow answer: the other slot must have gone on
        assert stream.produced_during(begin, end), (path, body, end - begin)


def test_the_server_is_whole_after_the_fuzzing(
    fuzz_server: ServerProcess, http: httpx.Client, stream: Stream
) -> None:
    """Runs after the fuzzing (pytest keeps a module's order): healthy, answering, the
    stream beside it never broken, and no traceback in its log."""
    assert stream.error is None, repr(stream.error)
    assert stream.arrivals, "the stream beside the fuzzing produced nothing"
    assert http.get("/health").json() == {"status": "ok"}
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    log = fuzz_server.output()
    assert "Traceback" not in log and "Internal Server Error" not in log, log[-3000:]


# --- the command line's flags -------------------------------------------------------------

FLAG_VALUES: dict[str, st.SearchStrategy[str]] = {
    "-k": st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["auto", "1,2", "x", "", "1e9"])),
    "--tree": st.one_of(st.integers(-3, 300).map(str), st.sampled_from(["off", "auto", "x"])),
    "--grammar": GRAMMARS.filter(lambda g: "\x00" not in g),
    "--logprobs": st.one_of(st.integers(-3, 300000).map(str), st.sampled_from(["x", "1.5"])),
    "-c": st.one_of(st.integers(-5, 10**7).map(str), st.sampled_from(["0", "x", "1e3"])),
    "-n": st.one_of(st.integers(-3, 64).map(str), st.just("x")),
    "--temp": st.one_of(st.floats(-2, 5).map(str), st.sampled_from(["nan", "inf", "x"])),
    "--seed": st.one_of(st.integers(-(2**70), 2**70).map(str), st.just("x")),
    "--draft-max": st.one_of(st.integers(-3, 100).map(str)),
}


@CLI_FUZZ
@given(
    flags=st.dictionaries(
        st.sampled_from(sorted(FLAG_VALUES)), st.none(), min_size=1, max_size=3
    ).flatmap(lambda chosen: st.fixed_dictionaries({f: FLAG_VALUES[f] for f in chosen})),
    schema=st.one_of(st.none(), SCHEMAS),
)
def test_run_flags_give_an_answer_or_one_line(
    target_model: Path, tmp_path_factory: pytest.TempPathFactory, flags: dict[str, str], schema: Any
) -> None:
    """Whatever the values: exit 0 with text, or exit 2 with one line that says what is
    wrong; never a traceback, a crash (llama.cpp aborting) or a hang."""
    args = ["run", "-m", str(target_model), "-d", "ngram", "-p", "Once upon a time", "-q"]
    args += ["-t", "1", "-fa", "off", "--temp", "0", "-n", "8"]
    for flag, value in flags.items():
        args += [flag, value]
    if schema is not None:
        path = tmp_path_factory.mktemp("schema") / "schema.json"
        path.write_text(json.dumps(schema, allow_nan=True))
        args += ["--json-schema-file", str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "specdec_cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert "Traceback" not in result.stderr, (args, result.stderr[-2000:])
    assert result.returncode in (0, 2), (args, result.returncode, result.stderr[-2000:])
    if result.returncode == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (args, result.stderr)
