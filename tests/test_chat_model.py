"""A real chat model through specdec: SmolLM2-135M-Instruct (Q4_1), with the ChatML
template in its own metadata and <|im_end|> as its end of turn. Its template renders as
transformers renders it; `run --chat` and `serve` answer in its format, end at its end of
turn, and a second turn of a conversation reuses the first's cached prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import openai
import pytest
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_cli_run import specdec
from test_server import ServerProcess, start

from specdec_cli.llamacpp.llama import Model
from specdec_cli.models import jinja
from specdec_cli.models.chat import Message, render

QUESTION = "What is the capital of France?"
# Without a system message of its own the template writes a default one, after which this
# small model (as llama-cpp-python runs it too) answers the question with a French word list.
SYSTEM = "You are a helpful assistant."
SYSTEM_AND_USER = [
    Message("system", "You are a concise geography tutor."),
    Message("user", QUESTION),
]
MULTI_TURN = [
    Message("user", "Hi!"),
    Message("assistant", "Hello! How can I help you today?"),
    Message("user", QUESTION),
    Message("assistant", "The capital of France is Paris."),
    Message("user", "And of Italy?"),
]
MARKUP = ("<|im_start|>", "<|im_end|>")
# Nothing measured: flash attention as given and a fixed draft length (-k auto would
# measure the model's costs first, for ~10 s), as in test_real_model.
QUICK = ("-fa", "off", "--tree", "off", "-k", "4")


@pytest.fixture(scope="module")
def vocab(smollm2: Path) -> Iterator[Model]:
    """The model's tokenizer and metadata, loaded once (no weights)."""
    model = Model(smollm2, vocab_only=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def template(smollm2: Path) -> str:
    """tokenizer.chat_template as the gguf package reads it (not through llama.cpp); read
    once: GGUFReader parses the whole 49k-token vocabulary (seconds)."""
    field = GGUFReader(smollm2).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def render_as_transformers(
    template: str, messages: list[Message], add_generation_prompt: bool, **special: str
) -> str:
    """What transformers' apply_chat_template renders: plain jinja2, sandboxed, with its
    options, its raise_exception, and the messages as dicts."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    variables: dict[str, Any] = {
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "add_generation_prompt": add_generation_prompt,
        **special,
    }
    return env.from_string(template).render(**variables)


def test_the_model_ends_its_turns_with_im_end(vocab: Model, template: str) -> None:
    assert vocab.token_text(vocab.eos) == "<|im_end|>"
    assert vocab.chat_template() == template
    assert "<|im_start|>" in template


@pytest.mark.parametrize("messages", [SYSTEM_AND_USER, MULTI_TURN], ids=["system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
def test_its_template_renders_as_transformers_does(
    vocab: Model, template: str, messages: list[Message], add_generation_prompt: bool
) -> None:
    special = {"bos_token": vocab.token_text(vocab.bos), "eos_token": vocab.token_text(vocab.eos)}
    expected = render_as_transformers(template, messages, add_generation_prompt, **special)
    if add_generation_prompt:  # what run --chat and serve send: the model's own template
        ours = render(vocab, messages)
    else:
        dicts = [m.as_dict() for m in messages]
        ours = jinja.render(
            vocab.chat_template() or "", dicts, add_generation_prompt=False, **special
        )
    assert ours == expected
    assert expected.endswith("<|im_start|>assistant\n") is add_generation_prompt
    if messages is MULTI_TURN:  # no system message: the template writes its default one
        assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_run_chat_answers_in_its_format(smollm2: Path) -> None:
    args = ["run", "-m", str(smollm2), "--chat", "--system", SYSTEM, "-p", QUESTION]
    args += ["--temp", "0", "-n", "24"]
    result = specdec(*args, "-d", "ngram", *QUICK)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert not any(mark in result.stdout for mark in MARKUP), result.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[ServerProcess]:
    """One slot (so the conversation's turns meet their cache), greedy, the machine's
    threads (test_server's start asks for one), and no drafter: a server with one measures
    the costs -k auto may need before it is ready (seconds; what a request's "k" could ask
    for), and what is tested here is the chat format, not speculation (run's test drafts)."""
    args = ["-m", str(smollm2), "--temp", "0", "-np", "1", "-t", "0", "-fa", "off"]
    proc = start(tmp_path_factory.mktemp("serve-smollm2"), *args)
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


MAX_TOKENS = 48  # far more than the answer takes: it ends at <|im_end|>, not here


def test_serve_chat_ends_at_the_end_of_turn(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.message.content is not None and "Paris" in choice.message.content
    assert not any(mark in choice.message.content for mark in MARKUP)
    assert choice.finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens < MAX_TOKENS


def test_second_turn_reuses_the_first_turns_prompt(client: openai.OpenAI) -> None:
    turns: list[Any] = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Name a fruit that is yellow."},
    ]
    first = client.chat.completions.create(
        model="smollm2", messages=turns, max_tokens=MAX_TOKENS, temperature=0
    )
    reply = first.choices[0].message.content
    assert reply
    turns += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And red?"}]
    second = client.chat.completions.create(
        model="smollm2", messages=turns, max_tokens=MAX_TOKENS, temperature=0
    )
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # The whole first prompt, and most of the reply after it, are still in the slot.
    assert details.cached_tokens >= first.usage.prompt_tokens
    assert details.cached_tokens < second.usage.prompt_tokens
