"""Request checking for `specdec serve`, without a server: what a body turns into."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from specdec_cli.decoding.sampling import SamplingParams
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.models.chat import Message
from specdec_cli.serve.api import (
    ApiError,
    ServeOptions,
    Speculation,
    parse_body,
    parse_request,
)
from specdec_cli.serve.routes import Api
from specdec_cli.serve.service import Service

SERVER = SamplingParams(temp=0.7, top_k=7, top_p=0.9, min_p=0.1)


def test_fields_left_out_keep_the_servers_sampling() -> None:
    request = parse_request({"prompt": "x", "temperature": 0}, False, SERVER)
    assert request.sampling == SamplingParams(temp=0.0, top_k=7, top_p=0.9, min_p=0.1)
    assert request.max_tokens == -1 and request.seed is None and not request.stream
    request = parse_request({"prompt": "x", "top_k": 0, "top_p": 1, "min_p": 0}, False, SERVER)
    assert request.sampling == SamplingParams(temp=0.7, top_k=0, top_p=1.0, min_p=0.0)


def test_prompt_forms() -> None:
    assert parse_request({"prompt": "hi"}, False, SERVER).text == "hi"
    assert parse_request({"prompt": ["hi"]}, False, SERVER).text == "hi"
    assert parse_request({"prompt": [1, 2]}, False, SERVER).tokens == (1, 2)
    assert parse_request({"prompt": [[1, 2]]}, False, SERVER).tokens == (1, 2)


def test_chat_fields() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        "max_completion_tokens": 5,
        "stop": "END",
        "seed": -1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_request(body, True, SERVER)
    assert request.messages == (Message("system", "Be brief."), Message("user", "Hi"))
    assert request.max_tokens == 5 and request.stop == ("END",)
    assert request.seed == 2**64 - 1  # numpy takes seeds >= 0
    assert request.stream and request.include_usage


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, Speculation()),
        (True, Speculation()),
        (False, Speculation(enabled=False)),
        ({"k": 3}, Speculation(k="3")),
        ({"k": "auto"}, Speculation(k="auto")),
        ({"tree": 8}, Speculation(tree="8")),
        ({"k": 3, "tree": "auto"}, Speculation(k="3", tree="auto")),
        ({"tree": "off"}, Speculation(tree="off")),
    ],
)
def test_speculative_field(value: object, expected: Speculation) -> None:
    assert (
        parse_request({"prompt": "x", "speculative": value}, False, SERVER).speculation == expected
    )


@pytest.mark.parametrize(
    "body",
    [b"\xff", b"{", b"[]", b"[" * 50_000 + b"]" * 50_000, b'{"a": ' + b"1" * 5000 + b"}"],
)
def test_bodies_that_are_not_json_objects(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(body)
    assert caught.value.status == 400 and caught.value.body()["error"]["message"]


def test_health_and_generation_answer_503_while_loading(tmp_path: Path) -> None:
    """Before the models are loaded (the app's start-up, which loads them, is not run here)."""
    service = Service(EngineOptions(target=tmp_path / "model.gguf"), ServeOptions())
    client = TestClient(Api(service).app(on_loaded=lambda error: None))
    assert client.get("/health").status_code == 503
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"].isdigit()
    assert response.json()["error"]["code"] == "loading"
