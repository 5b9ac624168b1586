"""Tool calls: each format parsed whole and streamed in pieces cut anywhere, and a round
trip through the official `openai` client against a real `specdec serve`, with a model
whose text the test writes (ggufgen.scripted_model), speculation on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from ggufgen import scripted_model
from test_server import ServerProcess, start

from specdec_cli.llamacpp.model import Model
from specdec_cli.models import chat
from specdec_cli.models.chat import ChatFormat, Message
from specdec_cli.serve.toolcalls import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolCallParser,
    format_for,
)

ARGS = {"city": "Paris"}
CALLS = {
    HERMES: 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>",
    MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    GENERIC: '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
}


def parse(kind: str, pieces: list[str]) -> tuple[str, list]:
    parser = ToolCallParser(kind)
    shown = "".join(parser.feed(piece) for piece in pieces)
    end = parser.finish()
    return shown + end.content, end.calls


@pytest.mark.parametrize("kind", list(CALLS))
def test_each_format_whole_and_cut_anywhere(kind: str) -> None:
    text = CALLS[kind]
    for cut in range(len(text) + 1):
        content, calls = parse(kind, [text[:cut], text[cut:]])
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
        assert content == ("Let me look.\n" if kind == HERMES else "")
    assert parse(kind, list(text))[1]  # a character at a time


def test_python_tag_and_parallel_calls() -> None:
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert [c.name for c in parse(LLAMA3, [tagged])[1]] == ["get_weather"]
    two = CALLS[HERMES] + CALLS[HERMES].removeprefix("Let me look.\n")
    assert len(parse(HERMES, [two])[1]) == 2
    parser = ToolCallParser(HERMES, parallel=False)
    parser.feed(two)
    assert len(parser.finish().calls) == 1


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        (HERMES, "A plain answer, with < and <tool in it."),
        (GENERIC, '{"not": "a call"}'),
        (LLAMA3, "{broken json"),
        (HERMES, "<tool_call>not json</tool_call>"),
    ],
)
def test_text_that_is_not_a_call_is_content(kind: str, text: str) -> None:
    assert parse(kind, [text]) == (text, [])
    assert parse(kind, list(text)) == (text, [])


def test_the_format_comes_from_the_template() -> None:
    templates = Path(__file__).parent / "data" / "templates"
    assert format_for((templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()) == HERMES
    nemo = templates / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    assert format_for(nemo.read_text()) == MISTRAL
    llama = templates / "meta-llama-Llama-3.1-8B-Instruct.jinja"
    assert format_for(llama.read_text()) == LLAMA3
    assert format_for("chatml") == GENERIC


# --- a round trip through the openai client ------------------------------------------------

CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER = " It is sunny."  # a user-defined piece is written as it is (no ▁)
# A template in Hermes' style: tools up front, calls written back as <tool_call>, and a
# reply after a tool's answer that starts with "Answer:" (so this model's next words
# differ: it sees only its last token).
TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools|tojson }}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function|tojson }}</tool_call>{% endfor %}"
    "{{ m.content }}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if messages[-1].role == 'tool' %}Answer:{% endif %}{% endif %}"
)
PIECES = ["<|tools|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<tool_call>",
          "</tool_call>", CALL_JSON, "Answer:", ANSWER]  # fmt: skip
SCRIPT = {
    "<|assistant|>": "<tool_call>",
    "<tool_call>": CALL_JSON,
    CALL_JSON: "</tool_call>",
    "Answer:": ANSWER,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "scripted.gguf"
    # The call's markers are control tokens, as Llama's <|python_tag|> and Mistral's
    # [TOOL_CALLS] are: the reply must keep their text for the parser to see the call.
    return scripted_model(path, PIECES, SCRIPT, TEMPLATE, controls=["<tool_call>", "</tool_call>"])


@pytest.fixture(scope="module")
def tool_server(
    tmp_path_factory: pytest.TempPathFactory, tool_model: Path
) -> Iterator[ServerProcess]:
    proc = start(tmp_path_factory.mktemp("serve-tools"), "-m", str(tool_model), "-d", "ngram")
    yield proc
    assert proc.stop() == 0, proc.output()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def test_a_tool_round_trip_through_the_openai_client(
    tool_server: ServerProcess, tool_model: Path
) -> None:
    client = client_of(tool_server)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(
        model="m", messages=question, tools=[WEATHER], temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)
    assert choice.message.content is None

    # The call and the tool's answer go back into the template on the next turn.
    history = [
        *question,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], temperature=0
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == " It is sunny."
    assert not second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens == prompt_tokens(tool_model, history)


def prompt_tokens(model_path: Path, history: list[dict]) -> int:
    """What the second turn's prompt should count, rendered here from the same messages."""
    model = Model(model_path, vocab_only=True)
    try:
        messages = list(chat.messages_from(history, "test"))
        text = chat.render(model, messages, ChatFormat(), [WEATHER])
        # The call, written back; its arguments an object again, not a JSON string.
        assert '"name": "get_weather"' in text and '"arguments": {"city": "Paris"}' in text
        assert text.endswith("<|tool|>" + '{"sky": "clear"}' + "<|end|><|assistant|>Answer:")
        return len(chat.chat_tokens(model, text))
    finally:
        model.close()


