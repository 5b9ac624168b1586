"""A real chat model through specdec: SmolLM2-135M-Instruct (Q4_1), with the ChatML
template in its own metadata and <|im_end|> as its end of turn. Its template renders as
transformers renders it; `run --chat` and `serve` answer in its format, end at its end of
turn, and a second turn of a conversation reuses the first's cached prompt."""

from __future__ import annotations

import json
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

from specdec_cli.llamacpp.model import Model
from specdec_cli.models import jinja
from specdec_cli.models.chat import Message, render

QUESTION = "What is the capital of France?"
# A question this small model answers by a wide margin at every token, "The capital of
# Japan is Tokyo." (2.5 logits or more here): that France's capital is Paris it says or not
# by machine (after SYSTEM its first token, "La" or "The", is a near tie: 0.13 logits).
FACT_QUESTION, FACT = "What is the capital of Japan?", "Tokyo"
SYSTEM = "You are a helpful assistant."
# A margin no CPU's kernels move: llama.cpp's move this model's logits by 0.08-0.13
# between batch shapes; greedy texts may part where two tokens are nearer than TIE.
WHOLE_LOGIT, TIE = 1.0, 0.5
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


def margins(top_logprobs: list[list[float]]) -> list[float]:
    """Each greedy token's lead over the runner-up, from its two likeliest log-probabilities."""
    return [top[0] - top[1] for top in top_logprobs]


def assert_the_fact_by_whole_logits(text_pieces: list[str], leads: list[float]) -> None:
    """FACT is in the answer, and every token up to it won by a whole logit: a fact that no
    machine's kernels can turn."""
    text = "".join(text_pieces)
    assert FACT in text, text
    upto = next(i for i in range(len(text_pieces)) if FACT in "".join(text_pieces[: i + 1]))
    assert min(leads[: upto + 1]) >= WHOLE_LOGIT, list(zip(text_pieces, leads, strict=True))


def assert_equal_but_for_a_near_tie(ours: list[dict], alone: list[dict]) -> None:
    """Two greedy runs' --json-tokens records: the same tokens, or the same up to a token
    where both runs put the two candidates within TIE (batch shapes break such ties either
    way on some CPU; a defect parts texts by whole logits)."""
    for mine, theirs in zip(ours, alone, strict=False):
        if mine["id"] != theirs["id"]:
            for record, other in ((mine, theirs["id"]), (theirs, mine["id"])):
                top = {t["id"]: t["logprob"] for t in record["top_logprobs"]}
                assert other in top and record["logprob"] - top[other] <= TIE, record
            return
    assert len(ours) == len(alone)


def run_chat(smollm2: Path, draft: str) -> dict[str, Any]:
    args = ["run", "-m", str(smollm2), "--chat", "--system", SYSTEM, "-p", FACT_QUESTION]
    result = specdec(*args, "--temp", "0", "-n", "24", "--logprobs", "2", "-d", draft, *QUICK)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_run_chat_answers_in_its_format(smollm2: Path) -> None:
    """The answer ends at the end of turn, without the template's markup, drafted or not;
    the drafted text is the target's own (but for near ties); the fact it states, where
    it wins by whole logits."""
    ours, alone = run_chat(smollm2, "ngram"), run_chat(smollm2, "none")
    for record in (ours, alone):
        assert record["stop_reason"] == "eos"
        assert not any(mark in record["text"] for mark in MARKUP), record["text"]
    assert_equal_but_for_a_near_tie(ours["token_list"], alone["token_list"])
    tokens = alone["token_list"]
    leads = margins([[t["logprob"] for t in record["top_logprobs"]] for record in tokens])
    assert_the_fact_by_whole_logits([record["text"] for record in tokens], leads)


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
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": FACT_QUESTION},
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = chat.choices[0]
    assert choice.message.content is not None
    assert not any(mark in choice.message.content for mark in MARKUP)
    assert choice.finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens < MAX_TOKENS
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    leads = margins([[t.logprob for t in token.top_logprobs] for token in tokens])
    assert_the_fact_by_whole_logits([token.token for token in tokens], leads)


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
