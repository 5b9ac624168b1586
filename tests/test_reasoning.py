"""Thinking apart from the answer (--reasoning-format deepseek): the splitter on text cut
at every place, and the server's bodies, complete and streamed."""

from __future__ import annotations

import asyncio
import json

import pytest

from specdec_cli.decoding.pieces import Piece
from specdec_cli.decoding.stats import Stats
from specdec_cli.serve import service
from specdec_cli.serve.api import GenerationRequest
from specdec_cli.serve.reasoning import Split, ThinkingSplitter, opens_thinking
from specdec_cli.serve.reply import ReplyParser
from specdec_cli.serve.responses import Endpoint
from specdec_cli.serve.streaming import Answer

REPLY = "  <think>Two and two.\n</think>\n\nIt is 4 </thinking>."


def split_all(pieces: list[str], opened: bool = False) -> Split:
    splitter, out = ThinkingSplitter(opened), Split()
    for piece in [*pieces, None]:
        part = splitter.finish() if piece is None else splitter.feed(piece)
        out.reasoning += part.reasoning
        out.content += part.content
    return out


@pytest.mark.parametrize("cut", range(len(REPLY) + 1))
def test_a_reply_cut_anywhere_splits_the_same(cut: int) -> None:
    whole = split_all([REPLY])
    assert whole == Split("Two and two.\n", "It is 4 </thinking>.")
    assert split_all([REPLY[:cut], REPLY[cut:]]) == whole
    assert split_all(list(REPLY)) == whole  # a character at a time


def test_what_is_not_thinking_stays_content() -> None:
    assert split_all(["No <think> here"]) == Split("", "No <think> here")
    assert split_all(["<thin"]) == Split("", "<thin")  # ended before the marker was whole
    assert split_all(["<think>unfinished </thi"]) == Split("unfinished </thi", "")


def test_a_prompt_that_opens_the_thinking() -> None:
    """DeepSeek R1's template ends the prompt with <think>: the reply starts inside it."""
    assert opens_thinking("<｜Assistant｜><think>\n")  # noqa: RUF001
    assert not opens_thinking("<|im_start|>assistant\n")
    assert split_all(["Hm.</think>4"], opened=True) == Split("Hm.", "4")


def job_with(texts: list[str], opened: bool = False) -> service.Job:
    loop = asyncio.get_event_loop()
    request = GenerationRequest(chat=True, stream=True)
    job = service.Job(request, [], 0, loop, reply=ReplyParser(ThinkingSplitter(opened), None))
    for i, text in enumerate(texts):
        job.events.put_nowait(service.Chunk(Piece(text, i, "target"), 0, 0, i + 1))
    job.events.put_nowait(service.Finished(Stats(tokens=len(texts), stop_reason="eos")))
    return job


def test_server_bodies_carry_reasoning_content() -> None:
    endpoint = Endpoint(chat=True)
    pieces = ["<thi", "nk>Two and", " two.</th", "ink>4", "."]

    async def complete() -> dict:
        response = await Answer(job_with(pieces), endpoint, "m", None).body()
        return json.loads(response.body)

    async def stream() -> list[dict]:
        watcher = asyncio.get_event_loop().create_task(asyncio.sleep(0))
        answer = Answer(job_with(pieces), endpoint, "m", None)
        chunks = [c async for c in answer.stream(watcher)]
        events = [c.decode().removeprefix("data: ").strip() for c in chunks]
        return [json.loads(e) for e in events if e != "[DONE]"]

    message = asyncio.run(complete())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."}
    deltas = [c["choices"][0]["delta"] for c in asyncio.run(stream())]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content", "") for d in deltas) == "4."
    assert not any("<think>" in d.get("content", "") for d in deltas)
