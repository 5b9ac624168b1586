"""`specdec serve --mmproj` as clients see it: OpenAI's image_url parts (data: URLs) through
the model's chat template, answered as the image says, speculating, in four slots at once;
a conversation's second turn keeps its image's cells and encodes nothing; every bad part is
a 400 naming it, and the other slots go on."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from mtmdgen import COLORS, VisionPair, png, write_vision_pair
from test_mtmd import png_header, wav
from test_server import ServerProcess, start

from specdec_cli.llamacpp.model import Model

QUESTION = "What colour is it?"
N = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> VisionPair:
    return write_vision_pair(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pair: VisionPair) -> Iterator[ServerProcess]:
    """Four slots, a draft model that sees the text alone (the target's own file), and
    the lookup beside it."""
    args = ["-m", str(pair.target), "--mmproj", str(pair.mmproj), "-d", str(pair.target)]
    proc = start(tmp_path_factory.mktemp("serve"), *args, "-np", "4", "-k", "3", "-c", "1024")
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def image_part(data: bytes) -> dict[str, object]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def picture(colour: str) -> dict[str, object]:
    return image_part(png(16, 16, COLORS[colour]))


def question(colour: str | None) -> dict[str, object]:
    parts = [picture(colour)] if colour else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}


def expected(pair: VisionPair, colour: str | None, n: int = N) -> str:
    """What the test models answer (mtmdgen): the colour's word and its successors."""
    model = Model(pair.target, vocab_only=True)
    try:
        return b"".join(model.piece(t) for t in pair.greedy(colour, n)).decode()
    finally:
        model.close()


def ask(
    client: openai.OpenAI, messages: list[dict[str, object]], n: int = N
) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=n,
        temperature=0,  # type: ignore[arg-type]
    )


def test_four_slots_with_images_and_without(client: openai.OpenAI, pair: VisionPair) -> None:
    """Four requests at once, in four slots: each answered by its own image, or none."""
    colours = ["red", None, "blue", "red"]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda c: ask(client, [question(c)]), colours))
    assert [r.choices[0].message.content for r in replies] == [expected(pair, c) for c in colours]


def encoded(server: ServerProcess) -> int:
    metrics = httpx.get(f"{server.url}/metrics").text
    return int(re.search(r"^specdec:media_encoded_total (\d+)$", metrics, re.M)[1])


def test_a_second_turn_keeps_the_images_cells(
    client: openai.OpenAI, server: ServerProcess, pair: VisionPair
) -> None:
    """The second turn of a conversation about a green image (the first of any test)
    reuses its cells (cached tokens past the image) and encodes nothing."""
    before = encoded(server)
    first = [question(None)]
    first[0]["content"].insert(0, picture("green"))  # type: ignore[union-attr]
    reply = ask(client, first)
    assert encoded(server) == before + 1
    answer = reply.choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}]
    second.append({"role": "user", "content": "And now?"})
    again = ask(client, second)
    assert encoded(server) == before + 1
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= reply.usage.prompt_tokens - 1


def post(server: ServerProcess, content: list[dict[str, object]]) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


TEXT = {"type": "text", "text": QUESTION}


@pytest.mark.parametrize(
    ("part", "says"),
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "remote image URLs are not fetched",
        ),
        ({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "base64 data: URL"),
        ({"type": "image_url", "image_url": {"url": "data:;base64,@@@"}}, "not base64"),
        ({"type": "image_url"}, 'image_url has no "url" string'),
        (image_part(b"Hello, world"), "is not an image (PNG, JPEG, GIF or BMP)"),
        (image_part(png_header(9000, 9000)), "9000x9000 pixels, more than"),
        (image_part(png_header(16, 16)), "could not decode messages[0].content[1] as image"),
        (image_part(wav()), "is audio, sent as image_url"),
        (
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav()).decode(), "format": "wav"},
            },
            "is audio, but the projector mmproj.gguf takes images only",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}},
            "input_audio must be",
        ),
    ],
)
def test_a_bad_part_is_a_400_naming_it(
    server: ServerProcess, part: dict[str, object], says: str
) -> None:
    response = post(server, [TEXT, part])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"]
    assert (
        "messages[0].content[1]" in error["message"] or error["param"] == "messages[0].content[1]"
    )


def test_other_slots_go_on_past_bad_parts(
    client: openai.OpenAI, server: ServerProcess, pair: VisionPair
) -> None:
    """A long generation runs while bad parts are refused beside it; it ends as it would
    have."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(ask, client, [question("blue")], 200)
        for part in (image_part(b"GIF89a"), image_part(b"not an image")):
            assert post(server, [TEXT, part]).status_code == 400
        assert running.result().choices[0].message.content == expected(pair, "blue", 200)
    assert httpx.get(f"{server.url}/health").status_code == 200