def test_streamed_tool_calls_assemble_as_the_client_does(tool_server: ServerProcess) -> None:
    stream = client_of(tool_server).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", ARGS)
    ]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_and_bad_tools(tool_server: ServerProcess) -> None:
    client = client_of(tool_server)
    plain = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
    )
    # No tools in the prompt; the model still writes its call text, which is no call.
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\] is not"):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], tools=[{"type": "x"}]
        )


def test_messages_with_calls_render_their_arguments_as_objects() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    message = Message("assistant", "", (call,))
    assert message.as_dict()["tool_calls"][0]["function"]["arguments"] == {"a": 1}


# --- tool_choice enforced after the thoughts -------------------------------------------------

THOUGHT = "Let me see."
PROSE = "It is sunny."  # what the model says when nothing makes it call
# A Hermes template that thinks: the generation prompt opens the block ("open"), or the
# template only knows the markers (it writes a past reply's thoughts back) and the model
# opens the block itself ("optional").
THINKING_TEMPLATES = {
    "open": TEMPLATE.replace("<|assistant|>{% if messages", "<|assistant|><think>{% if messages"),
    "optional": TEMPLATE.replace(
        "{% for c in m.tool_calls",
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{% for c in m.tool_calls",
    ),
}
THINKING_SCRIPT = {
    "<|assistant|>": "<think>",  # "optional": the model opens the block itself
    "<think>": THOUGHT,
    "<tool_call>": CALL_JSON,
    CALL_JSON: "</tool_call>",
}
# The end marker a token of its own (a special token, to llguidance), or the end of a
# thought's text, which the grammar must find inside a token.
END_MARKERS = {
    "token": {THOUGHT: "</think>", "</think>": PROSE},
    "text": {THOUGHT: PROSE + "</think>", PROSE + "</think>": PROSE},
}


@pytest.fixture(
    scope="module",
    params=[("open", "token"), ("open", "text"), ("optional", "token")],
    ids=lambda p: "-".join(p),
)
def thinking_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    opening, end = request.param
    script = THINKING_SCRIPT | END_MARKERS[end]
    pieces = [*PIECES, "<think>", THOUGHT, PROSE, *script.values()]
    folder = tmp_path_factory.mktemp("serve-thinking")
    path = scripted_model(
        folder / "thinking.gguf",
        list(dict.fromkeys(pieces)),
        script,
        THINKING_TEMPLATES[opening],
        controls=["<tool_call>", "</tool_call>"],
    )
    proc = start(folder, "-m", str(path), "-d", "ngram")
    yield proc
    assert proc.stop() == 0, proc.output()


def test_tool_choice_required_is_enforced_after_the_thoughts(
    thinking_server: ServerProcess,
) -> None:
    """Left to itself the model thinks, then answers in prose; with tool_choice required or
    the function named, it thinks as freely, then calls."""
    client = client_of(thinking_server)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    free = client.chat.completions.create(model="m", messages=question, tools=[WEATHER])
    assert not free.choices[0].message.tool_calls
    assert free.choices[0].message.content.startswith(PROSE)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        reply = client.chat.completions.create(
            model="m", messages=question, tools=[WEATHER], tool_choice=choice, temperature=0
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        assert message.model_extra["reasoning_content"].startswith(THOUGHT)
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGS)


def test_tool_choice_beside_response_format_is_refused(tool_server: ServerProcess) -> None:
    """A required call and a response_format cannot both hold: a 400, never one ignored."""
    client = client_of(tool_server)
    for fields in (
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"grammar": 'root ::= "x"'}},
    ):
        with pytest.raises(openai.BadRequestError, match="tool_choice") as refused:
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Hi"}],
                tools=[WEATHER],
                tool_choice="required",
                **fields,
            )
        assert refused.value.body["param"] == "tool_choice"
    auto = client.chat.completions.create(  # nothing required: the format alone holds
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER],
        response_format={"type": "json_object"},
        max_tokens=8,
    )
    assert auto.choices[0].finish_reason in ("stop", "length")
